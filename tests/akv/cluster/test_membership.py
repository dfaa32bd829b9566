"""How a scheduler's refusal reaches a worker or server: as the error that says why."""

from __future__ import annotations

import pytest

from akv.cluster.membership import scheduler_refusal
from akv.cluster.protocol import JOB_FAILED_STATUS, REFUSED_STATUS
from akv.errors import MembershipError, PeerLostError, ServerError
from akv_transport import RemoteError


@pytest.mark.parametrize(
    ("status", "cls"),
    [(JOB_FAILED_STATUS, PeerLostError), (REFUSED_STATUS, MembershipError), (500, ServerError)],
)
def test_a_scheduler_refusal_becomes_the_error_of_its_reason(status, cls):
    error = scheduler_refusal(RemoteError(status, "worker rank 0 is already taken by x"))
    assert type(error) is cls and "worker rank 0 is already taken by x" in str(error)
