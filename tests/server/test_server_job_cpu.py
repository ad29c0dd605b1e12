"""The job path's cheaper steps (issue #19) give the same answers as the checks they replace."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from logitcache.server.errors import InvalidInputError
from logitcache.server.inputs import records as inputs

LIMITS = inputs.Limits(vocab_size=100, max_seq_len=8)


@pytest.mark.parametrize(
    "ids",
    [
        [1, 2, 99],
        (1, 2, 99),
        [np.int64(1), 2, 99],  # numpy integers take the per-token path
        [np.uint8(1), np.int32(2), 99],
    ],
)
def test_check_ids_plain_and_numpy_ints(ids: list) -> None:
    arr = inputs.check_ids(ids, LIMITS, "x")
    assert arr.dtype == np.int32 and arr.flags.c_contiguous and arr.tolist() == [1, 2, 99]


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([1, True], "list of integers"),
        ([False, 1], "list of integers"),
        ([1, 2.0], "list of integers"),
        ([1, "2"], "list of integers"),
        ([1, None], "list of integers"),
        ([[1, 2], [3, 4]], "list of integers"),
        ([1, 2**31], r"outside the teacher's vocabulary \[0, 100\)"),
        ([-(2**31) - 1, 1], r"outside the teacher's vocabulary \[0, 100\)"),
        ([1, 2**70], r"outside the teacher's vocabulary \[0, 100\)"),
        ([1, 100], "token id 100 outside"),
        ([], "at least 2 tokens"),
    ],
)
def test_check_ids_rejects(ids: list, match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        inputs.check_ids(ids, LIMITS, "x")


def _chunks(
    rng: np.random.Generator, rows: int, k: int, first: int | None = None, dtype: type = np.int64
) -> tuple:
    """An engine core's prompt-logprob tensors: column 0 the actual token (or ``first``), then
    k distinct ids by descending logprob (int64 ids as earlier vLLMs gave them; vLLM 0.32's
    are int32)."""
    import torch

    ids = np.stack([rng.permutation(1000)[: k + 1] for _ in range(rows)]).astype(dtype)
    if first is not None:
        ids[:, 0] = first
    lps = -np.sort(rng.gamma(1.0, size=(rows, k + 1)), axis=1).astype(np.float32)
    return torch.from_numpy(ids), torch.from_numpy(lps)


def _rows_contiguous(a: np.ndarray) -> bool:
    return a.ndim == 2 and a.strides[1] == a.itemsize and a.strides[0] >= a.shape[1] * a.itemsize


@pytest.mark.parametrize("splits", [[7], [3, 4], [1, 2, 4]])
def test_prompt_logprob_arrays_drop_column_0_as_int32(splits: list[int]) -> None:
    """The hook's chunks become the rows vLLM's lists would give (columns 1..k), in the stored
    dtypes, for prompts that arrive in one or several prefill chunks. int64 ids (not the buffers
    of a vLLM whose buffers may be kept) are copied at once."""
    from logitcache.server.engine.vllm_logprobs import TensorPromptLogprobs
    from logitcache.server.engine.vllm_rows import scores_from_output

    rng = np.random.default_rng(0)
    pl = TensorPromptLogprobs()
    parts = [_chunks(rng, n, 5) for n in splits]
    for ids, lps in parts:
        pl.add(ids, lps)
        ids[:] = 0  # an engine that reuses its buffers: the hook must have copied
        lps[:] = 0
    rng = np.random.default_rng(0)
    want = [_chunks(rng, n, 5) for n in splits]
    want_ids = np.concatenate([i.numpy()[:, 1:] for i, _ in want])
    want_lps = np.concatenate([lp.numpy()[:, 1:] for _, lp in want])
    assert len(pl) == sum(splits) + 1
    got = scores_from_output(SimpleNamespace(prompt_logprobs=pl), 5, sum(splits) + 1)
    assert got.topk_ids.dtype == np.int32 and _rows_contiguous(got.topk_ids)
    assert got.topk_logprobs.dtype == np.float32 and _rows_contiguous(got.topk_logprobs)
    np.testing.assert_array_equal(got.topk_ids, want_ids)
    np.testing.assert_array_equal(got.topk_logprobs, want_lps)
    small = scores_from_output(SimpleNamespace(prompt_logprobs=pl), 3, sum(splits) + 1)
    np.testing.assert_array_equal(small.topk_ids, want_ids[:, :3])
    with pytest.raises(Exception, match="shape"):
        scores_from_output(SimpleNamespace(prompt_logprobs=pl), 6, sum(splits) + 1)


@pytest.mark.parametrize("views", [True, False])
def test_vllm_032_buffers_are_kept_as_views(views: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.32 hands each request's whole int32/float32 buffer over once and never writes it
    again: the hook keeps it (no copy) and the scores are views of it, rows strided, with the
    tail mass of a copy bit for bit; another vLLM series copies."""
    from logitcache.cache_format.records import tail_from_logprobs
    from logitcache.server.engine import vllm_logprobs
    from logitcache.server.engine.vllm_rows import scores_from_output

    monkeypatch.setattr(vllm_logprobs, "_views", [])
    if views:
        monkeypatch.setattr("vllm.__version__", "0.32.0")
    else:
        monkeypatch.setattr("vllm.__version__", "0.33.0")
    assert vllm_logprobs.keep_views() is views
    ids, lps = _chunks(np.random.default_rng(2), 9, 6, dtype=np.int32)
    pl = vllm_logprobs.TensorPromptLogprobs()
    pl.add(ids, lps)
    got = scores_from_output(SimpleNamespace(prompt_logprobs=pl), 6, 10)
    assert np.shares_memory(got.topk_ids, ids.numpy()) is views
    assert np.shares_memory(got.topk_logprobs, lps.numpy()) is views
    np.testing.assert_array_equal(got.topk_ids, ids.numpy()[:, 1:])
    np.testing.assert_array_equal(got.topk_logprobs, lps.numpy()[:, 1:])
    want = tail_from_logprobs(np.ascontiguousarray(lps.numpy()[:, 1:]))
    assert got.tail_mass.tobytes() == want.tobytes()


