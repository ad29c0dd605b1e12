"""Replay engines for the ``cpu`` mode: the job path behind an engine whose rows cost nothing to
make, so every CPU-second the mode counts is the job path's.

Rows (``--ids``): an object with ``vocab`` and ``take(m, k) -> (ids [m, k], logprobs [m, k])``.
Forms (``--form``): ``arrays``, vLLM 0.32's prompt-logprob tensors as the service's vLLM hook
wraps them (``vllm_logprobs.TensorPromptLogprobs``, converted by ``engine/vllm_rows.py``);
``hf``, the transformers backend's own code (``server/engine/hf.py``) with its decoder and
lm-head replaced by rows from the pool.
"""

from __future__ import annotations

import gc
import time
from types import SimpleNamespace
from typing import Any

import numpy as np

from benchmarks.synthetic import Teacher

#: Rows dealt from a pool of this many, in a shuffled order (each row once per pass).
POOL_ROWS = 65536


class _Pool:
    """Rows ``ids [POOL_ROWS, k_max]``, ``logprobs`` dealt out in a shuffled order, each row
    once per pass, so no inner chunk (2,048 rows) repeats a row unless the pass wraps inside it."""

    vocab: int

    def __init__(self, ids: np.ndarray, logprobs: np.ndarray, rng: np.random.Generator) -> None:
        self.ids, self.logprobs = ids, logprobs
        self.k_max = ids.shape[1]
        self.order = rng.permutation(ids.shape[0])
        self.cursor = 0

    def take(self, m: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The next ``m`` rows' top-``k`` ids (int64) and logprobs (float64)."""
        if k > self.k_max:
            raise SystemExit(f"these rows have k <= {self.k_max}, not {k}")
        idx = self.order[(self.cursor + np.arange(m)) % self.ids.shape[0]]
        self.cursor = (self.cursor + m) % self.ids.shape[0]
        return self.ids[idx, :k].astype(np.int64), self.logprobs[idx, :k].astype(np.float64)


class ZipfRows(_Pool):
    """``--ids zipf``: the synthetic teacher's top-k rows over 131,072 ids (Zipf(1.05) ids with a
    BPE-like placement, a noisy power law of logprobs), the format's bytes/position data."""

    vocab = 131072

    def __init__(self, seed: int = 0) -> None:
        teacher = Teacher(seed=seed)
        rng = np.random.default_rng(seed)
        ids = teacher.topk_ids(POOL_ROWS, rng, teacher.cdf(), teacher.rank_to_id(rng))
        super().__init__(ids, teacher.logprobs(POOL_ROWS, rng)[0], rng)


class RandomTeacherRows(_Pool):
    """``--ids random``: the rows of a Llama-shaped teacher with random weights, as the ``gpu``
    mode scores: logits i.i.d. ``N(0, sigma^2)`` over ``vocab`` ids (``sigma`` = 0.02 x sqrt(d):
    0.9 for the 1B shape, 1.3 for 8B). The top ``k`` of ``vocab`` draws come from the top uniform
    order statistics (exponential spacings), the log-normaliser is ``log(vocab) + sigma^2 / 2``;
    ids are ``k`` distinct uniform ids per row."""

    def __init__(
        self, seed: int = 0, vocab: int = 128256, sigma: float = 0.9, k: int = 100,
        pool: int = POOL_ROWS,
    ):  # fmt: skip
        import torch

        self.vocab = vocab
        rng = np.random.default_rng(seed)
        ids = np.stack([rng.choice(vocab, k, replace=False) for _ in range(pool)])
        u = rng.exponential(size=(pool, k)).cumsum(axis=1) / vocab
        z = -sigma * torch.special.ndtri(torch.from_numpy(u)).numpy()
        super().__init__(ids.astype(np.int32), z - (np.log(vocab) + sigma * sigma / 2), rng)


ROWS = {"zipf": ZipfRows, "random": RandomTeacherRows}


def _info(vocab: int, k: int, backend: str) -> Any:
    from logitcache.server.engine import EngineInfo

    return EngineInfo(
        model_id="replay", revision="bench", vocab_size=vocab, max_k=k,
        tokenizer_fingerprint="replay", max_seq_len=4096, backend=backend,
        weights_hash="sha256:replay",
    )  # fmt: skip


def build_engine(
    prompts: list[list[int]], k: int, rows: Any, form: str = "arrays", rate: float = 0.0
) -> Any:
    """A replay engine of ``form`` over ``rows``. The ``arrays`` form's outputs (per position the
    actual next token, then the top-k: vLLM's ``[L-1, k+1]`` int32 / float32 buffers) are built
    before the clock and moved out of the collector's sight (``gc.freeze``: in the service an
    output lives only until its batch is converted); ``rate``: the ``hf`` form's device pace."""
    if form == "hf":
        return hf_engine(k, rows, rate=rate)
    import torch
    from logitcache.server.engine import BaseEngine
    from logitcache.server.engine.vllm_logprobs import TensorPromptLogprobs
    from logitcache.server.engine.vllm_rows import scores_from_output

    def tensors(ids: list[int]) -> tuple[Any, Any]:
        top, lps = rows.take(len(ids) - 1, k)
        tok = np.concatenate([np.asarray(ids[1:])[:, None], top], axis=1).astype(np.int32)
        lp = np.concatenate([np.full((len(ids) - 1, 1), -7.0), lps], axis=1).astype(np.float32)
        return torch.from_numpy(tok), torch.from_numpy(lp)

    outputs = {tuple(p): tensors(p) for p in prompts}
    gc.collect()
    gc.freeze()

    class ReplayEngine(BaseEngine):
        def __init__(self) -> None:
            super().__init__()
            self.tokenizer = None
            self.info = _info(rows.vocab, k, "vllm")

        async def _generate(self, ps: list[list[int]], kk: int, t: float) -> list[Any]:
            out = []
            for p in ps:
                arrays = TensorPromptLogprobs()
                arrays.add(*outputs[tuple(p)])
                out.append(SimpleNamespace(prompt_logprobs=arrays))
            return out

        def _convert(self, raw: Any, length: int, kk: int) -> Any:
            return scores_from_output(raw, kk, length)

    return ReplayEngine()


def hf_engine(k: int, rows: Any, batch_tokens: int = 8192, rate: float = 0.0) -> Any:
    """The transformers backend with its device work replaced: ``_hidden`` is an empty
    ``[B, width, 0]`` tensor, ``_topk_rows`` the next rows of ``rows``, their tail mass and a
    stand-in actual-token logprob (copied, as a device's output is fresh memory). With ``rate``
    (tokens/s) a decoder batch is ready no sooner than its tokens take at that rate after the
    previous one (the thread sleeps, as it waits for a device)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from logitcache.cache_format import tail_from_logprobs
    from logitcache.server.engine import BaseEngine
    from logitcache.server.engine.hf import TransformersEngine

    class HfReplay(TransformersEngine):
        def __init__(self) -> None:
            BaseEngine.__init__(self)
            self.tokenizer = None
            self.info = _info(rows.vocab, k, "transformers")
            self.chunk_rows, self.batch_tokens = 1024, batch_tokens
            self.device = torch.device("cpu")
            self._torch = ThreadPoolExecutor(1, thread_name_prefix="logitcache-forward")

        ready = 0.0  # when the replayed device finishes its last batch (perf_counter)

        def _hidden(self, seqs: list[list[int]]) -> Any:
            width = max(len(s) for s in seqs)
            if rate:
                now = time.perf_counter()
                self.ready = max(now, self.ready) + len(seqs) * width / rate
                time.sleep(self.ready - now)
            return torch.empty((len(seqs), width, 0))

        def _topk_rows(self, hidden: Any, kk: int, temperature: float, *_: Any) -> tuple[Any, ...]:
            ids, lps = rows.take(int(hidden.shape[0]), kk)
            lp32 = lps.astype(np.float32)
            top = [ids.astype(np.int32), lp32, tail_from_logprobs(lp32), None, lp32[:, -1].copy()]
            return tuple(None if a is None else torch.from_numpy(a) for a in top)

    return HfReplay()
