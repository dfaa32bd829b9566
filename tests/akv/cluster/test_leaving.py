"""A worker whose code fails, or that is interrupted, fails the job at once, named.

Leaving a store with an exception (Ctrl-C and SIGTERM included) skips the exit barrier and
tells the scheduler that this worker failed, and why; every other process then fails within
seconds naming it, and the launcher's summary shows its traceback. A clean exit keeps the
barrier. The jobs here run in subprocesses (through akv-launch, or started by hand as a
user would), or in this process (:class:`Cluster`); every process a test starts is ended by
its PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

import akv
import akv.exits
from akv.cluster.roles import SIGNAL_STOP
from akv.cluster.scheduler import service as scheduler_service
from akv.exits import (
    MAX_REASON_CHARS,
    Terminated,
    describe,
    off_loop,
    second_signal_exits,
    sigterm_raises,
    sigterm_released,
)
from tests.akv.cluster.cluster import (
    ROOT,
    Cluster,
    free_port,
    job_env,
    launch,
    printed,
    wait_until,
)

JOBS = ROOT / "tests" / "akv" / "cluster" / "jobs"
pytestmark = pytest.mark.timeout(120)
#: "Within seconds": the bound these tests hold every failure to (the round deadline they
#: would otherwise wait for is 20 s under FAST_TIMEOUTS, 300 s by default).
FAILS_WITHIN_S = 15.0


# ---------------------------------------------------------------- the reason, the signals


def test_the_reason_names_the_exception_or_the_signal():
    assert (
        describe(ValueError("boom\n  at  step 3")) == "its code raised ValueError: boom at step 3"
    )
    assert describe(RuntimeError()) == "its code raised RuntimeError"
    assert describe(KeyboardInterrupt()) == "it was interrupted (Ctrl-C)"
    assert describe(Terminated()) == "it was stopped by SIGTERM"
    assert describe(SystemExit(4)) == "its code exited with status 4"
    assert describe(asyncio.CancelledError()).startswith("its task was cancelled")
    long = describe(ValueError("x" * 5000))
    assert len(long) == MAX_REASON_CHARS and long.endswith("...")


@pytest.fixture(autouse=True)
def default_sigterm(monkeypatch):
    """Each test starts from the default SIGTERM handler and no store holding it (stores
    that earlier tests left open keep theirs), and leaves the handler as it found it."""
    monkeypatch.setattr(akv.exits, "_HOLDER", akv.exits._SigtermHolder())
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_a_failing_sys_exit_on_the_main_thread_is_noted_until_a_store_is_used(monkeypatch):
    from akv import exits

    at_exit = exits._AtExit()
    monkeypatch.setattr(sys, "exit", sys.exit)  # (restored after the test)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(exits.atexit, "register", lambda fn: None)
    monkeypatch.setattr(exits.NOTED_EXIT, "exit", None)
    at_exit.install()
    with pytest.raises(SystemExit) as caught:
        sys.exit(0)
    assert caught.value.code == 0 and exits.NOTED_EXIT.exit is None  # a normal end

    def exit_a_thread() -> None:  # (SystemExit ends that thread only)
        with contextlib.suppress(SystemExit):
            sys.exit(4)

    elsewhere = threading.Thread(target=exit_a_thread)
    elsewhere.start()
    elsewhere.join(10)
    assert exits.NOTED_EXIT.exit is None
    with pytest.raises(SystemExit) as caught:
        sys.exit(3)
    assert caught.value.code == 3
    noted = exits.NOTED_EXIT.exit
    assert isinstance(noted, SystemExit) and noted.code == 3
    # Caught (argparse in a try, IPython), and the program went on with its store: the
    # note is dropped, and a later normal end closes the store normally.
    with akv.create("local") as kv:
        kv.init(0, np.zeros(1, np.float32))
    assert exits.NOTED_EXIT.exit is None


def test_sigterm_raises_terminated_while_a_store_holds_it_then_the_default_comes_back():
    assert sigterm_raises() and sigterm_raises()  # two stores
    try:
        with pytest.raises(Terminated) as info:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler runs at the next bytecode; never reached
        assert info.value.code == 143
        sigterm_released()
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # one store left
    finally:
        sigterm_released()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_handler_of_the_programs_own_is_kept():
    def mine(signo, frame):
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        assert not sigterm_raises()
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_off_the_main_thread_no_handler_is_touched():
    held: list[bool] = []
    thread = threading.Thread(target=lambda: held.append(sigterm_raises()))
    thread.start()
    thread.join()
    assert held == [False] and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_the_handlers_come_back_after_the_leaving():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with second_signal_exits():
        assert signal.getsignal(signal.SIGINT) not in before
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


# ---------------------------------------------------------------- in this process


async def test_an_exception_inside_async_with_fails_the_other_workers_at_once():
    with Cluster(2, 1) as cluster:
        alive, failing = sorted(await cluster.workers(), key=lambda kv: kv.rank)
        await asyncio.gather(
            alive.init("w", np.zeros(3, np.float32)), failing.init("w", np.zeros(3, np.float32))
        )
        await alive.push("w", np.ones(3, np.float32))
        waiting = asyncio.ensure_future(alive.pull("w"))  # needs worker 1's push

        async def fail() -> None:
            async with failing:
                raise ValueError("boom")

        started = time.monotonic()
        with pytest.raises(ValueError, match="boom"):  # the caller's error, not the store's
            await fail()
        with pytest.raises(
            akv.PeerLostError, match=r"worker 1 .*left the job: its code raised ValueError: boom"
        ):
            await asyncio.wait_for(waiting, FAILS_WITHIN_S)
        assert time.monotonic() - started < FAILS_WITHIN_S
        await alive.close()  # the pull raised the failure; closing adds nothing
        assert cluster.scheduler is not None
        assert "worker 1" in str(cluster.scheduler.roster.failure)


async def test_a_clean_exit_still_waits_at_the_barrier_for_the_others():
    with Cluster(2, 1) as cluster:
        first, second = sorted(await cluster.workers(), key=lambda kv: kv.rank)
        await asyncio.gather(
            first.init("w", np.zeros(3, np.float32)), second.init("w", np.zeros(3, np.float32))
        )

        async def leave_cleanly() -> None:
            async with first:
                pass

        leaving = asyncio.ensure_future(leave_cleanly())
        await asyncio.sleep(0.5)
        assert not leaving.done()  # at the exit barrier, for worker 1
        await second.close()
        await asyncio.wait_for(leaving, FAILS_WITHIN_S)
        assert cluster.scheduler is not None and cluster.scheduler.roster.failure is None


# ---------------------------------------------------------------- under akv-launch


def test_an_exception_inside_with_fails_the_job_at_once_and_the_launcher_shows_it():
    started = time.monotonic()
    done = launch(
        ["-n", "2", "-s", "1", "--", sys.executable, str(JOBS / "faults.py"), "raise"],
        timeout=90,
    )
    output = done.stdout + done.stderr
    assert time.monotonic() - started < 30, output  # not the round deadline
    assert done.returncode != 0, output
    verdict = re.search(r"akv-launch: the scheduler's verdict: the job failed: (.*)", output)
    assert verdict is not None, output
    assert re.match(
        r"worker 1 \(pid \d+ on 127\.0\.0\.1\) left the job: its code raised ValueError: "
        r"boom in the training loop$",
        verdict.group(1),
    ), verdict.group(1)
    traceback = output.split("akv-launch: worker 1's traceback:\n", 1)
    assert len(traceback) == 2, output
    assert "Traceback (most recent call last):" in traceback[1]
    assert "ValueError: boom in the training loop" in traceback[1]
    got = re.search(r"rank 0 got PeerLostError after ([\d.]+) s: (.*)", output)
    if got is not None:  # printed unless the launcher stopped it first
        assert float(got.group(1)) < FAILS_WITHIN_S
        assert got.group(2).startswith("the job failed: worker 1 "), got.group(2)


def test_a_scheduler_that_hangs_as_the_workers_leave_fails_their_close_at_its_heartbeat():
    """Worker 0 stops the scheduler (SIGSTOP); both workers then close, which waits at the
    exit barrier. The heartbeats find the scheduler silent, and that ends the barrier's wait:
    each close raises the heartbeat's finding. Before, the barrier's request waited out its
    own deadline (AKV_REQUEST_TIMEOUT_S, 300 s by default), and a SIGTERM could not end
    it either."""
    done = launch(
        ["-n", "2", "-s", "1", "--", sys.executable, str(JOBS / "scheduler_hangs.py")],
        timeout=90,
    )
    output = done.stdout + done.stderr
    said = printed(done, "error")
    assert sorted(s["rank"] for s in said) == [0, 1], output
    for each in said:
        assert each["error"] == "PeerLostError", each
        assert re.match(r"the scheduler at \S+ has not answered for [\d.]+ s", each["message"])
        assert each["after_s"] < FAILS_WITHIN_S, each  # its request's deadline is 30 s here
    # The server ended on its own (the job failed), not by the launcher's SIGTERM or SIGKILL.
    assert re.search(r"^akv-launch: server +0 +3 ", output, re.M), output


def test_a_store_never_closed_is_closed_at_exit_with_the_barrier_after_a_normal_end():
    done = launch(
        ["-n", "2", "-s", "1", "--", sys.executable, str(JOBS / "unclosed.py"), "clean"],
        timeout=90,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "[worker 0] rank 0 done: 2.0" in output and "[worker 1] rank 1 done: 2.0" in output
    assert "Unclosed" not in output  # aiohttp's warnings of sessions nobody closed
    # The close at exit stops the heartbeat threads too (asyncio.to_thread, refused while
    # the interpreter exits, once left them running into its finalization: a rare SIGSEGV).
    for rank in (0, 1):
        assert f"[worker {rank}] akv threads left at exit: []" in output, output


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("raise", "its code raised ValueError: boom in a script"),
        # SystemExit reaches no hook: the store was closed with the exit barrier, where
        # worker 1 waited for worker 0, which waited for its push (300 s, then worker 0 was
        # blamed and the job's code was 1; found by a review).
        ("exit", r"its code exited with status 3$"),
    ],
)
def test_a_store_never_closed_leaves_as_failed_when_an_exception_or_exit_ends_the_program(
    mode, reason
):
    started = time.monotonic()
    done = launch(
        ["-n", "2", "-s", "1", "--", sys.executable, str(JOBS / "unclosed.py"), mode],
        timeout=90,
    )
    output = done.stdout + done.stderr
    assert time.monotonic() - started < 30, output
    assert done.returncode != 0, output  # (worker 1's, or worker 0's should it exit first)
    assert re.search(
        r"akv-launch: the scheduler's verdict: the job failed: worker 1 \(pid \d+ on "
        rf"127\.0\.0\.1\) left the job: {reason}",
        output,
        re.M,
    ), output
    if mode == "exit":
        assert re.search(r"akv-launch: worker 1 \(pid \d+\) exited with code 3", output), output
    assert "Unclosed" not in output


# ---------------------------------------------------------------- started by hand


@contextmanager
def hand_started_job(num_workers: int = 2) -> Iterator[tuple[list[subprocess.Popen], dict]]:
    """A scheduler, a server and ``faults.py interruptible`` workers, started as a user
    would start them by hand (no launcher). Yields (scheduler, server, *workers) and the
    job's environment; every process is ended by its PID afterwards."""
    env = {**os.environ, **job_env(num_workers, 1, free_port())}
    env.pop("AKV_ROLE", None)
    processes: list[subprocess.Popen] = []

    def start(role: str, argv: list[str], rank: int | None = None) -> None:
        role_env = {**env, "AKV_ROLE": role}
        if rank is not None:
            role_env["AKV_RANK"] = str(rank)
        processes.append(
            subprocess.Popen(
                argv,
                env=role_env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )

    try:
        start("scheduler", [sys.executable, "-m", "akv.cluster.scheduler"])
        start("server", [sys.executable, "-m", "akv.cluster.server"], 0)
        for rank in range(num_workers):
            start("worker", [sys.executable, str(JOBS / "faults.py"), "interruptible"], rank)
        yield processes, env
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate(timeout=30)


def _read_until(process: subprocess.Popen, pattern: str, timeout_s: float) -> str:
    """The output of ``process`` up to the first line matching ``pattern``."""
    lines: list[str] = []
    found = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if re.search(pattern, line):
                found.set()
                return

    threading.Thread(target=read, daemon=True).start()
    assert found.wait(timeout_s), f"no line matching {pattern!r}:\n{''.join(lines)}"
    return "".join(lines)


def _rest(process: subprocess.Popen, timeout_s: float) -> tuple[int, str]:
    """The exit status and the rest of the output of ``process``, which ends within
    ``timeout_s``; else a failure that shows where its threads were (SIGUSR1: the fault
    job's faulthandler dumps them), with the output so far."""
    try:
        out, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGUSR1)
        try:
            out, _ = process.communicate(timeout=5)
        except subprocess.TimeoutExpired as late:
            out = late.output.decode(errors="replace") if isinstance(late.output, bytes) else ""
        pytest.fail(f"the process did not end within {timeout_s} s; its output:\n{out}")
    return process.returncode, out


