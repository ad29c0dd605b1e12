"""Replay engines for the service suite's ``cpu`` mode: the job path behind an engine whose
rows cost nothing to make, so every CPU-second the mode counts is the job path's.

Rows (``--ids``), one object with ``vocab`` and ``take(m, k) -> (ids [m, k], logprobs [m, k])``:

* :class:`StrideRows`: ``k`` distinct ids per row (a random start and odd stride modulo 4,096)
  and the top ``k`` of a peaked Gamma(0.3) distribution;
* :class:`ZipfRows`: the synthetic teacher's rows (the format's bytes/position data);
* :class:`RandomTeacherRows`: the rows of a teacher with random weights over Llama-3's 128,256
  tokens, what ``python -m benchmarks.service gpu`` scores on the GPU.

Forms (``--form``), what the engine hands the job path:

* ``arrays``: vLLM 0.32's prompt-logprob tensors wrapped as the service's vLLM hook wraps them
  (``vllm_logprobs.TensorPromptLogprobs``), converted by ``engine/vllm_rows.py``;
* ``hf``: the transformers backend (``server/engine/hf.py``) itself, its decoder and lm-head
  replaced by rows taken from the pool: batching, the hand-over of each decoder batch's top-k
  to the host and the per-sequence rows are the backend's own code (on the CPU, where the
  device's top-k tensors are host tensors already).
"""

from __future__ import annotations

import gc
import inspect
import threading
import time
from concurrent.futures import ThreadPoolExecutor
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


