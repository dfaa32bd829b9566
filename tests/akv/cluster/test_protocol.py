"""What frames mean: ops, status codes both ways, the client header, init metadata."""

from __future__ import annotations

import pytest

from akv import errors
from akv.cluster import protocol
from akv.cluster.protocol import Op


@pytest.mark.parametrize("cls", sorted(set(protocol.STATUS_CLASSES.values()), key=str))
def test_every_listed_error_crosses_the_wire_as_itself(cls):
    status = protocol.status_of(cls("it broke"))
    assert status != protocol.OK
    back = protocol.error_from_status(status, "it broke", "server 3")
    assert type(back) is cls
    assert "it broke" in str(back) and "server 3" in str(back)


def test_a_subclass_travels_as_its_nearest_listed_class():
    status = protocol.status_of(errors.BarrierTimeoutError("late"))
    assert type(protocol.error_from_status(status, "late", "s")) is errors.WaitTimeoutError


def test_an_unexpected_exception_becomes_a_server_error_naming_the_server():
    status = protocol.status_of(ZeroDivisionError("boom"))
    error = protocol.error_from_status(status, "boom", "server 1")
    assert isinstance(error, errors.ServerError) and error.server == "server 1"


def test_an_unknown_status_from_a_newer_server_is_still_an_error():
    error = protocol.error_from_status(999, "what", "server 0")
    assert isinstance(error, errors.ServerError) and "what" in str(error)


def test_status_codes_and_op_codes_are_unique_and_stable():
    assert len(set(protocol.STATUS_CLASSES)) == len(protocol.STATUS_CLASSES)
    assert [op.value for op in Op] == [*range(1, 15), 100, 101]  # the wire format
    assert protocol.op_label(Op.INIT_CHECK) == "init_check"
    assert protocol.op_label(4) == "pull" and protocol.op_label(77) == "op 77"


def test_the_client_header_round_trips_and_refuses_garbage():
    assert protocol.parse_client_header(protocol.client_header(3, "dist_async")) == (
        3,
        "dist_async",
        "",
    )
    header = protocol.client_header(1, "dist_sync", "3f2a_b-c")
    assert protocol.parse_client_header(header) == (1, "dist_sync", "3f2a_b-c")
    for bad in ("", "x dist_sync", "1", "1 local", "1 dist_sync a b", "1 dist_sync x/y"):
        with pytest.raises(errors.InvalidArgumentError):
            protocol.parse_client_header(bad)


def test_init_metadata_round_trips_and_refuses_garbage():
    items = [(1, (2, 3), "float32"), ("w", (4,), "int64")]
    assert protocol.decode_meta(protocol.encode_meta(items)) == items
    for bad in ("{", "[[1, 2]]", '[[null, [1], "f4"]]', '[[[1], [1], "f4"]]', '[[1, ["x"], 1]]'):
        with pytest.raises(errors.InvalidArgumentError, match="malformed init_check"):
            protocol.decode_meta(bad)


def test_row_meta_round_trips_and_refuses_garbage():
    items = [("emb", (10**9, 64), "float32", 0, 5 * 10**8), (7, (1, 2), "float16", 0, 1)]
    assert protocol.decode_row_meta(protocol.encode_row_meta(items)) == items
    for text in ['[["k", [10, 2], "float32", 4, 11]]', '[["k", [], "float32", 0, 0]]', "[[1]]"]:
        with pytest.raises(errors.InvalidArgumentError, match="malformed row_init"):
            protocol.decode_row_meta(text)


def test_the_staleness_header_is_a_whole_number():
    assert protocol.parse_staleness(None) is None
    assert protocol.parse_staleness("0") == 0 and protocol.parse_staleness("12") == 12
    for text in ["-1", "1.5", "", "x", "9" * 19]:
        with pytest.raises(errors.InvalidArgumentError, match="X-AKV-Staleness"):
            protocol.parse_staleness(text)