@pytest.mark.parametrize(
    ("signo", "reason", "status"),
    [
        (signal.SIGINT, "it was interrupted (Ctrl-C)", -signal.SIGINT),
        (signal.SIGTERM, "it was stopped by SIGTERM", 128 + signal.SIGTERM),
    ],
)
def test_interrupting_a_hand_started_worker_fails_the_job_naming_it(signo, reason, status):
    with hand_started_job() as (processes, _):
        scheduler, server, worker0, worker1 = processes
        _read_until(worker1, r"rank 1 ready", 60)
        _read_until(worker0, r"rank 0 ready", 60)
        started = time.monotonic()
        worker1.send_signal(signo)
        code1, out1 = _rest(worker1, FAILS_WITHIN_S)
        code0, out0 = _rest(worker0, FAILS_WITHIN_S)
        assert time.monotonic() - started < FAILS_WITHIN_S
        assert code1 == status, out1
        got = re.search(r"rank 0 got PeerLostError after [\d.]+ s: (.*)", out0)
        assert got is not None, out0
        assert re.match(
            rf"the job failed: worker 1 \(pid {worker1.pid} on 127\.0\.0\.1\) left the job: "
            + re.escape(reason),
            got.group(1),
        ), got.group(1)
        assert code0 == 4, out0
        # The scheduler and the server end too, saying why.
        code, out = _rest(scheduler, FAILS_WITHIN_S)
        assert code != 0 and f"job failed: worker 1 (pid {worker1.pid}" in out, out
        assert _rest(server, FAILS_WITHIN_S)[0] != 0


