"""``StreamConfig(entropy_top_fraction=x)``: ``CacheDataset`` trains on the highest
teacher-entropy rows of each sequence only (client/selection.py), combined with a stored loss
mask; resume stays exact with the same few-integer state; bad settings are typed errors.
Real zarr stores in ``tmp_path``."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from format_support import make_manifest, make_records
from logitcache.cache_format import CacheReader, CacheWriter
from logitcache.client import CacheDataset, StreamConfig
from logitcache.client.errors import ConfigError
from logitcache.client.selection import select

K, V = 4, 50


def _store(tmp_path, masked: bool = False):
    rng = np.random.default_rng(1)
    recs = make_records(9, k=K, vocab=V, seed=4, min_len=3, max_len=40)
    out = []
    for i, r in enumerate(recs):
        ent = rng.uniform(0, np.log(V), r.num_rows)
        ent[: min(3, r.num_rows)] = 1.5  # ties: the lower row wins
        mask = (np.arange(r.num_rows) >= i % 3).astype(np.uint8) if masked else None
        out.append(replace(r, entropy=ent, loss_mask=mask))
    url = tmp_path / ("m.zarr" if masked else "e.zarr")
    m = make_manifest(k=K, vocab_size=V, entropy=True, loss_mask=masked)
    with CacheWriter.open(url, m) as w:
        w.append(out)
    return url


def _expected(rec, x: float) -> np.ndarray:
    """The rule by brute force: sort candidates by (-entropy, row)."""
    ent = rec.entropy.astype(np.float32)
    cand = [j for j in range(rec.num_rows) if rec.loss_mask is None or rec.loss_mask[j]]
    chosen = sorted(cand, key=lambda j: (-ent[j], j))[: math.ceil(x * len(cand))]
    keep = np.zeros(rec.num_rows, bool)
    keep[chosen] = True
    return keep


@pytest.mark.parametrize("masked", [False, True])
def test_each_sequence_keeps_its_top_entropy_rows(tmp_path, masked) -> None:
    url = _store(tmp_path, masked)
    recs = list(CacheReader(url))
    cfg = StreamConfig(tokens_per_item=48, mode="pad", shuffle=False, entropy_top_fraction=0.2)
    items = list(CacheDataset(str(url), cfg))
    assert len(items) == len(recs)
    kept = total = 0
    for item, rec in zip(items, recs, strict=True):
        n = rec.num_rows
        want = _expected(rec, 0.2)
        got = item["loss_mask"][:n].numpy()
        assert got.tolist() == want.tolist()
        assert not item["loss_mask"][n:].any()
        assert item["labels"][:n].tolist() == rec.input_ids[1:].tolist()  # labels keep tokens
        kept, total = kept + int(got.sum()), total + n
    assert 0.2 <= kept / total < 0.35  # about a fifth (ceil per sequence)
    full = list(CacheDataset(str(url), replace(cfg, entropy_top_fraction=None)))
    assert sum(int(f["loss_mask"].sum()) for f in full) > kept
    one = list(CacheDataset(str(url), replace(cfg, entropy_top_fraction=1.0)))
    assert [o["loss_mask"].tolist() for o in one] == [f["loss_mask"].tolist() for f in full]


def test_resume_is_exact_with_a_few_integers(tmp_path) -> None:
    url = _store(tmp_path)
    cfg = StreamConfig(
        tokens_per_item=64, mode="pack", batch_size=2, seed=3, entropy_top_fraction=0.3
    )
    ds = CacheDataset(str(url), cfg)
    whole = list(ds)
    state = ds.state_dict(items_consumed=2)
    assert all(isinstance(v, int | str) for v in state.values())
    again = CacheDataset(str(url), cfg)
    again.load_state_dict(state)
    rest = list(again)
    assert len(rest) == len(whole) - 1
    for a, b in zip(rest, whole[1:], strict=True):
        assert a["loss_mask"].tolist() == b["loss_mask"].tolist()
        assert a["input_ids"].tolist() == b["input_ids"].tolist()
    other = CacheDataset(str(url), replace(cfg, entropy_top_fraction=0.5))
    with pytest.raises(Exception, match="(?i)fingerprint|config"):
        other.load_state_dict(state)  # another selection is another stream


def test_bad_settings_are_refused(tmp_path) -> None:
    for bad in (0, 1.5, -0.1, True, "0.2"):
        with pytest.raises(ConfigError, match="entropy_top_fraction"):
            StreamConfig(entropy_top_fraction=bad)
    url = tmp_path / "plain.zarr"
    with CacheWriter.open(url, make_manifest(k=K, vocab_size=V)) as w:
        w.append(make_records(2, k=K, vocab=V))
    with pytest.raises(ConfigError, match="entropy"):
        CacheDataset(str(url), StreamConfig(entropy_top_fraction=0.2))


def test_selection_keeps_every_array_but_the_mask() -> None:
    """A selected record is the record with a narrower mask: its other arrays, the actual
    tokens' logprobs included, are the same objects."""
    rec = make_records(1, k=K, vocab=V, seed=2, min_len=12, max_len=12)[0]
    rows = rec.num_rows
    rec = replace(
        rec,
        entropy=np.linspace(0, 3, rows, dtype=np.float32),
        actual_logprob=-np.linspace(0.1, 2, rows, dtype=np.float32),
    )
    got = select({0: rec}, 0.25)[0]
    assert got.loss_mask.tolist() == _expected(rec, 0.25).astype(np.uint8).tolist()
    for name in ("input_ids", "topk_ids", "topk_logprobs", "tail_mass", "entropy"):
        assert getattr(got, name) is getattr(rec, name), name
    assert got.actual_logprob is rec.actual_logprob
