"""Benchmarks behind ``akv bench``: each compares akv with a floor measured in the same run."""

from akv.bench._report import Row, Table, compare, compare_async, configure, time_per_call

__all__ = ["Row", "Table", "compare", "compare_async", "configure", "time_per_call"]
