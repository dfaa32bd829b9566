"""The status page's HTML (:mod:`akv.cluster.scheduler.status_html`): what it shows and
that nothing from the job is taken as markup."""

from __future__ import annotations

from akv.cluster.scheduler.roster import Roster
from akv.cluster.scheduler.status import Reports, ServerReport, WaitingRound, job_status
from akv.cluster.scheduler.status_html import render_login, render_status


def test_every_value_from_the_job_is_escaped():
    hostile = "<script>alert(1)</script>"
    roster = Roster(1, 1, heartbeat_timeout_s=5.0)
    roster.register("s", "server", hostile, 4000, 10, now=0.0)
    roster.register("w", "worker", "10.0.0.2", 0, 11, now=0.0)
    reports = Reports()
    reports.heard("s", ServerReport(1, 4, 0, WaitingRound(repr(hostile), 1, 0.5, 1, (0,))), 0.0)
    roster.lost("w", "server", 0, hostile)
    page = render_status(job_status(roster, reports, 1.0, scheduler=("h", 1, 2)), refresh_s=2)
    assert "<script" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert render_login(hostile).count("<script") == 0


def test_the_page_marks_the_job_each_node_and_whom_the_round_waits_for():
    roster = Roster(2, 1, heartbeat_timeout_s=5.0)
    roster.register("s", "server", "10.0.0.1", 4000, 10, now=0.0)
    roster.register("w", "worker", "10.0.0.2", 0, 11, now=0.0)
    reports = Reports()
    reports.heard("s", ServerReport(2, 3 << 20, 7, WaitingRound("'w'", 8, 1.0, 2, (0, 1))), 0.0)
    page = render_status(job_status(roster, reports, 0.5, scheduler=("h", 1, 2)), refresh_s=5)
    assert '<meta http-equiv="refresh" content="5">' in page
    assert 'id="job-state" class="state assembling" data-state="assembling"' in page
    assert 'data-role="server" data-rank="0" data-state="joined"' in page
    assert 'data-role="worker" data-rank="1" data-state="not joined"' in page
    assert 'id="round" class="box waiting" data-waiting-for="0 1"' in page
    assert "waits for <strong>worker 0, worker 1</strong> for 1.5 s" in page
    assert ">3.0 MiB<" in page and "2 open rounds" in page
    assert 'id="failure"' not in page


def test_a_failure_is_shown_with_whom_it_blames():
    roster = Roster(1, 1, heartbeat_timeout_s=5.0)
    roster.register("w", "worker", "10.0.0.2", 0, 11, now=0.0)
    roster.register("s", "server", "10.0.0.1", 4000, 10, now=0.0)
    roster.lost("s", "worker", 0, "its stream ended")
    page = render_status(job_status(roster, Reports(), 1.0, scheduler=("h", 1, 2)), refresh_s=2)
    assert 'id="failure" class="box failed" data-blamed="worker 0"' in page
    assert 'data-waiting-for=""' in page