def test_sampled_rows_need_the_marker_in_column_0() -> None:
    from logitcache.server.engine.protocol import EngineError
    from logitcache.server.engine.vllm_logprobs import TensorPromptLogprobs
    from logitcache.server.engine.vllm_rows import hooked_from_output
    from logitcache.server.engine.vllm_sampling import MARK

    rng = np.random.default_rng(1)
    marked = TensorPromptLogprobs()
    for n in (2, 3):
        marked.add(*_chunks(rng, n, 4, first=MARK))
    got = hooked_from_output(SimpleNamespace(prompt_logprobs=marked), 6, 4)
    assert got.topk_ids.shape == (5, 4) and got.topk_ids.dtype == np.int32
    plain = TensorPromptLogprobs()
    plain.add(*_chunks(rng, 5, 4))  # column 0: prompt tokens, not the marker
    with pytest.raises(EngineError, match="hook.s marker"):
        hooked_from_output(SimpleNamespace(prompt_logprobs=plain), 6, 4)
    with pytest.raises(EngineError, match="hook.s marker"):  # wrong draws
        hooked_from_output(SimpleNamespace(prompt_logprobs=marked), 6, 3)


@pytest.mark.timeout(300)
def test_kept_vllm_buffers_are_not_written_again(
    vllm_engine: Any, heldout_sequences: list[list[int]]
) -> None:
    """A real in-process vLLM 0.32 engine: the scores hold views of its per-request buffers
    (rows strided, k+1 apart), and its later requests, chunked prefills and freed buffers
    included, leave them as they were scored (the hook's premise, vllm_logprobs.VIEW_SERIES)."""
    import asyncio

    from logitcache.server.engine import vllm_logprobs

    if not vllm_logprobs.keep_views():
        pytest.skip("this vLLM's buffers are copied")
    seqs = heldout_sequences[:4]
    first = asyncio.run(vllm_engine.score(seqs, k=8))
    assert all(
        s.topk_ids.strides[0] == 9 * 4 and s.topk_logprobs.strides[0] == 9 * 4 for s in first
    )
    frozen = [(s.topk_ids.copy(), s.topk_logprobs.copy(), s.tail_mass.copy()) for s in first]
    for _ in range(3):
        asyncio.run(vllm_engine.score(heldout_sequences[4:16] + seqs, k=8))
    again = asyncio.run(vllm_engine.score(seqs, k=8))
    for s, (ids, lps, tail), b in zip(first, frozen, again, strict=True):
        assert np.array_equal(s.topk_ids, ids) and np.array_equal(s.topk_logprobs, lps)
        assert np.array_equal(s.tail_mass, tail)
        assert np.array_equal(b.topk_ids, ids)
