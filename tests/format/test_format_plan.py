"""The read planner's group runner (``cache_format/_plan.py``): results in group order, the
first group in the calling thread, and an error raised only after every group finished."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from logitcache.cache_format import _plan


def test_run_groups_keeps_group_order_and_runs_the_first_in_the_caller() -> None:
    caller = threading.get_ident()
    seen: dict[int, int] = {}

    def run(g: int) -> int:
        seen[g] = threading.get_ident()
        return g * 10

    with ThreadPoolExecutor(3) as pool:
        assert _plan.run_groups(run, [0, 1, 2, 3], pool) == [0, 10, 20, 30]
    assert seen[0] == caller and len(seen) == 4
    assert _plan.run_groups(run, [5, 6], None) == [50, 60]  # no pool: all in the caller


def test_run_groups_raises_after_every_group_finished() -> None:
    done: list[int] = []

    def run(g: int) -> int:
        if g == 0:
            raise ValueError("bad frame")
        time.sleep(0.05)  # a pool group still writing when the caller's group fails
        done.append(g)
        return g

    with ThreadPoolExecutor(2) as pool:
        with pytest.raises(ValueError, match="bad frame"):
            _plan.run_groups(run, [0, 1, 2], pool)
        assert sorted(done) == [1, 2]  # before the pool's shutdown would wait for them
