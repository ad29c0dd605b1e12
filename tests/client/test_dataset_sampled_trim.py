"""``CacheDataset(trim_sampled=True)``: a sampled cache's units keep only the columns some row
uses (issue #12; FORMAT.md 4.4: drawn ids first, then weight-0 padding of log-weight -65504).
The loss on a trimmed unit equals the loss on the full-width unit, value and gradients."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from client_support import VOCAB, make_sequences, manifest, record_for
from logitcache.cache_format import CacheWriter, SequenceRecord
from logitcache.cache_format.sampling import (
    PAD_LOGPROB,
    sample_rows,
    sampling_manifest,
    uniforms,
)
from logitcache.client import CacheDataLoader, CacheDataset
from logitcache.client.collate import IGNORE_INDEX, trim_padding_columns
from logitcache.client.loss import topk_distill_loss

DRAWS = 32
IMPLS = ["dense", "forward_chunked", "fused_chunked"]


def _teacher(rows: int, seed: int) -> torch.Tensor:
    """Log-probabilities of a teacher whose rows range from sharp to flat (so rows of one
    batch have very different numbers of distinct draws)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.5, 6.0, rows)[:, None]
    return torch.log_softmax(torch.randn(rows, VOCAB, generator=g) * scale, -1)


def _build_sampled(url: Path, num: int = 24, tau: float = 1.0) -> None:
    records = []
    for i, seq in enumerate(make_sequences(num, seed=3, min_len=6, max_len=40)):
        key = f"seq-{i}"
        ids, lw = sample_rows(_teacher(len(seq) - 1, i), uniforms(5, key, len(seq) - 1, DRAWS), tau)
        records.append(SequenceRecord(key, seq, ids, lw))
    m = manifest(k=DRAWS, targets="sampled", sampling=sampling_manifest(DRAWS, tau, 5))
    with CacheWriter.open(str(url), m) as writer:
        writer.append(records)


@pytest.fixture(scope="module")
def sampled_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    url = tmp_path_factory.mktemp("trim") / "sampled"
    _build_sampled(url)
    return str(url)


def collect(iterable: object) -> list[dict]:
    """Units as numpy dicts (``target_kind`` stays a string)."""
    return [
        {n: v.numpy().copy() if isinstance(v, torch.Tensor) else v for n, v in unit.items()}
        for unit in iterable  # type: ignore[attr-defined]
    ]


def _ds(url: str, **kw: object) -> CacheDataset:
    opts: dict = {"tokens_per_item": 32, "batch_size": 3, "seed": 1}
    opts.update(kw)
    return CacheDataset(url, **opts)


def test_trimmed_units_are_the_full_units_minus_trailing_padding(sampled_url: str) -> None:
    full = collect(_ds(sampled_url, trim_sampled=False))
    trimmed = collect(_ds(sampled_url))
    assert len(full) == len(trimmed) > 3
    widths = []
    for f, t in zip(full, trimmed, strict=True):
        assert f.keys() == t.keys()  # same keys (target_kind too), no new ones
        assert f["topk_ids"].shape[-1] == DRAWS
        w = t["topk_ids"].shape[-1]
        widths.append(w)
        assert t["topk_logprobs"].shape == t["topk_ids"].shape == (*f["labels"].shape, w)
        for name in f:
            if name in ("topk_ids", "topk_logprobs"):
                assert np.array_equal(t[name], f[name][..., :w])
            else:
                assert np.array_equal(t[name], f[name])
        rows = f["labels"] != IGNORE_INDEX
        dropped = f["topk_logprobs"][..., w:][rows]
        assert (dropped == PAD_LOGPROB).all()  # only padding was dropped...
        assert (f["topk_logprobs"][..., w - 1][rows] > PAD_LOGPROB).any()  # ...and all of it
    assert max(widths) < DRAWS  # the padding really goes (the sharp rows draw few ids)
    assert len(set(widths)) > 1  # the width is per unit


def test_trimmed_stream_is_deterministic_and_the_same_with_workers(sampled_url: str) -> None:
    a = collect(_ds(sampled_url))
    b = collect(_ds(sampled_url))
    workers = collect(CacheDataLoader(_ds(sampled_url), num_workers=2))
    for other in (b, workers):
        assert len(other) == len(a)
        for x, y in zip(a, other, strict=True):
            assert x.keys() == y.keys()
            assert all(np.array_equal(x[n], y[n]) for n in x)


