"""Run a Hugging Face causal LM on packed ``CacheDataset`` batches without cross-document leaks.

A packed item holds several documents (pieces) back to back; ``position_ids`` restart at 0 at every
piece and padding is one trailing run with ``position_ids = 0`` (see
:mod:`logitcache.client.collate`). Attention must stay inside each piece. What each attention
backend of transformers 5.x needs for that:

* ``eager`` / ``sdpa`` / ``flex_attention``: ``position_ids``, **no** ``attention_mask`` and **no
  cache** (``use_cache=False``). transformers then derives a block-diagonal causal mask from the
  position ids (``masking_utils.find_packed_sequence_indices``: a new document wherever the
  position does not grow by one). With a cache object (the default ``use_cache=True`` builds a
  ``DynamicCache``) or with a 2D ``attention_mask`` that detection is skipped and the documents
  of an item attend to each other (``tests/client/test_client_packing.py`` shows both cases).
* ``flash_attention_*`` (varlen kernels): the same, plus explicit ``cu_seq_lens_q/k`` and
  ``max_length_q/k`` (:func:`varlen_kwargs`), the cumulative document boundaries over the
  flattened ``[B * T]`` tokens, so no boundary is re-derived inside every layer.

Each padding token (``position_ids = 0``) is a document of its own: it attends to itself only,
never to real tokens, and real tokens never attend to it.

:func:`packed_hidden_states` calls the **model passed in** (the DDP / FSDP / accelerate wrapper,
not ``model.model``), so the wrapper's forward hooks run: DDP's gradient synchronisation and
FSDP's parameter gathering. It asks for ``output_hidden_states=True`` and ``logits_to_keep=1``
(only the last position's logits are computed; the loss projects the hidden states itself, e.g.
:func:`logitcache.client.loss.topk_distill_loss`) and returns the last entry of
``hidden_states``: the final, normalised hidden states, i.e. exactly the input of ``lm_head``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .errors import ConfigError

__all__ = [
    "attn_implementation",
    "packed_hidden_states",
    "packed_model_inputs",
    "unwrap_model",
    "varlen_kwargs",
]

_FLASH_PREFIX = "flash_attention"


def unwrap_model(model: Any) -> Any:
    """The Hugging Face model inside DDP (``.module``), accelerate/compile (``._orig_mod``)
    or PEFT (``.get_base_model()``) wrappers; ``model`` itself when it is not wrapped."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif hasattr(model, "get_base_model") and callable(model.get_base_model):
            model = model.get_base_model()
    return model


def attn_implementation(model: torch.nn.Module) -> str:
    """The attention implementation the (unwrapped) model's config selects, e.g. ``"sdpa"``."""
    config = getattr(unwrap_model(model), "config", None)
    impl = getattr(config, "_attn_implementation", None) or "eager"
    return str(impl)


def varlen_kwargs(position_ids: torch.Tensor) -> dict[str, Any]:
    """``cu_seq_lens_q/k`` (int32, ``[n_docs + 1]``) and ``max_length_q/k`` (int) of a packed
    batch, over its flattened ``[B * T]`` tokens: a document starts wherever ``position_ids == 0``
    (every item starts one), the last boundary is ``B * T``."""
    flat = position_ids.reshape(-1)
    if flat.numel() == 0:
        raise ConfigError("empty batch: position_ids has no tokens")
    if int(flat[0]) != 0:
        raise ConfigError("position_ids must start at 0 (a packed item starts a document)")
    starts = torch.nonzero(flat == 0).reshape(-1).to(torch.int32)
    total = torch.tensor([flat.numel()], dtype=torch.int32, device=flat.device)
    cu = torch.cat([starts, total])
    max_len = int(cu.diff().max())
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max_len,
        "max_length_k": max_len,
    }


def packed_model_inputs(
    batch: Mapping[str, torch.Tensor], *, attn_implementation: str = "sdpa"
) -> dict[str, Any]:
    """Keyword arguments of a causal LM's ``forward`` for a packed batch (``input_ids`` and
    ``position_ids`` ``[B, T]``): no ``attention_mask``, ``use_cache=False``, and for flash
    attention the varlen boundaries (:func:`varlen_kwargs`)."""
    for name in ("input_ids", "position_ids"):
        if name not in batch:
            raise ConfigError(f"a packed batch needs {name!r} (got {sorted(batch)})")
    input_ids, position_ids = batch["input_ids"], batch["position_ids"]
    if input_ids.shape != position_ids.shape or input_ids.dim() != 2:
        raise ConfigError(
            f"input_ids {tuple(input_ids.shape)} and position_ids {tuple(position_ids.shape)} "
            "must both be [B, T]"
        )
    kwargs: dict[str, Any] = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "use_cache": False,
    }
    if attn_implementation.startswith(_FLASH_PREFIX):
        kwargs.update(varlen_kwargs(position_ids))
    return kwargs


def packed_hidden_states(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Final hidden states ``[B, T, d]`` (the ``lm_head`` input) of a packed batch.

    ``model`` is what the trainer holds: a ``*ForCausalLM`` or its DDP / FSDP / accelerate
    wrapper; it is *called* (``model(**inputs)``), so the wrapper's hooks run. Documents of an
    item never attend to each other (module docstring). The logits of the last position only are
    computed (``logits_to_keep=1``).
    """
    kwargs = packed_model_inputs(batch, attn_implementation=attn_implementation(model))
    out = model(**kwargs, output_hidden_states=True, logits_to_keep=1, return_dict=True)
    hidden = getattr(out, "hidden_states", None)
    if not hidden:
        raise ConfigError(f"{type(unwrap_model(model)).__name__}.forward returned no hidden_states")
    return hidden[-1]
