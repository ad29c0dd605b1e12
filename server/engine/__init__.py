"""The teacher engine: one contract, two backends.

Modules (arrows are the only imports allowed inside the package; tests/repo/test_packaging.py):

* :mod:`.protocol` — the contract (:class:`TeacherEngine`, :class:`EngineInfo`,
  :class:`TeacherScores`, errors, the input checks); imports no backend.
* :mod:`.identity` — the weights' content hash and local revision.
* :mod:`.config` — :class:`EngineConfig`, typed per-backend options, :func:`engine_info`
  (-> protocol, identity).
* :mod:`.base` — the check/score/convert/time path every backend shares (-> protocol).
* :mod:`.vllm`, :mod:`.hf` — the backends (-> protocol, config, base); vLLM/torch are imported
  when an engine is built, never at import time. :mod:`.vllm_logprobs` has vLLM hand this
  engine's prompt logprobs over as arrays (no Python lists); :mod:`.vllm_rows` turns one vLLM
  output into rows; :mod:`.vllm_sampling` draws sampled targets inside vLLM's worker (both
  hooks installed through :mod:`.patching`); :mod:`.hidden` and :mod:`.vllm_hidden` capture
  hidden states (FORMAT.md 4.10); :mod:`.reaper` ends the engine's processes with the server.
* :mod:`.factory` — :func:`build_engine` (-> config, backends, lazily).
* :mod:`.supervisor` — :class:`SupervisedEngine`: restarts an engine that died (-> protocol).
"""

from __future__ import annotations

from .base import BaseEngine
from .config import (
    BACKEND_ALIASES,
    EngineConfig,
    HfOptions,
    VllmOptions,
    engine_config,
    engine_info,
    model_max_len,
    resolve_backend,
)
from .factory import build_engine
from .identity import local_revision, weights_hash
from .protocol import (
    LOGPROB_MODE,
    Backend,
    EngineClosedError,
    EngineConfigError,
    EngineError,
    EngineInfo,
    EngineInputError,
    EngineUnavailableError,
    SampledTargets,
    SamplingTeacherEngine,
    ScoreTimings,
    TeacherEngine,
    TeacherScores,
    check_k,
    check_prompts,
    check_sampled,
    make_scores,
)
from .supervisor import SupervisedEngine

__all__ = [
    "BACKEND_ALIASES",
    "LOGPROB_MODE",
    "Backend",
    "BaseEngine",
    "EngineClosedError",
    "EngineConfig",
    "EngineConfigError",
    "EngineError",
    "EngineInfo",
    "EngineInputError",
    "EngineUnavailableError",
    "HfOptions",
    "SampledTargets",
    "SamplingTeacherEngine",
    "SupervisedEngine",
    "ScoreTimings",
    "TeacherEngine",
    "TeacherScores",
    "VllmOptions",
    "build_engine",
    "check_k",
    "check_prompts",
    "check_sampled",
    "engine_config",
    "engine_info",
    "local_revision",
    "make_scores",
    "model_max_len",
    "resolve_backend",
    "weights_hash",
]
