"""The teacher engine interface shared by the vLLM and the plain-transformers backends.

Contract (DESIGN.md "Alignment"): for a prompt ``x_0 .. x_{L-1}`` (``L >= 2``) an engine returns
``L - 1`` rows; row ``j`` describes the teacher's distribution of token ``x_{j+1}`` given
``x_0 .. x_j``:

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
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
from logitcache.cache_format import tokenizer_fingerprint
from logitcache.cache_format.records import TopkRows, tail_from_logprobs

Backend = Literal["vllm", "transformers"]
#: Accepted spellings of the backends (``hf`` is the server settings' name).
BACKEND_ALIASES: dict[str, Backend] = {
    "vllm": "vllm",
    "transformers": "transformers",
    "hf": "transformers",
}

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
    """What a cache manifest needs to know about the teacher behind an engine."""

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


# ------------------------------------------------------------------------------------- helpers


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


def resolve_backend(name: str) -> Backend:
    """Map ``vllm`` / ``transformers`` / ``hf`` to a backend name; EngineConfigError otherwise."""
    try:
        return BACKEND_ALIASES[name.lower()]
    except (KeyError, AttributeError):
        raise EngineConfigError(
            f"unknown engine backend {name!r}; choose one of {sorted(BACKEND_ALIASES)}"
        ) from None


def local_revision(model: str, revision: str | None) -> str | None:
    """The given revision, else for a local model directory a short content hash of its
    ``config.json`` and weight-file sizes and mtimes (so different weights get different ids)."""
    if revision:
        return revision
    path = Path(model)
    if not path.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(path.iterdir()):
        if f.suffix in {".json", ".safetensors", ".bin"} and f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}".encode())
            if f.name == "config.json":
                h.update(f.read_bytes())
            elif f.suffix == ".safetensors":  # the header names every tensor and its offsets
                with f.open("rb") as fh:
                    n = int.from_bytes(fh.read(8), "little")
                    h.update(fh.read(min(n, 1 << 20)))
    return "local-" + h.hexdigest()[:12]


def model_max_len(model: str) -> int | None:
    """``max_position_embeddings`` (or equivalent) from a local model's ``config.json``."""
    cfg = Path(model) / "config.json"
    if not cfg.is_file():
        return None
    data = json.loads(cfg.read_text())
    data = data.get("text_config", data)
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        if isinstance(data.get(key), int):
            return int(data[key])
    return None


class Stopwatch:
    """``with sw: ...`` adds the elapsed seconds to ``sw.elapsed``."""

    def __init__(self) -> None:
        self.elapsed = 0.0

    def __enter__(self) -> Stopwatch:
        self._t = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed += time.perf_counter() - self._t


# --------------------------------------------------------------------------------- construction


@dataclass(frozen=True)
class EngineConfig:
    """Backend-independent engine options (what :func:`build_engine` reads from settings).

    ``max_model_len``: the longest prompt accepted (``None``: the model's own limit; vLLM needs
    room for one generated token, see ``engine_vllm``). ``memory_share`` is vLLM's
    ``gpu_memory_utilization``; on CPU the KV cache is sized by ``VLLM_CPU_KVCACHE_SPACE``.
    """

    model: str
    backend: Backend = "vllm"
    max_k: int = 20
    temperature: float = 1.0
    dtype: str = "auto"
    max_model_len: int | None = None
    revision: str | None = None
    tokenizer: str | None = None
    model_id: str | None = None
    memory_share: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.model:
            raise EngineConfigError("no teacher model given")
        if self.max_k < 1:
            raise EngineConfigError(f"max_k must be >= 1, got {self.max_k}")
        if not self.temperature > 0:
            raise EngineConfigError(f"temperature must be > 0, got {self.temperature}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise EngineConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def display_id(self) -> str:
        """The model id recorded in manifests: ``model_id`` or the model path/id as given."""
        return self.model_id or self.model


def engine_info(
    cfg: EngineConfig,
    *,
    tokenizer: Any,
    vocab_size: int,
    max_model_len: int,
    backend: Backend,
    dtype: str,
) -> EngineInfo:
    """The :class:`EngineInfo` of an engine built from ``cfg``, the same for every backend:
    ``cfg.display_id``, :func:`local_revision`, ``max_k = min(cfg.max_k, vocab_size)``, the
    tokenizer's fingerprint, ``cfg.temperature`` and :data:`LOGPROB_MODE`; the backend supplies
    the vocabulary size, the accepted prompt length and the dtype it resolved."""
    return EngineInfo(
        model_id=cfg.display_id,
        revision=local_revision(cfg.model, cfg.revision),
        vocab_size=vocab_size,
        max_k=min(cfg.max_k, vocab_size),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        temperature=cfg.temperature,
        logprob_mode=LOGPROB_MODE,
        max_model_len=max_model_len,
        backend=backend,
        dtype=dtype,
    )


#: ServerSettings attribute -> EngineConfig field.
_SETTINGS_FIELDS = {
    "model": "model",
    "backend": "backend",
    "k": "max_k",
    "temperature": "temperature",
    "dtype": "dtype",
    "max_seq_len": "max_model_len",
    "revision": "revision",
    "tokenizer": "tokenizer",
    "memory_share": "memory_share",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "tensor_parallel_size": "tensor_parallel_size",
    "pipeline_parallel_size": "pipeline_parallel_size",
    "seed": "seed",
    "engine_options": "options",
}


def engine_config(settings: Any = None, **overrides: Any) -> EngineConfig:
    """An :class:`EngineConfig` from a settings-like object (``ServerSettings`` attribute names)
    and/or keyword arguments (``EngineConfig`` field names; they win)."""
    kwargs: dict[str, Any] = {}
    if settings is not None:
        for attr, name in _SETTINGS_FIELDS.items():
            if hasattr(settings, attr):
                kwargs[name] = getattr(settings, attr)
    kwargs.update(overrides)
    kwargs["backend"] = resolve_backend(str(kwargs.get("backend", "vllm")))
    kwargs["model"] = str(kwargs.get("model", ""))
    if kwargs.get("options") is None:
        kwargs["options"] = {}
    try:
        return EngineConfig(**kwargs)
    except TypeError as e:
        raise EngineConfigError(f"bad engine option: {e}") from None


def build_engine(settings: Any = None, **overrides: Any) -> TeacherEngine:
    """Build the configured backend (synchronously; vLLM's start-up blocks ~3 s on the tiny
    teacher). See :func:`engine_config` for the accepted arguments."""
    cfg = engine_config(settings, **overrides)
    if cfg.backend == "vllm":
        from .engine_vllm import VllmEngine

        return VllmEngine(cfg)
    from .engine_hf import TransformersEngine

    return TransformersEngine(cfg)