def test_a_second_ctrl_c_ends_a_leaving_worker_at_once():
    with hand_started_job() as (processes, _):
        scheduler, _server, worker0, worker1 = processes
        _read_until(worker1, r"rank 1 ready", 60)
        _read_until(worker0, r"rank 0 ready", 60)
        # A scheduler that does not answer makes the leaving wait for its report...
        scheduler.send_signal(signal.SIGSTOP)
        try:
            worker1.send_signal(signal.SIGINT)
            _read_until(
                worker1,
                r"akv: worker 1 leaves the job: it was interrupted \(Ctrl-C\); a second "
                r"Ctrl-C or SIGTERM ends it at once",
                FAILS_WITHIN_S,
            )
            # ... which a second Ctrl-C cuts short: os._exit(130), not death by SIGINT.
            worker1.send_signal(signal.SIGINT)
            code, out = _rest(worker1, FAILS_WITHIN_S)
            assert code == 128 + signal.SIGINT, out
        finally:
            scheduler.send_signal(signal.SIGCONT)


# ---------------------------------------------------------------- off_loop


async def test_off_loop_returns_the_result_and_raises_the_error_of_the_call():
    assert await off_loop(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(ZeroDivisionError):
        await off_loop(lambda: 1 / 0)


def test_off_loop_works_while_the_interpreter_exits_where_to_thread_is_refused():
    # What a store closed at exit awaits (the heartbeat's stop): asyncio.to_thread is
    # refused there, off_loop is not.
    script = (
        "import asyncio, atexit\n"
        "from akv.exits import off_loop\n"
        "def at_exit():\n"
        "    for name, run in (('off_loop', off_loop), ('to_thread', asyncio.to_thread)):\n"
        "        try:\n"
        "            print(name, asyncio.run(run(lambda: 'ran')), flush=True)\n"
        "        except RuntimeError as exc:\n"
        "            print(name, 'refused', exc, flush=True)\n"
        "atexit.register(at_exit)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "off_loop ran" in done.stdout, done.stdout
    assert "to_thread refused" in done.stdout, done.stdout  # the reason off_loop exists


async def test_the_job_ends_once_the_workers_left_not_at_the_next_heartbeat(monkeypatch):
    """With a heartbeat interval of 60 s (and the scheduler's check interval too), each
    worker's close, the server's stop and the scheduler's exit do not wait for it. Before,
    close waited for its heartbeat thread to wake (up to an interval: 1 s by default), the
    server heard that the job ended at its next heartbeat, and the scheduler exited two
    checks (0.5-1 s) after the end."""
    monkeypatch.setattr(scheduler_service, "SCHEDULER_CHECK_INTERVAL_S", 60.0)
    with Cluster(2, 1, AKV_HEARTBEAT_INTERVAL_S="60", AKV_HEARTBEAT_TIMEOUT_S="120") as cluster:
        stores = await cluster.workers()
        await asyncio.gather(*(kv.init("w", np.zeros(2, np.float32)) for kv in stores))
        reports = cluster.scheduler.reports
        nodes = [kv._backend.membership.node_id for kv in stores]
        await wait_until(lambda: all(reports.of(n) for n in nodes), "their first heartbeats")
        # (between their first and second heartbeats)
        await asyncio.wait_for(asyncio.gather(*(kv.close() for kv in stores)), 20)
        assert not any(kv._backend._heartbeat._thread.is_alive() for kv in stores)
        await wait_until(lambda: all(task.done() for task in cluster._tasks), "the end", 20)
        assert [task.result() for task in cluster._tasks] == [0, 0]  # scheduler, server


async def test_a_scheduler_stopped_by_a_signal_once_every_worker_finished_ends_the_job_well():
    """SIGTERM to the scheduler (a cluster manager tearing the job down) after every worker
    finished and before the server said goodbye: it waits for the server's goodbye and
    exits 0. Before, it failed the job ("the scheduler was stopped by a signal")."""
    with Cluster(2, 1, AKV_HEARTBEAT_INTERVAL_S="60", AKV_HEARTBEAT_TIMEOUT_S="120") as cluster:
        stores = await cluster.workers()
        await asyncio.gather(*(kv.init("w", np.zeros(2, np.float32)) for kv in stores))
        server, loop = cluster.servers[0], cluster.thread.loop
        heartbeat_wake = server._every_worker_left  # the server's next heartbeat waits
        server._every_worker_left = asyncio.Event()  # (for it, not for this test)
        await asyncio.wait_for(asyncio.gather(*(kv.close() for kv in stores)), 20)
        roster = cluster.scheduler.roster
        await wait_until(roster.servers_should_stop, "every worker finished")
        assert not roster.done()  # the server has not said goodbye
        scheduler_task = cluster._tasks[0]
        loop.call_soon_threadsafe(scheduler_task.cancel, SIGNAL_STOP)  # as on SIGTERM
        # Then (the loop runs callbacks in order) the server's heartbeat hears stop.
        loop.call_soon_threadsafe(heartbeat_wake.set)
        await wait_until(lambda: all(task.done() for task in cluster._tasks), "the end", 20)
        assert [task.result() for task in cluster._tasks] == [0, 0]  # scheduler, server
        assert roster.failure is None
