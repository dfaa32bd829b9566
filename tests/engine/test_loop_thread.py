"""``LoopThread``: a loop on a thread of its own, optionally under batch scheduling."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from akv_engine import LoopThread

needs_batch = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="needs Linux's SCHED_BATCH")


async def _where() -> tuple[int, int]:
    return threading.get_native_id(), os.sched_getscheduler(0)


@needs_batch
def test_a_batch_loop_thread_runs_its_coroutines_under_sched_batch_and_the_caller_keeps_its_own():
    caller = os.sched_getscheduler(0)
    thread = LoopThread(name="test-batch", batch=True)
    try:
        native_id, policy = thread.run(_where())
        assert native_id == thread.native_id != threading.get_native_id()
        assert (thread.scheduling, policy) == ("batch", os.SCHED_BATCH)
        assert os.sched_getscheduler(0) == caller
    finally:
        thread.close()
    assert not thread.running


@needs_batch
def test_a_loop_thread_keeps_its_creators_policy_by_default():
    thread = LoopThread(name="test-normal")
    try:
        assert thread.run(_where())[1] == os.sched_getscheduler(0)
        assert thread.scheduling == "normal"
    finally:
        thread.close()


def test_a_refused_or_missing_batch_policy_leaves_the_thread_normal_and_says_why(monkeypatch):
    def refuse(pid: int, policy: int, param: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "SCHED_BATCH", 3, raising=False)
    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    thread = LoopThread(name="test-refused", batch=True)
    try:
        assert thread.scheduling.startswith("normal (SCHED_BATCH refused:")
        assert "Operation not permitted" in thread.scheduling
        assert thread.run(asyncio.sleep(0, "still runs")) == "still runs"
    finally:
        thread.close()
    monkeypatch.delattr(os, "SCHED_BATCH")
    thread = LoopThread(name="test-missing", batch=True)
    try:
        assert thread.scheduling == "normal (this system has no SCHED_BATCH)"
    finally:
        thread.close()