class StrideRows:
    """``--ids stride``: ``k`` distinct ids per row (a random start and a random odd stride
    modulo 4,096) and the top ``k`` of a peaked Gamma(0.3) distribution, made per call."""

    vocab = 4096

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def take(self, m: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        start = self.rng.integers(0, self.vocab, (m, 1))
        stride = 2 * self.rng.integers(0, self.vocab // 2, (m, 1)) + 1
        top = (start + stride * np.arange(k)[None, :]) % self.vocab
        g = self.rng.gamma(0.3, size=(m, k + 64))
        lps = np.log(-np.sort(-(g / g.sum(axis=1, keepdims=True)), axis=1)[:, :k])
        return top, lps


class ZipfRows(_Pool):
    """``--ids zipf``: top-k rows from the synthetic teacher (ids: the first k distinct of
    i.i.d. Zipf(1.05) draws over a 131,072-token vocabulary with a BPE-like id placement;
    logprobs: a noisy power law with a Beta tail mass), the data the format's <= 260
    B/position goal is measured on. The stride ids compress to ~57 B/position at k=100 but cost
    zstd more CPU than these (0.53 vs 0.36 CPU-us/position, numcodecs alone)."""

    vocab = 131072

    def __init__(self, seed: int = 0) -> None:
        teacher = Teacher(seed=seed)
        rng = np.random.default_rng(seed)
        ids = teacher.topk_ids(POOL_ROWS, rng, teacher.cdf(), teacher.rank_to_id(rng))
        super().__init__(ids, teacher.logprobs(POOL_ROWS, rng)[0], rng)


class RandomTeacherRows(_Pool):
    """``--ids random``: the rows of a Llama-shaped teacher with random weights, as the GPU mode
    scores (``benchmarks/service/gpu.py``): logits i.i.d. ``N(0, sigma^2)`` over ``vocab`` tokens
    (``sigma`` = 0.02 x sqrt(d): 0.9 for the 1B shape, 1.3 for 8B; the top 100 then hold 1.2%
    and 3.1% of the mass, as measured there). The top ``k`` of ``vocab`` draws come from the
    top uniform order statistics (``1 - U_(j) ~ Gamma_j / vocab``, exponential spacings), the
    log-normaliser is ``log(vocab) + sigma^2 / 2``; ids are ``k`` distinct uniform ids per row."""

    def __init__(
        self,
        seed: int = 0,
        vocab: int = 128256,
        sigma: float = 0.9,
        k: int = 100,
        pool: int = POOL_ROWS,
    ):
        import torch

        self.vocab = vocab
        rng = np.random.default_rng(seed)
        ids = np.stack([rng.choice(vocab, k, replace=False) for _ in range(pool)])
        u = rng.exponential(size=(pool, k)).cumsum(axis=1) / vocab
        z = -sigma * torch.special.ndtri(torch.from_numpy(u)).numpy()
        super().__init__(ids.astype(np.int32), z - (np.log(vocab) + sigma * sigma / 2), rng)


ROWS = {"stride": StrideRows, "zipf": ZipfRows, "random": RandomTeacherRows}


def tensor_output(ids: list[int], k: int, rows: Any) -> Any:
    """The engine core's prompt-logprob tensors for ``ids`` (what vLLM 0.32 hands its output
    processor: one buffer per request, ``LogprobsTensors.empty_cpu``): ``(token_ids [L-1, k+1]
    int32, logprobs [L-1, k+1] float32)``."""
    import torch

    tok, lp = _with_actual(ids, k, rows)
    return torch.from_numpy(tok.astype(np.int32)), torch.from_numpy(lp.astype(np.float32))


def _with_actual(ids: list[int], k: int, rows: Any) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's prompt-logprob rows: per position the actual next token, then the top-k."""
    m, w = len(ids) - 1, k + 1
    top, lps = rows.take(m, k)
    tok = np.empty((m, w), dtype=np.int64)
    tok[:, 0], tok[:, 1:] = ids[1:], top
    lp = np.empty((m, w), dtype=np.float64)
    lp[:, 0], lp[:, 1:] = -7.0, lps
    return tok, lp


def _info(vocab: int, k: int, backend: str) -> Any:
    from logitcache.server.engine import EngineInfo

    return EngineInfo(
        model_id="replay",
        revision="bench",
        vocab_size=vocab,
        max_k=k,
        tokenizer_fingerprint="replay",
        max_seq_len=4096,
        backend=backend,
        weights_hash="sha256:replay",
    )


def build_engine(
    prompts: list[list[int]], k: int, rows: Any, form: str = "arrays", rate: float = 0.0
) -> Any:
    """A replay engine of ``form`` (see the module docstring) over ``rows``; the vLLM forms'
    outputs are built before the clock and moved out of the collector's sight (``gc.freeze``:
    in the service an output lives only until its batch is converted). ``rate``: the ``hf``
    form's device pace (:func:`hf_engine`)."""
    if form == "hf":
        return hf_engine(k, rows, rate=rate)
    from logitcache.server.engine import BaseEngine
    from logitcache.server.engine.vllm_logprobs import TensorPromptLogprobs
    from logitcache.server.engine.vllm_rows import scores_from_output

    outputs = {tuple(p): tensor_output(p, k, rows) for p in prompts}
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
    ``[B, width, 0]`` tensor, ``_topk_rows`` the next rows of ``rows`` and their tail mass
    (copied, as a device's output is fresh memory). With ``rate`` (tokens/s), a decoder batch
    is ready no sooner than its tokens take at that rate after the previous one (the thread
    sleeps, as it waits for a device: the job path then sees a GPU's pace, batch by batch).
    Everything else is ``server/engine/hf.py``'s code."""
    import torch
    from logitcache.cache_format.records import tail_from_logprobs
    from logitcache.server.engine import BaseEngine, hf
    from logitcache.server.engine.hf import TransformersEngine

    # a tree whose backend hands over no tail mass (an A/B baseline) takes ids and logprobs
    params = inspect.signature(hf._Pending.start).parameters
    with_tail, with_entropy, with_actual = "tail" in params, "ent" in params, "act" in params

    class HfReplay(TransformersEngine):
        def __init__(self) -> None:
            BaseEngine.__init__(self)
            self.tokenizer = None
            self.info = _info(rows.vocab, k, "transformers")
            self.chunk_rows, self.batch_tokens = 1024, batch_tokens
            self.device = torch.device("cpu")
            self._lock = threading.Lock()  # a tree whose forwards are serialised by a lock
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
            out = [ids.astype(np.int32), lp32]
            if with_tail:
                out.append(tail_from_logprobs(lp32))  # the device's tail mass, the same formula
            top = tuple(torch.from_numpy(a) for a in out)
            ent = (None,) if with_entropy else ()  # no entropy asked
            # the actual token's logprob (FORMAT.md 4.12): a value of the row stands in for it
            act = (torch.from_numpy(lp32[:, -1].copy()),) if with_actual else ()
            return (*top, *ent, *act)

    return HfReplay()
