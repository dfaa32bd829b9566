"""The scheduler's status page in a real headless browser (Debian's chromium, driven by
selenium through chromedriver) while a 2-worker job runs: the login form, every rank on the
page, and a worker stopped with SIGSTOP shown as the one the round waits for.

Skipped, saying what to install, where there is no chromium, chromedriver or selenium.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.akv.cluster.cluster import ROOT, Cluster

pytestmark = pytest.mark.timeout(90)

INSTALL = (
    "needs a headless browser: apt-get install chromium chromium-driver (Debian), and "
    "selenium: pip install -e '.[test]'"
)
JOB = ROOT / "tests" / "akv" / "cluster" / "jobs" / "status_worker.py"
#: Every wait for the page to show something (it reloads itself every 2 s).
PAGE_WAIT_S = 30
#: The stalled worker must not be declared dead while the test looks at it.
PATIENT = {"AKV_HEARTBEAT_TIMEOUT_S": "60", "AKV_ROUND_TIMEOUT_S": "60"}


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    webdriver = pytest.importorskip("selenium.webdriver", reason=INSTALL)
    chromium = next(
        (found for name in ("chromium", "chromium-browser") if (found := shutil.which(name))),
        None,
    )
    chromedriver = shutil.which("chromedriver")
    if chromium is None or chromedriver is None:
        pytest.skip(INSTALL)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in (
        "--headless=new",
        "--no-sandbox",  # as root, in a container
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
    ):
        options.add_argument(argument)
    # The system's chromedriver: selenium downloads nothing.
    service = webdriver.ChromeService(executable_path=chromedriver)
    driver = webdriver.Chrome(service=service, options=options)
    driver.set_page_load_timeout(PAGE_WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


def rows(driver: Any) -> dict[tuple[str, str], dict[str, str]]:
    """The page's process table: (role, rank) -> the row's state and pid."""
    from selenium.webdriver.common.by import By

    table = {}
    for row in driver.find_elements(By.CSS_SELECTOR, "#nodes tbody tr"):
        cells = row.find_elements(By.TAG_NAME, "td")
        table[(row.get_attribute("data-role"), row.get_attribute("data-rank"))] = {
            "state": row.get_attribute("data-state"),
            "pid": cells[3].text,
        }
    return table


def wait_for(driver: Any, condition: Any, what: str) -> Any:
    """Wait (at most ``PAGE_WAIT_S``) until ``condition(driver)`` is true, as the page
    reloads itself; fail naming ``what`` and showing the page."""
    from selenium.common.exceptions import (
        StaleElementReferenceException,
        TimeoutException,
        WebDriverException,
    )
    from selenium.webdriver.support.ui import WebDriverWait

    def on_this_page(driver: Any) -> Any:
        # An element of the page that reloaded meanwhile: Chrome reports it stale, or
        # (from a script reading its attribute) as a node of no document. Look again.
        try:
            return condition(driver)
        except WebDriverException as exc:
            if "does not belong to the document" in str(exc):
                return None
            raise

    wait = WebDriverWait(
        driver, PAGE_WAIT_S, poll_frequency=0.2, ignored_exceptions=[StaleElementReferenceException]
    )
    try:
        return wait.until(on_this_page)
    except TimeoutException:
        text = driver.find_element("tag name", "body").text
        raise AssertionError(
            f"{what}: not within {PAGE_WAIT_S} s; the page says:\n{text}"
        ) from None


def test_the_page_shows_every_rank_and_the_stalled_worker_its_round_waits_for(browser, tmp_path):
    from selenium.webdriver.common.by import By

    stop_file = tmp_path / "stop"
    with Cluster(2, 1, **PATIENT) as cluster:
        token = cluster.env["AKV_TOKEN"]
        logs = [(tmp_path / f"worker{rank}.out").open("w") for rank in range(2)]
        workers = [
            subprocess.Popen(
                [sys.executable, str(JOB), str(stop_file)],
                env={**os.environ, **cluster.worker_env(rank)},
                cwd=ROOT,
                stdout=logs[rank],
                stderr=subprocess.STDOUT,
            )
            for rank in range(2)
        ]
        stopped = False
        try:
            assert cluster.scheduler is not None
            base = f"http://127.0.0.1:{cluster.scheduler.port}"
            browser.get(base + "/status")
            assert browser.current_url == base + "/login"  # no login yet: redirected
            browser.find_element(By.ID, "token").send_keys(token)
            browser.find_element(By.ID, "login").click()
            wait_for(browser, lambda d: d.current_url == base + "/status", "logged in")

            pids = {("worker", str(rank)): str(w.pid) for rank, w in enumerate(workers)}

            def everyone_runs(driver: Any) -> bool:
                table = rows(driver)
                states = {place: row["state"] for place, row in table.items()}
                shown = {place: table[place]["pid"] for place in pids if place in table}
                return (
                    states
                    == {
                        ("scheduler", ""): "running",
                        ("server", "0"): "running",
                        ("worker", "0"): "running",
                        ("worker", "1"): "running",
                    }
                    and shown == pids
                )

            wait_for(browser, everyone_runs, "every rank running, workers with their pids")
            cookies = {c["name"]: c for c in browser.get_cookies()}
            session = cookies["akv_session"]
            assert session["httpOnly"] and session["sameSite"] == "Strict"
            assert token not in session["value"] and token not in browser.page_source

            os.kill(workers[1].pid, signal.SIGSTOP)
            stopped = True

            def waits_for_worker_1(driver: Any) -> str | None:
                """The round's sentence once it names worker 1, the stopped one."""
                waiting = driver.find_element(By.ID, "round")
                table = rows(driver)
                if (
                    waiting.get_attribute("data-waiting-for") == "1"
                    and table[("worker", "1")]["state"] == "late"
                    and table[("worker", "0")]["state"] != "late"
                ):
                    return str(waiting.text)
                return None

            said = wait_for(browser, waits_for_worker_1, "the round waits for the stopped worker")
            assert said.startswith("The current round waits for worker 1 for"), said
            os.kill(workers[1].pid, signal.SIGCONT)
            stopped = False
            stop_file.touch()
            for rank, worker in enumerate(workers):
                output = tmp_path / f"worker{rank}.out"
                assert worker.wait(timeout=PAGE_WAIT_S) == 0, output.read_text()
        finally:
            for worker in workers:
                if stopped:
                    os.kill(worker.pid, signal.SIGCONT)
                if worker.poll() is None:
                    worker.kill()
                    worker.wait(timeout=10)
            for log in logs:
                log.close()
