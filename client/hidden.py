"""Exact distillation from a hidden cache (FORMAT.md 4.10): the teacher head a cache stores,
as the keyword arguments of :func:`logitcache.client.loss.exact_distill_loss`.

A :class:`~logitcache.client.CacheDataset` over a ``targets="hidden"`` cache yields units with
``hidden [.., T, d]`` (bfloat16: the teacher's final hidden states) in place of the top-k
arrays; :func:`load_head` gives the rest of the teacher (``device="cuda"`` on a GPU, with the
batch moved there too)::

    head = load_head(ds.source)
    for batch in loader:
        h = packed_hidden_states(model, batch)
        loss = exact_distill_loss(h, student.lm_head.weight, batch["hidden"],
                                  mask=batch["loss_mask"], **head)
        loss.backward()

(executed by ``tests/client/test_hidden_loader.py``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from .errors import SourceError

if TYPE_CHECKING:
    from logitcache.cache_format import CacheReader

    from .sources import CacheSource


def _reader(source: CacheSource | str | os.PathLike[str]) -> CacheReader:
    from logitcache.cache_format import CacheReader

    from .sources import LocalSource

    if isinstance(source, str | os.PathLike):
        return CacheReader(os.fspath(source))
    if isinstance(source, LocalSource):  # an HttpSource too
        return source.reader
    raise SourceError(f"load_head reads a store path, URL, LocalSource or HttpSource: {source!r}")


def load_head(
    source: CacheSource | str | os.PathLike[str],
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = torch.bfloat16,
) -> dict[str, Any]:
    """The teacher head of the hidden cache ``source`` (a store path or URL, a ``LocalSource``
    or an ``HttpSource``), checked against the manifest's digest: ``{"teacher_weight" [V, d],
    "teacher_bias" [V] or None, "teacher_logit_scale", "teacher_softcap"}`` on ``device``. The
    weight is ``dtype``: by default bfloat16, the dtype of the rows ``CacheDataset`` gives
    (the loss takes a teacher weight and bias of its hidden rows' dtype); ``None`` keeps the
    stored one (bfloat16 or float32). The bias takes the weight's dtype. A top-k or sampled
    cache raises :class:`~logitcache.cache_format.TargetKindError`."""
    from logitcache.cache_format.hidden import hidden_tensor

    head = _reader(source).head()
    weight = hidden_tensor(head.weight).to(device=device, dtype=dtype)
    bias = None if head.bias is None else torch.from_numpy(head.bias).to(device, weight.dtype)
    return {
        "teacher_weight": weight,
        "teacher_bias": bias,
        "teacher_logit_scale": float(head.logit_scale),
        "teacher_softcap": head.softcap,
    }
