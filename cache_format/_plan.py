"""The chunk planner of a read call: how the rows a call decodes are split over threads, and
how the groups run. Both decoders (:mod:`._pointread`, :mod:`._fastdecode`) plan and run with
it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

_G = TypeVar("_G")
_R = TypeVar("_R")

Item = tuple[int, int, int, int]
"""``(array, first row, end row, output row)``: rows ``[first, end)`` of array ``array`` decode
into that array's output from row ``output row`` on."""


def split(
    items: Sequence[Item],
    chunk_rows: Sequence[int],
    row_bytes: Sequence[int],
    n: int,
    min_bytes: int,
) -> list[list[Item]]:
    """``items`` in at most ``n`` groups of about equal decoded bytes (whole chunks: a chunk is
    decoded whole however few of its rows an item wants), each of at least ``min_bytes`` (one
    group: no threads); items are cut at chunk edges where that balances the groups, so no
    chunk of an item is decoded by two threads."""
    cost = [
        ((b - 1) // chunk_rows[a] - st // chunk_rows[a] + 1) * chunk_rows[a] * row_bytes[a]
        for a, st, b, _ in items
    ]
    total = sum(cost)
    g = max(1, min(n, total // max(1, min_bytes)))
    if g <= 1:
        return [list(items)]
    share = total / g
    groups: list[list[Item]] = [[]]
    load = 0.0
    for (a, st, sp, out), c in zip(items, cost, strict=True):
        cr = chunk_rows[a]
        per = cr * row_bytes[a]
        while c > 0:
            room = share - load
            if room < per / 2 and len(groups) < g:
                groups.append([])
                load, room = 0.0, share
            take = max(1, int(room // per)) * per if len(groups) < g else c
            if take >= c:
                groups[-1].append((a, st, sp, out))
                load += c
                break
            cut = (st // cr + take // per) * cr  # a chunk edge inside (st, sp)
            groups[-1].append((a, st, cut, out))
            load += take
            out += cut - st
            st, c = cut, c - take
    return [x for x in groups if x]


def run_groups(
    run: Callable[[_G], _R], groups: Sequence[_G], pool: ThreadPoolExecutor | None
) -> list[_R]:
    """``run(group)`` for every group, its results in group order: the first in the calling
    thread, the others on ``pool``; every group finishes before this returns (or raises the
    first error), so no thread still writes into the call's outputs."""
    if pool is None or len(groups) == 1:
        return [run(grp) for grp in groups]
    futures = [pool.submit(run, grp) for grp in groups[1:]]
    err: BaseException | None = None
    out: list[_R] = []
    try:
        out.append(run(groups[0]))  # the calling thread takes a share
    except BaseException as e:
        err = e
    for f in futures:
        failed = f.exception()
        err = err or failed
        if failed is None:
            out.append(f.result())
    if err is not None:
        raise err
    return out
