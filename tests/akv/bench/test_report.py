"""The benchmark table's layout (akv.bench._report)."""

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
