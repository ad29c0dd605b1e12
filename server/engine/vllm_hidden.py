"""Hidden-state capture on vLLM (FORMAT.md 4.10): the worker hook (:mod:`.vllm_sampling`,
``extra_args[HIDDEN] = d``) answers a request with the hidden states vLLM's prompt-logprob pass
hands its head (the model's output after its final norm), ``d`` values per row; the head is read
from the checkpoint's own tensors (``lm_head.weight``, or the input embedding of a model with
tied embeddings, and ``lm_head.bias``), cast to the engine's dtype as vLLM loads it, with the
config's soft-capping and logit scale (:func:`.hidden.head_of`)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from .protocol import EngineInputError

HEAD_KEYS = ("lm_head.weight", "model.embed_tokens.weight")


def _text(config: dict[str, Any]) -> dict[str, Any]:
    return dict(config.get("text_config", config))


def hidden_size(config: dict[str, Any]) -> int:
    """``d`` of a model's ``config.json`` (its text config's ``hidden_size``)."""
    return int(_text(config)["hidden_size"])


def rows_of(outputs: list[Any], prompts: list[list[int]], d: int) -> list[np.ndarray]:
    """The hooked answers' ``[L - 1, d]`` float32 hidden states (ids checked: ``0..d-1``)."""
    from .vllm_rows import hooked_from_output

    out = []
    for raw, p in zip(outputs, prompts, strict=True):
        rows = hooked_from_output(raw, len(p), d)
        if not (rows.topk_ids == np.arange(d, dtype=np.int32)).all():
            raise EngineInputError("vLLM's worker hook answered a hidden-state request with ids")
        out.append(np.ascontiguousarray(rows.topk_logprobs, dtype=np.float32))
    return out


def checkpoint_head(model_dir: str, config: dict[str, Any], dtype: str) -> Any:
    """The :class:`~logitcache.cache_format.TeacherHead` of a local checkpoint (safetensors),
    the weight cast to ``dtype`` (the engine's) as vLLM computes with it."""
    import torch
    from safetensors import safe_open

    from .hidden import head_of

    root = Path(model_dir)
    if not root.is_dir():
        raise EngineInputError(
            "the vLLM backend reads the teacher head of a local checkpoint folder only"
        )
    index = root / "model.safetensors.index.json"
    files = (
        json.loads(index.read_text())["weight_map"]
        if index.exists()
        else {k: "model.safetensors" for k in (*HEAD_KEYS, "lm_head.bias")}
    )
    text = _text(config)
    tied = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    found: dict[str, Any] = {}
    for key in (*HEAD_KEYS, "lm_head.bias"):
        if key not in files or not (root / files[key]).exists():
            continue
        with safe_open(str(root / files[key]), framework="pt") as f:
            if key in f.keys():
                found[key] = f.get_tensor(key)
    weight = found.get("lm_head.weight")
    if weight is None and tied:
        weight = found.get("model.embed_tokens.weight")
    if weight is None:
        raise EngineInputError(f"no lm head weight ({' or '.join(HEAD_KEYS)}) in {model_dir}")
    torch_dtype = getattr(torch, dtype, torch.float32)
    bias = found.get("lm_head.bias")
    b = None if bias is None else bias.to(torch_dtype)
    return head_of(weight.to(torch_dtype), b, SimpleNamespace(**text))
