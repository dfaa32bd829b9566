"""The server's array helpers that run outside its state (``akv.cluster.server.updates``)."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import numpy as np

from akv.cluster.server.updates import split_add
from akv.limits import SPLIT_ADD_MIN_BYTES


class CountingPool(concurrent.futures.ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(1)
        self.submitted = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


def test_a_large_sum_is_split_with_a_helper_thread():
    n = SPLIT_ADD_MIN_BYTES // 4 + 3  # odd: the halves differ in size
    a = np.arange(n, dtype=np.float32)
    b = np.full(n, 2.0, np.float32)
    out = np.empty_like(a)
    with CountingPool() as helper:
        split_add(helper, a, b, out)
        np.testing.assert_array_equal(out, np.arange(n, dtype=np.float32) + 2)
        assert helper.submitted == 1
        split_add(helper, a, b, a)  # in place, as a round's third push is added
        np.testing.assert_array_equal(a, np.arange(n, dtype=np.float32) + 2)
        assert helper.submitted == 2


def test_a_small_or_strided_sum_is_added_in_one_go():
    n = SPLIT_ADD_MIN_BYTES // 4
    with CountingPool() as helper:
        small = np.ones((4, 4), np.float32)
        split_add(helper, small, small, small)
        np.testing.assert_array_equal(small, np.full((4, 4), 2.0))
        strided = np.ones((n, 2), np.float32)[:, 0]  # as large, but not contiguous
        split_add(helper, strided, strided, strided)
        np.testing.assert_array_equal(strided, np.full(n, 2.0))
        assert helper.submitted == 0
