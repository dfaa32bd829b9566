"""How a scheduler's refusal reaches a worker or server: as the error that says why; and a
closed membership asks nothing more."""

from __future__ import annotations

import pytest

from akv.cluster import config as _config
from akv.cluster.membership import Membership, scheduler_refusal
from akv.cluster.protocol import JOB_FAILED_STATUS, REFUSED_STATUS
from akv.errors import MembershipError, PeerLostError, ServerError
from akv_transport import RemoteError, TransportError


@pytest.mark.parametrize(
    ("status", "cls"),
    [(JOB_FAILED_STATUS, PeerLostError), (REFUSED_STATUS, MembershipError), (500, ServerError)],
)
def test_a_scheduler_refusal_becomes_the_error_of_its_reason(status, cls):
    error = scheduler_refusal(RemoteError(status, "worker rank 0 is already taken by x"))
    assert type(error) is cls and "worker rank 0 is already taken by x" in str(error)


async def test_a_closed_membership_asks_the_scheduler_nothing_more():
    config = _config.from_env(
        {
            "AKV_ROLE": "server",
            "AKV_SCHEDULER_HOST": "127.0.0.1",
            "AKV_SCHEDULER_PORT": "9",  # never reached: the client is closed first
            "AKV_NUM_WORKERS": "1",
            "AKV_NUM_SERVERS": "1",
            "AKV_TOKEN": "t" * 32,
        }
    )
    membership = Membership(config, "server", "node-1")
    await membership.close()
    with pytest.raises(TransportError, match="the client is closed"):
        await membership.report_lost("node-1", "worker", 0, "gone")
    assert membership._client is None  # nothing made, nothing opened that nobody closes
    assert await membership.verdict("worker", 0, "gone", True, 1.0) is None
    await membership.close()  # idempotent
