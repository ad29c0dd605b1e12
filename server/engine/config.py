"""Engine configuration: backend-independent :class:`EngineConfig`, typed per-backend options,
and the :class:`~.protocol.EngineInfo` an engine built from a config reports.

``EngineConfig.options`` is the operator's free-form dict (``--engine-options`` JSON); each
backend parses it once into its typed options (:class:`VllmOptions`, :class:`HfOptions`), which
name the keys it consumes and pass the rest on (vLLM ``EngineArgs`` / ``from_pretrained``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from logitcache.cache_format import tokenizer_fingerprint

from .identity import local_revision, weights_hash
from .protocol import (
    LOGPROB_MODE,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    Backend,
    EngineConfigError,
    EngineInfo,
)

#: Accepted spellings of the backends (``hf`` is the server settings' name).
BACKEND_ALIASES: dict[str, Backend] = {
    "vllm": "vllm",
    "transformers": "transformers",
    "hf": "transformers",
}

VllmMode = Literal["auto", "async", "inproc"]


def resolve_backend(name: str) -> Backend:
    """Map ``vllm`` / ``transformers`` / ``hf`` to a backend name; EngineConfigError otherwise."""
    try:
        return BACKEND_ALIASES[name.lower()]
    except (KeyError, AttributeError):
        raise EngineConfigError(
            f"unknown engine backend {name!r}; choose one of {sorted(BACKEND_ALIASES)}"
        ) from None


@dataclass(frozen=True)
class VllmOptions:
    """The vLLM backend's own options (``options`` keys ``vllm_mode``, ``cpu_kvcache_gib``);
    every other key is an ``EngineArgs`` keyword passed as is (``engine_args``)."""

    mode: VllmMode = "auto"
    cpu_kvcache_gib: float = 1.0
    engine_args: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> VllmOptions:
        rest = dict(options)
        mode = str(rest.pop("vllm_mode", "auto"))
        if mode not in ("auto", "async", "inproc"):
            raise EngineConfigError(f"vllm_mode must be auto, async or inproc, got {mode!r}")
        try:
            gib = float(rest.pop("cpu_kvcache_gib", 1.0))
        except (TypeError, ValueError):
            raise EngineConfigError("cpu_kvcache_gib must be a number") from None
        for key in HfOptions.OWN:  # the other backend's keys are ignored
            rest.pop(key, None)
        return cls(mode=mode, cpu_kvcache_gib=gib, engine_args=rest)  # type: ignore[arg-type]


@dataclass(frozen=True)
class HfOptions:
    """The transformers backend's options (``chunk_rows``, ``batch_tokens``, ``device``); every
    other key goes to ``from_pretrained``."""

    OWN = ("chunk_rows", "batch_tokens", "device")

    chunk_rows: int = 1024
    batch_tokens: int = 8192
    device: str | None = None
    model_kwargs: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> HfOptions:
        rest = dict(options)
        try:
            chunk_rows = int(rest.pop("chunk_rows", 1024))
            batch_tokens = int(rest.pop("batch_tokens", 8192))
        except (TypeError, ValueError):
            raise EngineConfigError("chunk_rows and batch_tokens must be integers") from None
        if chunk_rows < 1 or batch_tokens < 1:
            raise EngineConfigError("chunk_rows and batch_tokens must be >= 1")
        device = rest.pop("device", None)
        for key in ("vllm_mode", "cpu_kvcache_gib"):  # the vLLM backend's keys
            rest.pop(key, None)
        return cls(chunk_rows, batch_tokens, None if device is None else str(device), rest)


@dataclass(frozen=True)
class EngineConfig:
    """Backend-independent engine options (what :func:`engine_config` reads from settings;
    ``options``: parsed by :class:`VllmOptions` / :class:`HfOptions`)."""

    model: str
    backend: Backend = "vllm"
    max_k: int = 20
    temperature: float = 1.0
    dtype: str = "auto"
    max_seq_len: int | None = None
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
    entropy: bool = False
    """Compute each row's teacher entropy (FORMAT.md 4.9) in the scoring pass (``TeacherScores
    .entropy``); caches the service creates then keep it."""

    def __post_init__(self) -> None:
        if not self.model:
            raise EngineConfigError("no teacher model given")
        if self.max_k < 1:
            raise EngineConfigError(f"max_k must be >= 1, got {self.max_k}")
        if not MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE:
            raise EngineConfigError(
                f"temperature must be in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], "
                f"got {self.temperature}"
            )
        if not isinstance(self.entropy, bool):
            raise EngineConfigError(f"entropy must be true or false, got {self.entropy!r}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise EngineConfigError(f"max_seq_len must be >= 2, got {self.max_seq_len}")

    @property
    def display_id(self) -> str:
        """The model id recorded in manifests: ``model_id`` or the model path/id as given."""
        return self.model_id or self.model


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


def engine_info(
    cfg: EngineConfig,
    *,
    tokenizer: Any,
    vocab_size: int,
    max_seq_len: int,
    backend: Backend,
    dtype: str,
) -> EngineInfo:
    """The :class:`EngineInfo` of an engine built from ``cfg``, the same for every backend; the
    backend supplies the vocabulary size, prompt length and resolved dtype."""
    return EngineInfo(
        model_id=cfg.display_id,
        revision=local_revision(cfg.model, cfg.revision),
        vocab_size=vocab_size,
        max_k=min(cfg.max_k, vocab_size),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        temperature=cfg.temperature,
        logprob_mode=LOGPROB_MODE,
        max_seq_len=max_seq_len,
        backend=backend,
        dtype=dtype,
        weights_hash=weights_hash(cfg.model),
    )


#: ServerSettings attribute -> EngineConfig field.
_SETTINGS_FIELDS = {
    "model": "model",
    "backend": "backend",
    "k": "max_k",
    "max_k": "max_k",
    "temperature": "temperature",
    "dtype": "dtype",
    "max_seq_len": "max_seq_len",
    "revision": "revision",
    "tokenizer": "tokenizer",
    "memory_share": "memory_share",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "tensor_parallel_size": "tensor_parallel_size",
    "pipeline_parallel_size": "pipeline_parallel_size",
    "seed": "seed",
    "engine_options": "options",
    "entropy": "entropy",
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


def read_model_config(model: str) -> dict[str, Any]:
    """A model's ``config.json`` as a dict (a hub id: through transformers' ``AutoConfig``)."""
    cfg_path = Path(model) / "config.json"
    if cfg_path.is_file():
        return dict(json.loads(cfg_path.read_text()))
    from transformers import AutoConfig  # a hub id (needs the hub or its local cache)

    return dict(AutoConfig.from_pretrained(model).to_dict())


def config_vocab_size(config: Mapping[str, Any]) -> int:
    """``vocab_size`` of a model config (``text_config`` first); EngineConfigError if absent."""
    data = config.get("text_config", config)
    v = data.get("vocab_size")
    if not isinstance(v, int) or v < 1:
        raise EngineConfigError("the model config has no vocab_size")
    return v


def planned_info(cfg: EngineConfig) -> EngineInfo:
    """The :class:`EngineInfo` an engine built from ``cfg`` will report, from the model's files and
    tokenizer only (``dtype="auto"`` stays unresolved), for checks before an engine starts."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.model)
    return engine_info(
        cfg,
        tokenizer=tokenizer,
        vocab_size=config_vocab_size(read_model_config(cfg.model)),
        max_seq_len=cfg.max_seq_len or 2,
        backend=cfg.backend,
        dtype=cfg.dtype,
    )
