"""Hidden-state capture (FORMAT.md 4.10): what an engine gives for ``targets="hidden"`` — the
teacher's final-norm output per row (the input of its head) and its head, stored once per cache.

Both backends capture them: transformers in its forward (:class:`~.hf.TransformersEngine`),
vLLM through its worker hook and the checkpoint's head tensors (:mod:`.vllm_hidden`). A
backend without capture says so with a typed :class:`~.protocol.EngineInputError`
(:data:`NOT_CAPTURED`, :class:`~.base.BaseEngine`'s default).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from logitcache.cache_format import TeacherHead

NOT_CAPTURED = (
    "the {backend} backend does not capture hidden states yet (targets='hidden'): "
    "serve the teacher with the transformers or vLLM backend for hidden-state caches"
)

#: Model-config attributes of the head's logit soft-capping and multiplier (Gemma 2, Cohere).
SOFTCAP_ATTRS = ("final_logit_softcapping",)
SCALE_ATTRS = ("logit_scale",)


def _config_value(config: Any, names: tuple[str, ...]) -> float | None:
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return float(v)
    return None


def head_of(weight: Any, bias: Any, config: Any) -> TeacherHead:
    """The :class:`TeacherHead` of a torch output projection and the config's soft-capping /
    multiplier (bfloat16 kept as bits, other dtypes widened to float32)."""
    import torch

    w = weight.detach().to("cpu")
    if w.dtype == torch.bfloat16:
        stored, dtype = w.contiguous().view(torch.int16).numpy().view(np.uint16), "bfloat16"
    else:
        stored, dtype = w.float().numpy(), "float32"
    b = None if bias is None else bias.detach().to("cpu").float().numpy()
    scale = _config_value(config, SCALE_ATTRS)
    return TeacherHead(
        stored,
        b,
        logit_scale=1.0 if scale is None else scale,
        softcap=_config_value(config, SOFTCAP_ATTRS),
        dtype=dtype,  # type: ignore[arg-type]
    )
