"""A request's cache lookup while the group commit of the rows it asks for returns: the rows are
found answered-not-committed or in the reader, never in neither (they would be scored again)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from logitcache.cache_format import SequenceRecord
from logitcache.server.serving.cache_hits import CacheServing

pytestmark = pytest.mark.fast


class _OldSnapshot:
    """A reader opened just before the commit landed: it holds none of the keys."""

    def __contains__(self, key: object) -> bool:
        return False


def test_rows_whose_commit_returns_during_the_lookup_are_hits() -> None:
    ids = np.array([5, 6, 7], np.int32)
    rec = SequenceRecord(
        "k0", ids, np.zeros((2, 1), np.int32), np.zeros((2, 1), np.float32), np.zeros(2, np.float32)
    )
    pending = {"k0": rec}

    def lookup_reader(name: str, keys: object) -> _OldSnapshot:
        pending.clear()  # the group commit returns while the reader is being opened
        return _OldSnapshot()

    serving = object.__new__(CacheServing)
    serving.caches = SimpleNamespace(lookup_reader=lookup_reader)
    serving.commits = SimpleNamespace(pending=lambda cache, key: pending.get(key))
    got = serving._hits("c", [SimpleNamespace(key="k0", input_ids=ids)])
    assert list(got) == [0] and got[0] is rec