def _loss_and_grads(unit: dict, dtype: torch.dtype, impl: str) -> tuple:
    g = torch.Generator().manual_seed(0)
    d = 8
    lead = unit["labels"].shape
    hidden = torch.randn(*lead, d, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(VOCAB, d, generator=g, dtype=torch.float64) / 2).to(dtype)
    weight.requires_grad_()
    loss = topk_distill_loss(
        hidden,
        weight,
        torch.from_numpy(unit["topk_ids"]),
        torch.from_numpy(unit["topk_logprobs"]),
        labels=torch.from_numpy(unit["labels"]),
        mask=torch.from_numpy(unit["loss_mask"]),
        targets=unit["target_kind"],
        impl=impl,
        chunk_size=40,
        ce_weight=0.1,
    )
    loss.backward()
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("impl", IMPLS)
def test_loss_and_gradients_equal_on_trimmed_units(sampled_url: str, impl: str) -> None:
    full = collect(_ds(sampled_url, trim_sampled=False))
    trimmed = collect(_ds(sampled_url))
    narrower = 0
    for f, t in zip(full[:3], trimmed[:3], strict=True):
        assert f["target_kind"] == t["target_kind"] == "sampled"
        narrower += t["topk_ids"].shape[-1] < f["topk_ids"].shape[-1]
        for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
            lf, hf, wf = _loss_and_grads(f, dtype, impl)
            lt, ht, wt = _loss_and_grads(t, dtype, impl)
            assert lt.item() == pytest.approx(lf.item(), rel=tol, abs=tol)
            torch.testing.assert_close(ht, hf, rtol=tol, atol=tol)
            torch.testing.assert_close(wt, wf, rtol=tol, atol=tol)
    assert narrower == 3


def test_trim_sampled_false_and_topk_caches_keep_the_full_width(tmp_path: Path) -> None:
    # a top-k cache whose last columns are tiny (below the padding bound) in every row
    url = tmp_path / "topk"
    records = []
    for i, seq in enumerate(make_sequences(6, seed=1, min_len=4)):
        rec = record_for(seq, key=f"seq-{i}")
        lp = rec.topk_logprobs.copy()
        lp[:, 2:] = -20000.0
        records.append(SequenceRecord(rec.key, rec.input_ids, rec.topk_ids, lp, rec.tail_mass))
    with CacheWriter.open(str(url), manifest()) as writer:
        writer.append(records)
    units = collect(_ds(str(url)))
    assert units and all(u["topk_ids"].shape[-1] == 4 for u in units)
    assert "target_kind" not in units[0]


def test_trim_padding_columns_keeps_inner_padding_and_ignores_rowless_positions() -> None:
    lp = np.full((2, 3, 5), PAD_LOGPROB, dtype=np.float32)
    ids = np.tile(np.arange(5), (2, 3, 1))
    labels = np.array([[5, 6, IGNORE_INDEX], [7, IGNORE_INDEX, IGNORE_INDEX]])
    lp[0, 0, 0] = lp[1, 0, 0] = 0.0
    lp[0, 1, :] = [-1.0, PAD_LOGPROB, -2.0, PAD_LOGPROB, PAD_LOGPROB]  # inner padding
    lp[0, 2, :] = 0.0  # a position without a row (zeros, as build_batch leaves it)
    arrays = {"topk_ids": ids, "topk_logprobs": lp, "labels": labels, "other": np.zeros(1)}
    out = trim_padding_columns(arrays)
    assert out["topk_logprobs"].shape == (2, 3, 3) and out["topk_ids"].shape == (2, 3, 3)
    assert out["topk_logprobs"].flags.c_contiguous
    assert np.array_equal(out["topk_logprobs"][0, 1], [-1.0, PAD_LOGPROB, -2.0])
    assert out["other"] is arrays["other"] and arrays["topk_logprobs"].shape[-1] == 5
    lp[0, 1, 4] = np.nan  # kept: the loss refuses it with a clear error
    assert trim_padding_columns(arrays)["topk_logprobs"].shape[-1] == 5
    lp[0, 1, 4] = -np.inf  # -inf is padding too
    assert trim_padding_columns(arrays)["topk_logprobs"].shape[-1] == 3
    rowless = {**arrays, "labels": np.full((2, 3), IGNORE_INDEX)}
    assert trim_padding_columns(rowless)["topk_logprobs"].shape[-1] == 1  # at least one column


def test_hf_iterable_of_a_sampled_cache_is_full_width_with_its_kind(sampled_url: str) -> None:
    pytest.importorskip("datasets")
    from logitcache.client.hf import hf_iterable

    ds = _ds(sampled_url)  # trim_sampled=True: hf_iterable's features still fix [..., k]
    full = collect(_ds(sampled_url, trim_sampled=False))
    got = list(hf_iterable(ds))
    assert len(got) == len(full)
    for g, f in zip(got, full, strict=True):
        assert g["target_kind"] == "sampled"
        assert np.array_equal(np.asarray(g["topk_ids"]), f["topk_ids"])
        assert np.array_equal(np.asarray(g["topk_logprobs"]), f["topk_logprobs"])


def test_single_items_are_trimmed_per_item(sampled_url: str) -> None:
    full = collect(_ds(sampled_url, batch_size=None, trim_sampled=False))
    items = collect(_ds(sampled_url, batch_size=None))
    assert len(items) == len(full) > 3
    for f, t in zip(full, items, strict=True):
        w = t["topk_ids"].shape[-1]
        assert t["topk_ids"].shape == (32, w) and f["topk_ids"].shape == (32, DRAWS)
        assert np.array_equal(t["topk_logprobs"], f["topk_logprobs"][:, :w])
    assert min(t["topk_ids"].shape[-1] for t in items) < DRAWS
