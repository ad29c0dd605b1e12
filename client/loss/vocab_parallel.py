r"""Vocab-parallel loss: the lm-head weight split along the vocabulary over a process group.

Layout (Megatron ``VocabParallelEmbedding`` / ``ColumnParallelLinear`` on the lm-head, torch
``ColwiseParallel`` = ``Shard(0)`` of ``W [V, d]``): rank ``r`` of the group holds the
contiguous rows ``[start_r, start_r + V_r)`` of ``W`` (and of the bias), in rank order; even
(Megatron, padded vocab) and uneven (``torch.chunk``: last rank shorter) splits both work.
Every rank passes the *same* hidden rows and teacher targets (global ids) and gets the same
loss; each rank's ``grad_W`` / ``grad_b`` cover its own shard only, and ``grad_h`` is the
sum over ranks (all-reduced once per call, unless ``reduce_grad_hidden=False``: then each rank
returns its partial ``g_r W_r``, for models whose input already goes through Megatron's
``copy_to_tensor_model_parallel_region``).

Per chunk of rows, each rank projects its shard ``x_r = h_c W_r^T``, gathers the target logits
it owns (0 elsewhere), blanks them to ``-inf`` and takes the row log-sum-exp of the rest. One
collective per chunk, an all-gather of the packed per-row statistics ``[C, k + 3]`` (gathered
target logits, label logit, the two log-sum-exps), gives every rank the single-device
statistics exactly: target logits are a sum where only the owner is non-zero, and
``lse = logsumexp_r lse_r`` (a max and a sum of exponentials, done on the gathered values).
From there :func:`~.row_math.row_coefs` runs unchanged, identically on every rank, and each
rank writes the logits gradient of its own columns. With a group of one rank this is the
single-device computation plus a no-op collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .chunk_ops import ChunkTargets, blanked_lse, dense_row_grad
from .row_math import RowCoefs, row_coefs
from .spec import LossInputError, LossSpec, given

#: ``all_gather_single`` (torch >= 2.13; ``all_gather_into_tensor`` is deprecated there).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class VocabParallel:
    """How the lm-head is split (pass as ``topk_distill_loss(..., vocab_parallel=...)``).

    ``group``: the tensor-parallel process group (``None``: the default group).
    ``vocab_start`` / ``vocab_size``: this rank's first row and the full vocabulary; ``None``
    derives both from every rank's local row count (one small all-gather per call), which is
    right for any contiguous rank-ordered split. ``reduce_grad_hidden``: all-reduce ``grad_h``
    over the group (see the module docstring).
    """

    group: Any = None
    vocab_start: int | None = None
    vocab_size: int | None = None
    reduce_grad_hidden: bool = True


@dataclass(frozen=True)
class VocabShard:
    """The resolved shard of this rank: rows ``[start, start + size)`` of a ``vocab`` table."""

    start: int
    size: int
    vocab: int
    group: Any
    world: int
    reduce_grad_hidden: bool = True


def resolve_shard(spec: VocabParallel, local_rows: int, device: torch.device) -> VocabShard:
    """Fill in the group size and offsets of ``spec`` for a shard of ``local_rows`` rows."""
    if not dist.is_available() or not dist.is_initialized():
        raise LossInputError("vocab_parallel needs an initialised torch.distributed process group")
    group = spec.group
    world = dist.get_world_size(group)
    start, vocab = spec.vocab_start, spec.vocab_size
    if start is None or vocab is None:
        sizes = _all_sizes(local_rows, group, world, device)
        rank = dist.get_rank(group)
        start = sum(sizes[:rank]) if start is None else start
        vocab = sum(sizes) if vocab is None else vocab
    if not (0 <= start and start + local_rows <= vocab):
        raise LossInputError(
            f"vocab shard [{start}, {start + local_rows}) does not fit a vocabulary of {vocab}"
        )
    return VocabShard(start, local_rows, vocab, group, world, spec.reduce_grad_hidden)


def _all_sizes(local_rows: int, group: Any, world: int, device: torch.device) -> list[int]:
    mine = torch.tensor([local_rows], dtype=torch.int64, device=device)
    out = torch.empty(world, dtype=torch.int64, device=device)
    _all_gather(out, mine, group=group)
    return [int(v) for v in out.tolist()]


def from_dtensor(
    weight: torch.Tensor, bias: torch.Tensor | None, hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, VocabShard | None]:
    """Local tensors and the shard of a ``DTensor`` lm-head (``Shard(0)``: vocab-parallel;
    ``Replicate``: plain). Leaves plain tensors alone (shard ``None``).

    ``to_local`` is differentiable: the local gradients come back as DTensors with the same
    placements (``grad_h`` is all-reduced here, so a replicated ``hidden`` gets a replicated
    gradient).
    """
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # pragma: no cover - torch without DTensor
        return weight, bias, hidden, None
    if isinstance(hidden, DTensor):
        if any(not isinstance(p, Replicate) for p in hidden.placements):
            raise LossInputError("a DTensor hidden must be replicated over its mesh")
        hidden = hidden.to_local()
    if not isinstance(weight, DTensor):
        if isinstance(bias, DTensor):
            raise LossInputError("bias is a DTensor but weight is not")
        return weight, bias, hidden, None
    placements = tuple(weight.placements)
    if all(isinstance(p, Replicate) for p in placements):
        return weight.to_local(), _local(bias), hidden, None
    if weight.device_mesh.ndim != 1 or placements != (Shard(0),):
        raise LossInputError(
            "a DTensor lm-head must be Shard(0) (vocab-parallel) or Replicate on a 1-D mesh, "
            f"got {placements} on a {weight.device_mesh.ndim}-D mesh"
        )
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        weight.shape, weight.device_mesh, weight.placements
    )
    group = weight.device_mesh.get_group()
    shard = VocabShard(
        start=int(offset[0]),
        size=int(shape[0]),
        vocab=int(weight.shape[0]),
        group=group,
        world=dist.get_world_size(group),
    )
    return weight.to_local(), _local(bias), hidden, shard


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to_local() if hasattr(t, "to_local") else t


def check_same_rows(ids: torch.Tensor, valid: torch.Tensor, shard: VocabShard) -> None:
    """Raise :class:`LossInputError` on every rank unless all ranks passed the same targets.

    One all-gather of a 3-number fingerprint (row count, counted rows, the row-position-weighted
    sum of each row's ids): it catches a weight sharded over a *data*-parallel group (an FSDP
    ``fully_shard`` parameter used outside its module's forward), where ranks hold other rows.
    """
    n = ids.shape[0]
    row_sums = ids.sum(1)  # [N] int64: O(N) memory, no [N, k] temporary
    pos = torch.arange(1, n + 1, device=ids.device, dtype=torch.int64)
    mine = torch.stack(
        [
            torch.tensor(n, device=ids.device, dtype=torch.int64),
            valid.sum().to(torch.int64),
            (row_sums * pos).sum(),
        ]
    )
    out = torch.empty(shard.world * 3, dtype=torch.int64, device=ids.device)
    _all_gather(out, mine, group=shard.group)
    out = out.view(shard.world, 3)
    if not bool((out == out[0]).all()):
        raise LossInputError(
            "vocab-parallel ranks passed different rows/targets: every rank of the group must "
            "pass the same hidden rows and teacher targets (an FSDP-sharded lm-head weight must "
            "be used inside its module's forward, e.g. TopKDistillHead, not as a DTensor)"
        )


@dataclass
class LocalTargets:
    """The targets of one chunk seen from one shard."""

    idx: torch.Tensor  # [C, k] local column of each target id (0 where not owned)
    own: torch.Tensor  # [C, k] bool: the id is in this shard
    lab_idx: torch.Tensor | None  # [C, 1]
    lab_own: torch.Tensor | None  # [C]


def locate(tgt: ChunkTargets, shard: VocabShard, need_label: bool) -> LocalTargets:
    rel = tgt.ids - shard.start
    own = (rel >= 0) & (rel < shard.size)
    idx = torch.where(own, rel, torch.zeros_like(rel))
    lab_idx = lab_own = None
    if need_label and tgt.labels is not None:
        lr = tgt.labels - shard.start
        lab_own = (lr >= 0) & (lr < shard.size)
        lab_idx = torch.where(lab_own, lr, torch.zeros_like(lr))[:, None]
    return LocalTargets(idx, own, lab_idx, lab_own)


def blank_owned(x: torch.Tensor, loc: LocalTargets) -> None:
    """Set ``x`` to ``-inf`` at the owned target columns; others untouched (order-free)."""
    inf = torch.tensor(float("inf"), dtype=x.dtype, device=x.device)
    src = torch.where(loc.own, -inf, inf)
    x.scatter_reduce_(1, loc.idx, src, reduce="amin", include_self=True)


def stats_pass_sharded(
    spec: LossSpec,
    x: torch.Tensor,
    tgt: ChunkTargets,
    work_dtype: torch.dtype,
    shard: VocabShard,
    *,
    triton: bool,
) -> tuple[RowCoefs, LocalTargets]:
    """Row coefficients (identical on every rank) from this rank's logits chunk ``x [C, V_r]``.

    ``x`` is left with ``-inf`` at the owned target columns.
    """
    need_ce = spec.ce_weight > 0.0
    loc = locate(tgt, shard, need_ce)
    zero = torch.zeros((), dtype=work_dtype, device=x.device)
    x_s = torch.where(loc.own, x.gather(1, loc.idx).to(work_dtype), zero)
    cols = [x_s]
    if need_ce:
        x_lab = x.gather(1, given(loc.lab_idx, "lab_idx")).squeeze(1).to(work_dtype)
        cols.append(torch.where(given(loc.lab_own, "lab_own"), x_lab, zero)[:, None])
    blank_owned(x, loc)
    lse_out, lse1_out = blanked_lse(spec, x, work_dtype, triton=triton)
    cols.append(lse_out[:, None])
    if lse1_out is not None:
        cols.append(lse1_out[:, None])
    packed = torch.cat(cols, dim=1)
    allp = exchange(packed, shard)  # [world, C, width]
    k = x_s.shape[1]
    x_s = allp[:, :, :k].sum(0)
    at = k
    x_label = None
    if need_ce:
        x_label = allp[:, :, at].sum(0)
        at += 1
    lse_out = torch.logsumexp(allp[:, :, at], dim=0)
    lse1_out = torch.logsumexp(allp[:, :, at + 1], dim=0) if lse1_out is not None else None
    coefs = row_coefs(spec, x_s, lse_out, tgt.logprobs, tgt.tail, x_label, lse1_out, tgt.has_label)
    return coefs, loc


def exchange(packed: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """All-gather ``packed [C, w]`` over the group: ``[world, C, w]`` in rank order."""
    packed = packed.contiguous()
    rows, width = packed.shape
    out = torch.empty((shard.world * rows, width), dtype=packed.dtype, device=packed.device)
    _all_gather(out, packed, group=shard.group)  # concatenated along dim 0
    return out.view(shard.world, rows, width)


def grad_pass_sharded(
    spec: LossSpec,
    x: torch.Tensor,
    coefs: RowCoefs,
    loc: LocalTargets,
    *,
    triton: bool,
) -> torch.Tensor:
    """Write d(loss)/d(x) of this rank's columns over ``x`` (which must hold ``-inf`` at the
    owned target columns, see :func:`blank_owned`) and return it."""
    dense_row_grad(spec, x, x, coefs, triton=triton)
    # owned target columns hold exactly 0 now (exp(-inf)); adding 0 elsewhere is exact
    zero = torch.zeros((), dtype=coefs.sparse.dtype, device=x.device)
    x.scatter_add_(1, loc.idx, torch.where(loc.own, coefs.sparse, zero).to(x.dtype))
    if coefs.label_add is not None:
        add = torch.where(given(loc.lab_own, "lab_own"), coefs.label_add, zero)[:, None]
        x.scatter_add_(1, given(loc.lab_idx, "lab_idx"), add.to(x.dtype))
    return x


def reduce_grad_hidden(grad_h: torch.Tensor | None, shard: VocabShard | None) -> None:
    """Sum the partial ``grad_h`` over the group, in place (once per call)."""
    if grad_h is None or shard is None or not shard.reduce_grad_hidden:
        return
    dist.all_reduce(grad_h, group=shard.group)
