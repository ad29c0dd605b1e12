"""``long_sequences="split"`` cuts cached sequences: the dataset says so, with the share of rows
whose cached targets condition on a prefix the student does not see in their piece (issue #12's
offline-KD gap came from exactly this)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
from client_support import build_cache
from logitcache.client import CacheDataset, CutSequenceWarning
from logitcache.client.collate import cut_rows


def test_cut_rows_counts_the_rows_after_each_first_piece() -> None:
    # L tokens -> L - 1 rows; the first piece of T tokens holds T rows
    assert cut_rows(np.array([65, 64, 2, 1, 0]), 64) == 0
    assert cut_rows(np.array([66, 129, 200]), 64) == 1 + 64 + 135
    assert cut_rows(np.array([129]), 128) == 0 and cut_rows(np.array([130]), 128) == 1


def test_split_warns_with_the_share_of_cut_rows(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    rng = np.random.default_rng(0)
    lengths = [100, 30, 61, 20]  # rows 99, 29, 60, 19 = 207; at T=32: 67 + 0 + 28 + 0 = 95 cut
    build_cache(url, [rng.integers(0, 50, size=n).astype(np.int32) for n in lengths])
    with pytest.warns(CutSequenceWarning) as got:
        CacheDataset(url, tokens_per_item=32)
    text = str(got[0].message)
    assert "95 of 207 rows (45.9%)" in text and "longest 100 tokens" in text
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is cut: no warning
        CacheDataset(url, tokens_per_item=100)
        CacheDataset(url, tokens_per_item=32, long_sequences="truncate")
