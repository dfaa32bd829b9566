"""The liveness clock of a stream's end, driven by hand (no sockets, no loop)."""

from __future__ import annotations

import pytest

from akv_transport._liveness import (
    CONFIRM_S,
    DEFAULT_KEEPALIVE_INTERVAL_S,
    DEFAULT_SILENT_S,
    Due,
    KeepAlive,
    LivenessClock,
)

SETTINGS = KeepAlive(interval_s=5.0, silent_s=20.0)


def test_the_defaults_leave_a_live_but_blocked_peer_fifteen_seconds():
    keepalive = KeepAlive()
    assert (keepalive.interval_s, keepalive.silent_s) == (5.0, 20.0)
    assert (DEFAULT_KEEPALIVE_INTERVAL_S, DEFAULT_SILENT_S) == (5.0, 20.0)
    assert keepalive.silent_s - keepalive.interval_s == 15.0


@pytest.mark.parametrize(
    ("interval_s", "silent_s", "problem"),
    [
        (0, 20, "interval_s must be positive"),
        (5, float("inf"), "silent_s must be positive"),
        (float("nan"), 20, "interval_s must be positive"),
        (5, -1, "silent_s must be positive"),
        (5, 9.9, "at least twice interval_s"),
    ],
)
def test_settings_a_live_peer_could_not_meet_are_refused(interval_s, silent_s, problem):
    with pytest.raises(ValueError, match=problem):
        KeepAlive(interval_s, silent_s)


def test_an_end_that_wrote_nothing_for_an_interval_sends_a_keepalive():
    clock = LivenessClock(SETTINGS, now=100.0)
    assert clock.next_check == 105.0
    assert clock.poll(104.9) is Due.NOTHING
    assert clock.poll(105.0) is Due.KEEPALIVE
    clock.sent(105.0)
    assert clock.next_check == 110.0


def test_writing_frames_puts_the_keepalive_off():
    clock = LivenessClock(SETTINGS, now=0.0)
    for now in (3.0, 6.0, 9.0):
        clock.sent(now)
        clock.received(now)
        assert clock.poll(now + 4.9) is Due.NOTHING
    assert clock.next_check == 14.0


def test_silence_is_cut_only_when_still_silent_a_moment_after_it_was_seen():
    clock = LivenessClock(SETTINGS, now=0.0)
    clock.sent(19.0)
    assert clock.poll(19.9) is Due.NOTHING
    assert clock.poll(20.0) is Due.NOTHING  # seen silent: checked again CONFIRM_S later
    assert clock.next_check == 20.0 + CONFIRM_S
    assert clock.poll(20.0 + CONFIRM_S / 2) is Due.NOTHING
    assert clock.poll(20.0 + CONFIRM_S) is Due.CUT
    assert clock.silence(20.0 + CONFIRM_S) == pytest.approx(20.1)


def test_bytes_read_after_a_blocked_loop_save_the_stream():
    # The loop was blocked for 30 s: the timer runs first, then the bytes waiting in the
    # socket are read, and the confirming check finds the stream alive.
    clock = LivenessClock(SETTINGS, now=0.0)
    clock.sent(0.0)
    assert clock.poll(30.0) is Due.KEEPALIVE  # silence seen, and nothing written for 30 s
    clock.sent(30.0)
    clock.received(30.01)
    assert clock.poll(30.0 + CONFIRM_S) is Due.NOTHING
    assert clock.next_check == 35.0


def test_any_byte_received_counts_as_life():
    # A payload that crawls in (a few bytes now and then) keeps its stream however long.
    clock = LivenessClock(SETTINGS, now=0.0)
    for step in range(1, 200):
        clock.received(step * 19.0)  # a byte every 19 s, for an hour
        assert clock.poll(step * 19.0 + 18.9) is not Due.CUT


def test_an_end_that_may_not_send_yet_only_times_silence():
    clock = LivenessClock(SETTINGS, now=0.0, sending=False)
    assert clock.next_check == 20.0
    assert clock.poll(19.0) is Due.NOTHING  # no keepalive before the upgrade's answer
    assert clock.poll(20.0) is Due.NOTHING
    assert clock.poll(20.0 + CONFIRM_S) is Due.CUT
