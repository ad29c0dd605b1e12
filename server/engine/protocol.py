"""The teacher-engine contract: what an engine returns, how bad input is refused, and who it is.

For a prompt ``x_0 .. x_{L-1}`` (``L >= 2``) an engine returns ``L - 1`` rows; row ``j``
describes the teacher's distribution of token ``x_{j+1}`` given ``x_0 .. x_j``: ``topk_ids[j]``
the ``k`` most likely ids by descending logprob (int32), ``topk_logprobs[j]`` their
``log_softmax(z_j / T)`` (float32; ``T`` the call's temperature, ``None``: the engine's own) and
``tail_mass[j] = clip(1 - sum(exp(topk_logprobs[j])), 0, 1)``.

Bad input raises :class:`EngineInputError` (4xx) before any work; a running engine's failures
raise :class:`EngineError`, and :class:`EngineUnavailableError` while it is dead or restarting.

**Sampled targets** (:meth:`SamplingTeacherEngine.score_sampled`, FORMAT.md 4.4): row ``j``
holds the distinct ids of ``N`` draws from ``q ∝ p_j^(1/tau)`` by descending normalised
importance weight (``topk_logprobs = log w``), padded to ``N`` slots; the draws are seeded by
``sha256(f"{seed}:{key}")`` only, so rows do not depend on batching or resumes. With ``head =
m > 0`` the top ``m`` ids are kept exactly and the draws come from the rest.

This module imports nothing of the backends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
from logitcache.cache_format.records import (
    TopkRows,
    computed_tail,
    keep_tail,
    known_tail,
    rows_array,
)
from logitcache.cache_format.sampling import METHOD, sampling_manifest

Backend = Literal["vllm", "transformers"]

#: ``logprob_mode`` of both backends: log-probabilities of the tempered logits, before any
#: sampling processor (vLLM's ``raw_logprobs``).
LOGPROB_MODE = "raw_logprobs"


class EngineError(RuntimeError):
    """The engine failed while running (not the caller's fault)."""


class EngineConfigError(EngineError):
    """The engine cannot be built with the given configuration."""


class EngineInputError(ValueError):
    """The request is invalid for this engine (maps to HTTP 4xx); nothing was computed."""


class EngineClosedError(EngineError):
    """The engine was closed."""


class EngineUnavailableError(EngineError):
    """The engine has died or is being restarted: retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float = 5.0):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class EngineInfo:
    """What a cache manifest needs to know about the teacher behind an engine (``max_k`` and
    ``max_seq_len``: the limits it accepts; ``weights_hash``: ``None`` for a hub id not on
    disk)."""

    model_id: str
    revision: str | None
    vocab_size: int
    max_k: int
    tokenizer_fingerprint: str
    temperature: float = 1.0
    logprob_mode: str = LOGPROB_MODE
    max_seq_len: int = 2048
    backend: str = "vllm"
    dtype: str = "float32"
    weights_hash: str | None = None


@dataclass(frozen=True, eq=False)
class TeacherScores(TopkRows):
    """The rows of one prompt (module doc); ``tail_mass`` is computed at its first use, then
    kept (a job's writer computes it beside its encode pass)."""

    topk_ids: np.ndarray
    topk_logprobs: np.ndarray
    entropy: np.ndarray | None = None
    """``[L-1]`` float32: each row's entropy in nats (``EngineConfig.entropy``; else None)."""
    actual_logprob: np.ndarray | None = None
    """``[L-1]`` float32: row ``j``'s logprob of token ``j + 1`` (``None``: not computed)."""

    @property
    def tail_mass(self) -> np.ndarray:
        return computed_tail(self)

    def known_tail(self) -> np.ndarray | None:
        """The tail mass if it was computed already, else ``None``."""
        return known_tail(self)


@dataclass
class ScoreTimings:
    """Cumulative seconds an engine spent in the model and converting its output."""

    engine: float = 0.0
    convert: float = 0.0
    prompts: int = 0
    rows: int = 0
    calls: int = field(default=0)


#: Largest ``draws`` a sampled request may ask for (the row width of a sampled cache).
MAX_DRAWS = 4096
#: The target kinds an engine can produce (a cache manifest's ``targets``).
TargetKind = Literal["topk", "sampled"]


@dataclass(frozen=True)
class SampledTargets:
    """Parameters of sampled targets (module doc)."""

    draws: int
    proposal_temperature: float = 1.0
    seed: int = 0
    head: int = 0
    """The teacher's top ``head`` ids kept exactly, the draws from the rest (FORMAT.md 4.4)."""

    @property
    def slots(self) -> int:
        """Entries per row (the cache's ``k``): ``head + draws``."""
        return self.head + self.draws

    def manifest(self) -> dict[str, object]:
        """The cache manifest's ``sampling`` object for these parameters."""
        return sampling_manifest(self.draws, self.proposal_temperature, self.seed, self.head)

    @classmethod
    def from_manifest(cls, sampling: dict[str, object]) -> SampledTargets:
        """The parameters a sampled cache's manifest records (``sampling``)."""
        if sampling.get("method") != METHOD:
            raise EngineInputError(f"unknown sampling method {sampling.get('method')!r}")
        return cls(
            draws=int(sampling["draws"]),  # type: ignore[call-overload]
            proposal_temperature=float(sampling["proposal_temperature"]),  # type: ignore[arg-type]
            seed=int(sampling["seed"]),  # type: ignore[call-overload]
            head=int(sampling.get("head", 0)),  # type: ignore[call-overload]
        )


def check_sampled(targets: SampledTargets, vocab_size: int) -> SampledTargets:
    """``targets`` if ``1 <= draws``, ``head >= 0``, ``head + draws <= min(MAX_DRAWS,
    vocab_size)``, ``proposal_temperature`` finite > 0 and ``0 <= seed < 2**63``;
    :class:`EngineInputError` otherwise."""
    if not isinstance(targets, SampledTargets):
        raise EngineInputError(f"expected SampledTargets, got {type(targets).__name__}")
    d, tau, seed, head = targets.draws, targets.proposal_temperature, targets.seed, targets.head
    _check_int(d, "draws", 1)
    if d > min(MAX_DRAWS, vocab_size):
        raise EngineInputError(
            f"draws={d} exceeds the limit {min(MAX_DRAWS, vocab_size)} "
            f"(min of {MAX_DRAWS} and the vocabulary size)"
        )
    if isinstance(tau, bool) or not isinstance(tau, int | float) or not 0 < tau < float("inf"):
        raise EngineInputError(f"proposal_temperature must be a finite number > 0, got {tau!r}")
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or not 0 <= seed < 2**63:
        raise EngineInputError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    _check_int(head, "head", 0)
    if head + d > min(MAX_DRAWS, vocab_size):
        raise EngineInputError(
            f"head={head} + draws={d} slots exceed the limit {min(MAX_DRAWS, vocab_size)} "
            f"(min of {MAX_DRAWS} and the vocabulary size)"
        )
    return SampledTargets(int(d), float(tau), int(seed), int(head))


def _check_int(value: object, name: str, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < least:
        raise EngineInputError(f"{name} must be an integer >= {least}, got {value!r}")


def check_keys(keys: Sequence[str], n: int) -> list[str]:
    """One non-empty string key per prompt (the sampled rows' seed input)."""
    if isinstance(keys, str | bytes) or not isinstance(keys, Sequence):
        raise EngineInputError("keys must be a list of strings")
    if len(keys) != n:
        raise EngineInputError(f"{len(keys)} keys for {n} prompts")
    for i, key in enumerate(keys):
        if not isinstance(key, str) or not key:
            raise EngineInputError(f"key {i}: must be a non-empty string")
    return list(keys)


@runtime_checkable
class TeacherEngine(Protocol):
    """A teacher that scores token-id prompts (see the module docstring for the contract)."""

    info: EngineInfo

    def tokenize(self, text: str) -> list[int]:
        """The teacher tokenizer's ids for ``text`` (special tokens such as BOS included)."""
        ...

    async def score(
        self, prompts: list[list[int]], k: int, temperature: float | None = None
    ) -> list[TeacherScores]:
        """Top-``k`` rows of ``log_softmax(z / temperature)`` for every prompt, in order
        (``None``: the engine's ``info.temperature``)."""
        ...

    async def aclose(self) -> None:
        """Release the engine; later calls raise :class:`EngineClosedError`."""
        ...


@runtime_checkable
class SamplingTeacherEngine(TeacherEngine, Protocol):
    """A teacher that also produces sampled targets (both backends; see the module docstring)."""

    async def score_sampled(
        self,
        prompts: list[list[int]],
        keys: list[str],
        targets: SampledTargets,
        temperature: float | None = None,
    ) -> list[TeacherScores]:
        """Sampled rows (``[L-1, draws]``) for every prompt, in order; ``keys[i]`` seeds
        prompt ``i``'s draws."""
        ...


# ------------------------------------------------------------------------------------- checks


def make_scores(
    topk_ids: np.ndarray,
    topk_logprobs: np.ndarray,
    tail_mass: np.ndarray | None = None,
    entropy: np.ndarray | None = None,
    actual_logprob: np.ndarray | None = None,
) -> TeacherScores:
    """Wrap ``[rows, k]`` arrays (int32/float32, rows contiguous) as :class:`TeacherScores`;
    ``tail_mass``, ``entropy``, ``actual_logprob``: float32 ``[rows]`` where already computed."""
    ids = rows_array(topk_ids, np.int32)
    lps = rows_array(topk_logprobs, np.float32)
    ent = None if entropy is None else np.ascontiguousarray(entropy, dtype=np.float32)
    act = None if actual_logprob is None else np.ascontiguousarray(actual_logprob, np.float32)
    scores = TeacherScores(topk_ids=ids, topk_logprobs=lps, entropy=ent, actual_logprob=act)
    if tail_mass is not None:
        tail = np.asarray(tail_mass, dtype=np.float32)
        if tail.shape != (ids.shape[0],):
            raise ValueError(f"tail_mass of shape {tail.shape} for {ids.shape[0]} rows")
        keep_tail(scores, tail)
    return scores


#: Range of a call's temperature: ``z / T`` stays finite in float32 for any finite logit.
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 1e3


def check_temperature(temperature: float | None, default: float) -> float:
    """``temperature`` (``None``: ``default``) as a float in ``[MIN_TEMPERATURE,
    MAX_TEMPERATURE]``; :class:`EngineInputError` otherwise."""
    t = default if temperature is None else temperature
    if isinstance(t, bool) or not isinstance(t, int | float | np.floating | np.integer):
        raise EngineInputError(f"temperature must be a number, got {type(t).__name__}")
    t = float(t)
    if not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
        raise EngineInputError(
            f"temperature must be in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got {t!r}"
        )
    return t


def check_token_ids(ids: Sequence[Sequence[int]], n: int, vocab_size: int) -> list[list[int]]:
    """One list of ``1..MAX_DRAWS`` distinct ids in ``[0, vocab_size)`` per prompt."""
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence) or len(ids) != n:
        raise EngineInputError(f"token ids: one list of ids per prompt ({n}) expected")
    out: list[list[int]] = []
    for i, row in enumerate(ids):
        arr = np.asarray(row)
        if arr.ndim != 1 or arr.dtype.kind not in "iu" or not 1 <= arr.shape[0] <= MAX_DRAWS:
            raise EngineInputError(f"token ids {i}: 1 to {MAX_DRAWS} integer ids expected")
        if int(arr.min()) < 0 or int(arr.max()) >= vocab_size:
            raise EngineInputError(f"token ids {i}: an id outside the vocabulary [0, {vocab_size})")
        if len(np.unique(arr)) != arr.shape[0]:
            raise EngineInputError(f"token ids {i}: an id is repeated")
        out.append(arr.tolist())
    return out


def check_k(k: int, max_k: int, vocab_size: int) -> int:
    """``k`` as an int in ``[1, min(max_k, vocab_size)]``; :class:`EngineInputError` otherwise."""
    if isinstance(k, bool) or not isinstance(k, int | np.integer):
        raise EngineInputError(f"k must be an integer, got {type(k).__name__}")
    k = int(k)
    if k < 1:
        raise EngineInputError(f"k must be >= 1, got {k}")
    if k > max_k:
        raise EngineInputError(
            f"k={k} exceeds the engine's limit max_k={max_k} (start it with a larger -k)"
        )
    if k > vocab_size:
        raise EngineInputError(f"k={k} exceeds the vocabulary size {vocab_size}")
    return k


def check_prompts(
    prompts: Sequence[Sequence[int]], info: EngineInfo, arrays: bool = False
) -> list[Any]:
    """Validate a batch of prompts against ``info`` (the first problem an
    :class:`EngineInputError` naming the prompt's index); return them as ``list[int]`` lists
    (``arrays``: C-ordered int64 arrays)."""
    if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence):
        raise EngineInputError("prompts must be a list of token-id lists")
    if len(prompts) == 0:
        raise EngineInputError("no prompts given")
    out: list[Any] = []
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
        if n > info.max_seq_len:
            raise EngineInputError(
                f"prompt {i}: {n} tokens exceed the engine's max_seq_len={info.max_seq_len}"
            )
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= info.vocab_size:
            bad = lo if lo < 0 else hi
            raise EngineInputError(
                f"prompt {i}: token id {bad} outside the vocabulary [0, {info.vocab_size})"
            )
        out.append(np.ascontiguousarray(arr, np.int64) if arrays else arr.tolist())
    return out
