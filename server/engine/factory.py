"""``build_engine(settings, **overrides)``: the configured backend, built synchronously."""

from __future__ import annotations

from typing import Any

from .config import engine_config
from .protocol import TeacherEngine


def build_engine(settings: Any = None, **overrides: Any) -> TeacherEngine:
    """Build the configured backend (arguments: :func:`~.config.engine_config`)."""
    cfg = engine_config(settings, **overrides)
    if cfg.backend == "vllm":
        from .vllm import VllmEngine

        return VllmEngine(cfg)
    from .hf import TransformersEngine

    return TransformersEngine(cfg)
