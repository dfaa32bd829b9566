"""Benchmarks behind ``akv bench``: each compares akv with a floor measured in the same run."""

from akv.bench._report import Row, Table, configure, time_per_call, time_per_call_async

__all__ = ["Row", "Table", "configure", "time_per_call", "time_per_call_async"]
