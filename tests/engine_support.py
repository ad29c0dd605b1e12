"""Helpers for the engine tests: comparing top-k rows that may swap at near-ties."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
from logitcache.cache_format import SequenceRecord
from logitcache.server.engine import BaseEngine, EngineInfo, SampledTargets, make_scores


def assert_rows_close(a: Any, b: Any, *, atol: float, max_mismatch_rows: float = 0.02) -> int:
    """Assert that two ``TeacherScores`` (or ``(ids, logprobs)`` pairs) give the same top-k.

    * the sorted logprob values agree within ``atol`` everywhere (id swaps don't change them);
    * an id present in both rows has logprobs within ``atol`` in both;
    * an id present in only one row is a boundary near-tie: its logprob is within ``2 atol`` of
      that row's k-th value;
    * at most ``max_mismatch_rows`` of the rows differ in their id lists at all.

    Returns the number of rows whose id lists differ.
    """
    ids_a, lp_a = _pair(a)
    ids_b, lp_b = _pair(b)
    assert ids_a.shape == ids_b.shape == lp_a.shape == lp_b.shape, (ids_a.shape, ids_b.shape)
    np.testing.assert_allclose(lp_a, lp_b, atol=atol, rtol=0)
    differing = np.flatnonzero((ids_a != ids_b).any(axis=1))
    for r in differing:
        da = dict(zip(ids_a[r].tolist(), lp_a[r].tolist(), strict=True))
        db = dict(zip(ids_b[r].tolist(), lp_b[r].tolist(), strict=True))
        for t in da.keys() & db.keys():
            assert abs(da[t] - db[t]) <= atol, (r, t, da[t], db[t])
        for t in da.keys() ^ db.keys():
            lp, kth = (da[t], lp_a[r, -1]) if t in da else (db[t], lp_b[r, -1])
            assert abs(lp - kth) <= 2 * atol, f"row {r}: id {t} ({lp}) is no tie with {kth}"
    assert len(differing) <= max(1, max_mismatch_rows * len(ids_a)), len(differing)
    return int(len(differing))


def _pair(x: Any) -> tuple[np.ndarray, np.ndarray]:
    if isinstance(x, tuple):
        return np.asarray(x[0]), np.asarray(x[1])
    return np.asarray(x.topk_ids), np.asarray(x.topk_logprobs)


def full_forward_logprobs(model_dir: str, ids: list[int], temperature: float = 1.0) -> np.ndarray:
    """``log_softmax(logits / T)`` of a plain transformers forward, ``[L, V]`` (tests only)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1).numpy()


# ------------------------------------------------------------------------------ fake engine


def fake_logprobs(ids: list[int], vocab_size: int, temperature: float = 1.0) -> np.ndarray:
    """The fake teacher's full ``log_softmax(z / T)``, ``[L-1, V]`` float64: row ``j`` has
    logits ``z_j[v] = 4 cos(0.37 (v + 1)(x_j + 1) + 0.11 j)`` (depends on the prefix only
    through ``x_j`` and ``j``; deterministic, no ties in practice)."""
    x = np.asarray(ids[:-1], dtype=np.float64)[:, None]
    j = np.arange(len(ids) - 1, dtype=np.float64)[:, None]
    v = np.arange(vocab_size, dtype=np.float64)[None, :]
    z = 4.0 * np.cos(0.37 * (v + 1.0) * (x + 1.0) + 0.11 * j) / temperature
    z -= z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


