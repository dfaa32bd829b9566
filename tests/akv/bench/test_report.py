"""The benchmark table's layout (akv.bench._report) and how its floors are timed."""

import struct

from akv.bench._raw import round_trip
from akv.bench._report import Row, Table


def test_every_row_lines_up_with_the_header_however_long_its_name_or_floor():
    table = Table("dist")
    names = ["short", "small key (16 floats) push+pull, 1 server, shared memory"]
    floors = ["raw socket echo of 64 B", "raw TCP round: 2 clients, summing server, long"]
    for name, floor in zip(names, floors, strict=True):
        table.add(Row(name, 2e-3, 1e-3, floor, akv_p90_s=3e-3, second_floor_s=1e-3))
    lines = table.render().splitlines()
    head, rule, *rows = lines[2:6]
    assert set(rule) == {"-"} and len(rule) == len(head)
    assert [len(line) for line in rows] == [len(head)] * 2
    # Each number sits under its heading: akv's time ends where 'akv' does.
    akv_end = head.index(" akv ") + len(" akv")
    for line, name in zip(rows, names, strict=True):
        assert line.startswith(name)
        assert line[:akv_end].endswith("2.000 ms")


class _Recorder:
    """Takes the place of a raw peer: notes each call (no process, no socket)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def before(self, nbytes: int, iterations: int) -> None:
        self.calls.append(("before", iterations))

    def exchange(self, header: bytes, payload: memoryview, back: memoryview) -> None:
        assert struct.unpack("<Q", header)[0] == len(payload) == len(back)
        self.calls.append(("exchange", len(payload)))


def test_a_floor_makes_one_untimed_exchange_before_its_timed_rounds():
    # The first exchange waits for peers that are still starting: it must not be a sample.
    recorder = _Recorder()
    assert round_trip(recorder, 64, iterations=3, rounds=2) >= 0
    warm_up = [("before", 1), ("exchange", 64)]
    one_round = [("before", 3)] + [("exchange", 64)] * 3
    assert recorder.calls == warm_up + one_round * 2
