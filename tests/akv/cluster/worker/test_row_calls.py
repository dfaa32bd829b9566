"""How a worker settles its row pushes' answers (``RowCalls.settle``), without sockets: the
first server error is returned, other failures raised, each answer settled once."""

from __future__ import annotations

import asyncio

import pytest

from akv.cluster.config import Timeouts
from akv.cluster.worker.row_calls import RowCalls
from akv.errors import DoublePushError


def calls(**answers: list[asyncio.Future]) -> RowCalls:
    """RowCalls with ``answers`` (by key) sent and not yet awaited."""
    rows = RowCalls(engine=None, links=lambda: [], timeouts=Timeouts())  # type: ignore[arg-type]
    rows._unanswered = {key: list(futures) for key, futures in answers.items()}
    return rows


def done(loop, error: BaseException | None = None) -> asyncio.Future:
    future = loop.create_future()
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
    return future


async def test_answers_already_in_are_settled_without_waiting():
    loop = asyncio.get_running_loop()
    refused = DoublePushError("worker 0 pushed key 'emb' twice in round 1")
    rows = calls(emb=[done(loop), done(loop, refused)], other=[done(loop)])
    settling = rows.settle(["emb"])
    with pytest.raises(StopIteration) as finished:  # no await: settled in one step
        settling.send(None)
    assert finished.value.value is refused
    assert list(rows._unanswered) == ["other"]  # only the keys asked for are taken


async def test_answers_in_flight_are_awaited():
    loop = asyncio.get_running_loop()
    first, second = loop.create_future(), loop.create_future()
    rows = calls(emb=[done(loop), first], table=[second])
    settling = asyncio.ensure_future(rows.settle())
    await asyncio.sleep(0)
    assert not settling.done()
    refused = DoublePushError("refused")
    first.set_exception(refused)
    second.set_result(None)
    assert await asyncio.wait_for(settling, 5) is refused
    assert rows._unanswered == {}
    assert await rows.settle() is None  # each error is told once


@pytest.mark.parametrize("in_flight", [False, True])
async def test_a_failure_that_is_no_server_error_is_raised(in_flight):
    loop = asyncio.get_running_loop()
    lost = loop.create_future()
    rows = calls(emb=[lost])
    if not in_flight:
        lost.cancel()
    settling = asyncio.ensure_future(rows.settle(["emb"]))
    if in_flight:
        await asyncio.sleep(0)
        lost.set_exception(ConnectionResetError("cut"))
    with pytest.raises(asyncio.CancelledError if not in_flight else ConnectionResetError):
        await asyncio.wait_for(settling, 5)


async def test_a_refused_push_is_taken_at_a_call_once_for_all_its_keys_and_servers():
    """A push of two keys to two servers, both of which refused it: a later call of either
    key takes its error at once, named as an earlier push of both keys; then it is gone,
    every server's answer under every key, and what is still in flight stays."""
    loop = asyncio.get_running_loop()
    refused = DoublePushError("worker 0 pushed key 'a' twice in round 1")
    push = (done(loop, refused), done(loop, DoublePushError("the same, from server 1")))
    in_flight = loop.create_future()
    rows = calls(a=[*push], b=[*push, in_flight])
    rows._push_of = {answer: push for answer in push}
    late = rows.take_failed(["b"])
    assert isinstance(late, DoublePushError) and late.__cause__ is refused
    assert str(late).startswith("an earlier push of key 'a', 'b' failed: worker 0 pushed")
    assert rows.take_failed(["a", "b"]) is None
    assert rows._unanswered == {"b": [in_flight]} and rows._push_of == {}
    in_flight.set_result(None)


async def test_an_error_settled_for_one_key_is_not_told_again_for_the_pushs_other_keys():
    loop = asyncio.get_running_loop()
    push = (done(loop, DoublePushError("refused")),)
    rows = calls(a=list(push), b=list(push))
    rows._push_of = {push[0]: push}
    assert await rows.settle(["a"]) is push[0].exception()
    assert rows._unanswered == {} and await rows.settle(["b"]) is None