class _ByteTokenizer:
    """``text`` -> ``[1] + [byte + 2 ...]`` (1 is BOS)."""

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [1] + [b + 2 for b in text.encode("utf-8")]}

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` (BOS and ids outside the byte range dropped)."""
        return bytes(i - 2 for i in ids if 2 <= i < 258).decode("utf-8", "replace")


class FakeEngine(BaseEngine):
    """A deterministic teacher behind the real :class:`~logitcache.server.engine.TeacherEngine`
    protocol and the real check/score path (:class:`~logitcache.server.engine.BaseEngine`): the
    rows are the top-k of :func:`fake_logprobs`, and its sampled targets (``score_sampled``)
    the format's estimator on the same distributions (:func:`fake_sampled`). For fast tests of
    everything around the engine (routes, jobs, caches); the real vLLM/transformers engines
    keep their own tests.
    ``weights_hash`` stands for the weights' content (change it to play a replaced teacher)."""

    def __init__(
        self,
        *,
        vocab_size: int = 300,
        max_k: int = 20,
        max_seq_len: int = 512,
        temperature: float = 1.0,
        weights_hash: str = "sha256:fake-1",
        dtype: str = "float32",
    ) -> None:
        super().__init__()
        self.tokenizer = _ByteTokenizer()
        self.info = EngineInfo(
            model_id="fake-teacher",
            revision="fake",
            vocab_size=vocab_size,
            max_k=min(max_k, vocab_size),
            tokenizer_fingerprint="fake-bytes-v1",
            temperature=temperature,
            max_seq_len=max_seq_len,
            backend="fake",
            dtype=dtype,
            weights_hash=weights_hash,
        )
        self.calls: list[int] = []  # prompts per engine call
        self.temperatures: list[float] = []  # the temperature of each engine call
        self.id_calls: list[int] = []  # prompts per score_ids call

    async def _generate(self, prompts: list[list[int]], k: int, temperature: float) -> list[Any]:
        self.calls.append(len(prompts))
        self.temperatures.append(temperature)
        out = []
        for ids in prompts:
            lp = fake_logprobs(ids, self.info.vocab_size, temperature)
            top = np.argsort(-lp, axis=1, kind="stable")[:, :k]
            act = lp[np.arange(len(ids) - 1), ids[1:]]  # the prompt's next tokens (4.12)
            out.append(make_scores(top, np.take_along_axis(lp, top, axis=1), actual_logprob=act))
        return out

    async def _generate_ids(
        self, prompts: list[list[int]], ids: list[list[int]], temperature: float
    ) -> list[np.ndarray]:
        """:func:`fake_logprobs` at the chosen ids (``id_calls``: prompts per call)."""
        self.id_calls.append(len(prompts))
        self.temperatures.append(temperature)
        return [
            fake_logprobs(p, self.info.vocab_size, temperature)[:, c].astype(np.float32)
            for p, c in zip(prompts, ids, strict=True)
        ]

    async def _generate_sampled(
        self, prompts: list[list[int]], keys: list[str], targets: SampledTargets, temperature: float
    ) -> list[Any]:
        """Sampled rows (FORMAT.md 4.4) of :func:`fake_logprobs`: :func:`fake_sampled`."""
        self.calls.append(len(prompts))
        self.temperatures.append(temperature)
        return [
            fake_sampled(ids, key, targets, self.info, temperature)
            for ids, key in zip(prompts, keys, strict=True)
        ]


async def lazy_records(engine: Any, seqs: Any, k: int) -> list[SequenceRecord]:
    """The records a job appended before its rows went to the writer as parts (the reference of
    the parts tests): the engine's rows per sequence, a tail mass not computed yet left to the
    writer."""
    from logitcache.server.batch import pipeline

    scores = await pipeline.call_engine(engine, seqs, k, None)
    return [
        SequenceRecord(
            key=s.key,
            input_ids=s.input_ids,
            topk_ids=sc.topk_ids,
            topk_logprobs=sc.topk_logprobs,
            tail_mass=sc.known_tail(),
            loss_mask=s.loss_mask,
            entropy=sc.entropy,
            actual_logprob=sc.actual_logprob,
        )
        for s, sc in zip(seqs, scores, strict=True)
    ]


def fake_sampled(
    ids: list[int],
    key: str,
    targets: SampledTargets,
    info: EngineInfo,
    temperature: float | None = None,
) -> Any:
    """The fake teacher's sampled rows of one prompt: the format's estimator
    (:func:`~logitcache.cache_format.sampling.sample_rows`) on :func:`fake_logprobs` with the
    uniforms of ``(targets.seed, key)``, exactly what the real backends do with their own
    distributions (so the rows depend on seed, key and prompt only)."""
    import torch
    from logitcache.cache_format.sampling import sample_rows, uniforms

    t = info.temperature if temperature is None else temperature
    lp = torch.from_numpy(fake_logprobs(ids, info.vocab_size, t))
    u = uniforms(targets.seed, key, lp.shape[0], targets.draws)
    sampled_ids, log_w = sample_rows(
        lp, u, targets.proposal_temperature, k=targets.slots, head=targets.head
    )
    return make_scores(sampled_ids, log_w)


# ------------------------------------------------------------------------ in-process service


def app_settings(root: Any, **overrides: Any) -> Any:
    """``ServerSettings`` for an in-process app whose store, data and state live under ``root``."""
    from pathlib import Path

    from logitcache.server.settings import ServerSettings

    root = Path(root)
    for sub in ("caches", "data", "state"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    base: dict[str, Any] = {
        "model": "fake-teacher",
        "store_root": str(root / "caches"),
        "data_dir": root / "data",
        "state_dir": root / "state",
        "k": 20,
        "logprob_dtype": "float32",
    }
    base.update(overrides)
    return ServerSettings(**base)


@contextlib.asynccontextmanager
async def in_process(settings: Any, engine: Any) -> AsyncIterator[Any]:
    """An ``httpx.AsyncClient`` talking to ``create_app(settings, engine)`` in this process
    (``httpx.ASGITransport``; the app's lifespan runs around it). The engine is not closed."""
    import httpx
    from logitcache.server.app import create_app

    app = create_app(settings, engine=engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            yield client


async def until(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    """Wait, polling every 20 ms, until ``cond()`` holds; an assertion error after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def job_done(client: Any, job_id: str, timeout: float = 60.0) -> dict[str, Any]:
    """The job ``job_id`` of an :func:`in_process` app once it has left ``queued`` and
    ``running``; an assertion error (with the job) after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while (job := (await client.get(f"/v1/jobs/{job_id}")).json())["state"] in (
        "queued",
        "running",
    ):
        assert time.monotonic() < deadline, job
        await asyncio.sleep(0.02)
    return job
