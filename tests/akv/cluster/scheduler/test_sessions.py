"""The status page's logins (:class:`Sessions`)."""

from akv.cluster.scheduler.sessions import Sessions


def test_a_session_is_valid_until_it_ends_or_is_closed():
    sessions = Sessions(lifetime_s=10.0)
    first = sessions.open(now=0.0)
    second = sessions.open(now=0.0)
    assert first != second and len(first) >= 40
    assert sessions.valid(first, 9.9) and not sessions.valid(first, 10.0)
    sessions.close(second)
    assert not sessions.valid(second, 1.0)
    sessions.close("never opened")  # ignored
    assert not sessions.valid("never opened", 1.0)
    assert not sessions.valid(first[:-1], 1.0)


def test_the_oldest_session_goes_when_too_many_are_open_and_ended_ones_are_dropped():
    sessions = Sessions(lifetime_s=10.0, max_sessions=3)
    ids = [sessions.open(now=float(n)) for n in range(4)]
    assert [sessions.valid(i, 4.0) for i in ids] == [False, True, True, True]
    sessions.open(now=12.5)  # the ones opened at 1 and 2 ended
    assert len(sessions) == 2


def test_the_table_keeps_no_session_id():
    sessions = Sessions()
    session = sessions.open(now=0.0)
    assert session.encode() not in repr(sessions._ends).encode()
    assert all(len(digest) == 32 for digest in sessions._ends)
