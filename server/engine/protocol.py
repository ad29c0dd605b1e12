"""The teacher-engine contract: what an engine returns, how bad input is refused, and who it is.

For a prompt ``x_0 .. x_{L-1}`` (``L >= 2``) an engine returns ``L - 1`` rows; row ``j``
describes the teacher's distribution of token ``x_{j+1}`` given ``x_0 .. x_j`` (DESIGN.md,
"Alignment"):

* ``topk_ids[j]``: the ``k`` most likely ids, distinct, by descending logprob (int32);
* ``topk_logprobs[j]``: their log-probabilities ``log_softmax(z_j / T)`` where ``z_j`` are the
  teacher's logits and ``T`` the engine's temperature (float32, ``<= 0``, non-increasing);
* ``tail_mass[j] = clip(1 - sum(exp(topk_logprobs[j])), 0, 1)`` (float32): the probability
  mass outside the top-k.

Bad input raises :class:`EngineInputError` (a ``ValueError``; the server maps it to 4xx) before
any work is done: an empty batch or prompt, a prompt shorter than 2 tokens or longer than
``info.max_model_len``, token ids outside ``[0, vocab_size)``, ``k`` outside ``[1, max_k]``.
Engine configuration problems raise :class:`EngineConfigError`; failures inside a running engine
raise :class:`EngineError`.

This module imports nothing of the backends (numpy and the format's records only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import numpy as np
from logitcache.cache_format.records import TopkRows, tail_from_logprobs

Backend = Literal["vllm", "transformers"]

#: ``logprob_mode`` recorded by both backends: normalised log-probabilities of the (tempered)
#: logits, before any sampling processor (vLLM's ``raw_logprobs``; prompt positions never pass
#: through sampling processors in vLLM 0.32, so ``processed_logprobs`` would be identical).
LOGPROB_MODE = "raw_logprobs"


class EngineError(RuntimeError):
    """The engine failed while running (not the caller's fault)."""


class EngineConfigError(EngineError):
    """The engine cannot be built with the given configuration."""


class EngineInputError(ValueError):
    """The request is invalid for this engine (maps to HTTP 4xx); nothing was computed."""


class EngineClosedError(EngineError):
    """The engine was closed."""


@dataclass(frozen=True)
class EngineInfo:
    """What a cache manifest needs to know about the teacher behind an engine.

    ``max_k``: the largest ``k`` a request may ask for; ``max_model_len``: the longest prompt
    (in tokens) the engine accepts. ``weights_hash``: a content hash of the weight files
    (:func:`logitcache.server.engine.identity.weights_hash`; ``None`` for a hub id not on disk).
    """

    model_id: str
    revision: str | None
    vocab_size: int
    max_k: int
    tokenizer_fingerprint: str
    temperature: float = 1.0
    logprob_mode: str = LOGPROB_MODE
    max_model_len: int = 2048
    backend: str = "vllm"
    dtype: str = "float32"
    weights_hash: str | None = None


@dataclass(frozen=True)
class TeacherScores(TopkRows):
    """The rows of one prompt: ``topk_ids [L-1, k]`` int32, ``topk_logprobs [L-1, k]`` float32,
    ``tail_mass [L-1]`` float32 (see the module docstring); ``num_rows`` and ``k`` as for a
    cached record."""

    topk_ids: np.ndarray
    topk_logprobs: np.ndarray
    tail_mass: np.ndarray


@dataclass
class ScoreTimings:
    """Cumulative seconds an engine spent per phase (for benchmarks): ``engine`` is the model's
    own time as seen by the caller, ``convert`` the output-to-numpy conversion."""

    engine: float = 0.0
    convert: float = 0.0
    prompts: int = 0
    rows: int = 0
    calls: int = field(default=0)

    def reset(self) -> None:
        self.engine = self.convert = 0.0
        self.prompts = self.rows = self.calls = 0


@runtime_checkable
class TeacherEngine(Protocol):
    """A teacher that scores token-id prompts (see the module docstring for the contract)."""

    info: EngineInfo

    def tokenize(self, text: str) -> list[int]:
        """The teacher tokenizer's ids for ``text`` (special tokens such as BOS included)."""
        ...

    async def score(self, prompts: list[list[int]], k: int) -> list[TeacherScores]:
        """Top-``k`` rows for every prompt, in order."""
        ...

    async def aclose(self) -> None:
        """Release the engine; later calls raise :class:`EngineClosedError`."""
        ...


# ------------------------------------------------------------------------------------- checks


def make_scores(topk_ids: np.ndarray, topk_logprobs: np.ndarray) -> TeacherScores:
    """Wrap ``[rows, k]`` arrays (cast to int32/float32, C-contiguous) and add the tail mass
    (:func:`~logitcache.cache_format.records.tail_from_logprobs`: the format's own formula)."""
    ids = np.ascontiguousarray(topk_ids, dtype=np.int32)
    lps = np.ascontiguousarray(topk_logprobs, dtype=np.float32)
    return TeacherScores(topk_ids=ids, topk_logprobs=lps, tail_mass=tail_from_logprobs(lps))


def check_k(k: int, max_k: int, vocab_size: int) -> int:
    """``k`` as an int in ``[1, min(max_k, vocab_size)]``; :class:`EngineInputError` otherwise."""
    if isinstance(k, bool) or not isinstance(k, int | np.integer):
        raise EngineInputError(f"k must be an integer, got {type(k).__name__}")
    k = int(k)
    if k < 1:
        raise EngineInputError(f"k must be >= 1, got {k}")
    if k > max_k:
        raise EngineInputError(f"k={k} exceeds the engine's max_k={max_k}")
    if k > vocab_size:
        raise EngineInputError(f"k={k} exceeds the vocabulary size {vocab_size}")
    return k


def check_prompts(prompts: Sequence[Sequence[int]], info: EngineInfo) -> list[list[int]]:
    """Validate a batch of prompts against ``info``; return them as plain ``list[int]`` lists.

    Every prompt is checked before any is returned, and the first problem is raised as an
    :class:`EngineInputError` naming the prompt's index.
    """
    if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence):
        raise EngineInputError("prompts must be a list of token-id lists")
    if len(prompts) == 0:
        raise EngineInputError("no prompts given")
    out: list[list[int]] = []
    for i, p in enumerate(prompts):
        try:
            arr = np.asarray(p)
        except (TypeError, ValueError) as e:
            raise EngineInputError(f"prompt {i}: not a list of token ids ({e})") from None
        if arr.ndim != 1:
            raise EngineInputError(f"prompt {i}: expected a flat list of token ids")
        n = arr.shape[0]
        if n == 0:
            raise EngineInputError(f"prompt {i}: empty prompt")
        if arr.dtype.kind not in "iu":
            raise EngineInputError(f"prompt {i}: token ids must be integers, got {arr.dtype}")
        if n < 2:
            raise EngineInputError(f"prompt {i}: needs at least 2 tokens to have a row, got {n}")
        if n > info.max_model_len:
            raise EngineInputError(
                f"prompt {i}: {n} tokens exceed the engine's max_model_len={info.max_model_len}"
            )
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= info.vocab_size:
            bad = lo if lo < 0 else hi
            raise EngineInputError(
                f"prompt {i}: token id {bad} outside the vocabulary [0, {info.vocab_size})"
            )
        out.append(arr.astype(np.int64).tolist())
    return out
