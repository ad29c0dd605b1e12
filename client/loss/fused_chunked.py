"""The lm-head projection fused into the loss, chunked over positions: the one chunk loop of
the top-k loss (``impl="fused_chunked"``, :class:`TopKChunks`) and the exact loss.

The full ``[N, V]`` logits never exist: rows are processed ``chunk`` at a time (only rows that
count, so masked and ignored positions cost nothing) and each chunk's logits buffer is reused
in place for its gradient. Two schedules, same numbers:

* **gradient in forward** (:class:`GradInForward`, the default for ``reduction`` "mean" and
  "sum"): per chunk, ``x = h_c W^T``; the objective's loss and ``g = dloss/dx`` (written
  over ``x`` by the top-k loss); ``grad_h_c = g W`` and ``grad_W += g^T h_c`` right away.
  Three student GEMMs per chunk (``6 N d V`` FLOPs in all); backward only scales the stored
  gradients by the incoming scalar.
* **recompute** (:class:`Recompute`, used for ``reduction="none"`` or on request): forward
  keeps per-row statistics only (``O(N k)``); backward projects each chunk again. Four student
  GEMMs per chunk (``8 N d V``), but no gradient is held between forward and backward.

Memory beyond inputs and gradients: one ``[chunk, V]`` buffer in the logits dtype (plus, on the
torch path, float32 temporaries of that size), an fp32 ``grad_W`` accumulator when ``W`` is
bf16/fp16 and ``acc_dtype`` is float32 (with ``acc_dtype`` = the weight's dtype the chunks are
added straight into the buffer that autograd hands to ``weight.grad``: no extra copy), and
``O(N k)`` coefficients.

With a :class:`~.vocab_parallel.VocabShard` (``shard``), ``weight``/``bias`` are this rank's
vocabulary rows and each chunk's statistics are exchanged once (see :mod:`.vocab_parallel`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import torch

from .chunk_ops import ChunkTargets, Rows, grad_pass, stats_pass, take_rows, targets_of
from .row_math import RowCoefs
from .spec import LossSpec
from .validation import Prepared
from .vocab_parallel import (
    LocalTargets,
    VocabShard,
    blank_owned,
    grad_pass_sharded,
    locate,
    reduce_grad_hidden,
    stats_pass_sharded,
)


def no_autocast(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` with autocast off: the loss computes in the dtype of ``hidden``/``weight``
    (autocast would turn the chunk GEMMs into bf16 while the gradient buffers stay fp32)."""

    @functools.wraps(fn)
    def wrapper(ctx: Any, *args: Any) -> Any:
        device = args[0].device.type if isinstance(args[0], torch.Tensor) else "cpu"
        with torch.autocast(device_type=device, enabled=False):
            return fn(ctx, *args)

    return wrapper


_ADDMM_OUT_DTYPE_OK: dict[str, bool] = {}


def row_blocks(valid: torch.Tensor, all_valid: bool, chunk: int) -> list[Rows]:
    """Chunks of the counted rows (``valid [N]``): slices when every row counts (``all_valid``),
    else index tensors."""
    n = valid.numel()
    if all_valid:
        return [slice(s, min(s + chunk, n)) for s in range(0, n, chunk)]
    idx = valid.nonzero().squeeze(1)
    return list(idx.split(chunk))


def project(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Logits ``h W^T (+ b)``."""
    return torch.mm(h, w.t()) if b is None else torch.addmm(b, h, w.t())


def _addmm_acc(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` in float32 and ``a, b`` possibly bf16/fp16.

    On CUDA this uses the GEMM's own fp32 epilogue (``addmm(out_dtype=float32)``) when the
    installed torch has it; otherwise the product is rounded once to ``a.dtype`` and added.
    """
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    key = f"{a.device.type}:{a.dtype}"
    if a.is_cuda and _ADDMM_OUT_DTYPE_OK.get(key, True):
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            _ADDMM_OUT_DTYPE_OK[key] = True
            return
        except (RuntimeError, TypeError):
            _ADDMM_OUT_DTYPE_OK[key] = False
    acc.add_(a @ b)


def addmm_fp32_epilogue_used(device: torch.device, dtype: torch.dtype) -> bool | None:
    """Whether grad_W accumulation used the fp32-epilogue GEMM (None: not tried yet)."""
    return _ADDMM_OUT_DTYPE_OK.get(f"{device.type}:{dtype}")


def needs_grad(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grad_on: bool = True
) -> tuple[bool, bool, bool]:
    """Which of ``hidden``, ``weight``, ``bias`` get a gradient (``grad_on``: grad mode)."""
    return (
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
    )


class ChunkGrads:
    """Gradient buffers of ``hidden [N, d]``, ``weight [V, d]``, ``bias [V]``, filled chunk by
    chunk (``all_valid``: every row gets a gradient written, so ``grad_h`` needs no zeroing)."""

    def __init__(
        self,
        h: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None,
        all_valid: bool,
        need: tuple[bool, bool, bool],
        acc_dtype: torch.dtype | None,
    ) -> None:
        self.w_dtype = w.dtype
        self.b_dtype = None if b is None else b.dtype
        self.need_h, self.need_w, self.need_b = need
        acc = torch.float32 if w.dtype in (torch.bfloat16, torch.float16) else w.dtype
        if acc_dtype is not None:
            acc = acc_dtype
        self.h = None
        if self.need_h:
            self.h = torch.empty_like(h) if all_valid else torch.zeros_like(h)
        self.w = torch.zeros(w.shape, dtype=acc, device=w.device) if self.need_w else None
        self.b = None
        if self.need_b and b is not None:
            self.b = torch.zeros(b.shape, dtype=acc, device=b.device)

    def add(self, rows: Rows, g: torch.Tensor, h_c: torch.Tensor, w: torch.Tensor) -> None:
        if self.h is not None:
            if isinstance(rows, slice):
                torch.mm(g, w, out=self.h[rows])
            else:
                self.h.index_copy_(0, rows, g @ w)
        if self.w is not None:
            _addmm_acc(self.w, g.t(), h_c)
        if self.b is not None:
            self.b += g.sum(0, dtype=self.b.dtype)

    def finish(self, shard: VocabShard | None = None) -> tuple[torch.Tensor | None, ...]:
        reduce_grad_hidden(self.h, shard)
        w = None if self.w is None else self.w.to(self.w_dtype)  # no copy if same dtype
        b = None if self.b is None or self.b_dtype is None else self.b.to(self.b_dtype)
        self.w = self.b = None
        return self.h, w, b


class ChunkObjective(Protocol):
    """One loss computed chunk by chunk on the student logits ``x = h W^T (+ b)``: what the
    loops below need of the top-k (:class:`TopKChunks`) and the exact loss."""

    hidden: torch.Tensor  # [N, d]
    weight: torch.Tensor  # [V, d] (this rank's rows under a shard)
    bias: torch.Tensor | None
    valid: torch.Tensor  # [N] bool
    shard: VocabShard | None

    @property
    def all_valid(self) -> bool: ...

    @property
    def work_dtype(self) -> torch.dtype: ...

    def losses(self, rows: Rows) -> torch.Tensor:
        """Row losses ``[C]`` of one chunk (may keep what :meth:`grad` needs later)."""

    def loss_and_grad(
        self, rows: Rows, scale: float | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Row losses, the gradient of ``scale * sum(losses)`` w.r.t. the chunk logits in the
        weight's dtype (``None`` when ``scale`` is), and the chunk's hidden rows."""

    def grad(
        self, i: int, rows: Rows, row_weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For chunk ``i`` of a :meth:`losses` pass: the gradient of ``sum(row_weight *
        losses)`` w.r.t. the chunk logits (weight dtype) and the chunk's hidden rows."""


class GradInForward(torch.autograd.Function):
    """Scalar ``scale * sum(row losses)``; all gradients are computed during forward."""

    @staticmethod
    @no_autocast
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        obj: ChunkObjective,
        chunk: int,
        scale: float,
        need: tuple[bool, bool, bool],
        acc_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        grads = ChunkGrads(hidden, weight, bias, obj.all_valid, need, acc_dtype)
        total = torch.zeros((), dtype=obj.work_dtype, device=hidden.device)
        for rows in row_blocks(obj.valid, obj.all_valid, chunk):
            loss, g, h_c = obj.loss_and_grad(rows, scale if any(need) else None)
            total += loss.sum()
            if g is not None:
                grads.add(rows, g, h_c, weight)
            del g, h_c
        ctx.grads = grads.finish(obj.shard)
        return total * scale

    @staticmethod
    @no_autocast
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.grads is None:  # the buffers were handed to autograd
            raise RuntimeError("the chunked loss (gradient in forward) supports one backward only")
        out = tuple(None if g is None else g.mul_(grad_out.to(g.dtype)) for g in ctx.grads)
        ctx.grads = None
        return (*out, None, None, None, None, None)


class Recompute(torch.autograd.Function):
    """Per-row losses ``[N]`` (0 on rows that do not count); backward projects each chunk
    again."""

    @staticmethod
    @no_autocast
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        obj: ChunkObjective,
        chunk: int,
        acc_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        out = torch.zeros(obj.valid.numel(), dtype=obj.work_dtype, device=hidden.device)
        blocks = row_blocks(obj.valid, obj.all_valid, chunk)
        for rows in blocks:
            out[rows] = obj.losses(rows)
        ctx.obj, ctx.blocks, ctx.acc_dtype = obj, blocks, acc_dtype
        ctx.need = needs_grad(hidden, weight, bias)
        return out

    @staticmethod
    @no_autocast
    def backward(ctx: Any, grad_rows: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        obj: ChunkObjective = ctx.obj
        grads = ChunkGrads(obj.hidden, obj.weight, obj.bias, obj.all_valid, ctx.need, ctx.acc_dtype)
        for i, rows in enumerate(ctx.blocks):
            g, h_c = obj.grad(i, rows, take_rows(grad_rows, rows))
            grads.add(rows, g, h_c, obj.weight)
            del g, h_c
        return (*grads.finish(obj.shard), None, None, None)


def chunked_loss(
    obj: ChunkObjective, chunk: int, acc: torch.dtype | None, scale: float | None
) -> torch.Tensor:
    """``scale * sum(row losses)`` with the gradients computed in forward, or (``scale`` is
    ``None``) the per-row losses ``[N]`` with a recomputing backward."""
    if scale is None:
        return Recompute.apply(obj.hidden, obj.weight, obj.bias, obj, chunk, acc)
    need = needs_grad(obj.hidden, obj.weight, obj.bias, torch.is_grad_enabled())
    return GradInForward.apply(obj.hidden, obj.weight, obj.bias, obj, chunk, scale, need, acc)


class TopKChunks:
    """The top-k loss as a :class:`ChunkObjective`: per chunk, the stats pass (which leaves
    ``x`` at ``-inf`` on the target columns) and the gradient written over ``x``."""

    def __init__(
        self, spec: LossSpec, prep: Prepared, shard: VocabShard | None, triton: bool
    ) -> None:
        self.spec, self.prep, self.shard, self.triton = spec, prep, shard, triton
        self.hidden, self.weight, self.bias = prep.hidden, prep.weight, prep.bias
        self.valid = prep.valid
        self.tgt = targets_of(prep)
        self.saved: list[RowCoefs] = []  # per chunk of a losses() pass

    @property
    def all_valid(self) -> bool:
        return self.prep.all_valid

    @property
    def work_dtype(self) -> torch.dtype:
        return self.prep.work_dtype

    def _stats(
        self, rows: Rows
    ) -> tuple[torch.Tensor, torch.Tensor, RowCoefs, ChunkTargets | LocalTargets]:
        h_c = take_rows(self.hidden, rows)
        x = project(h_c, self.weight, self.bias)
        tgt_c = self.tgt.select(rows)
        work = self.prep.work_dtype
        if self.shard is not None:
            coefs, loc = stats_pass_sharded(
                self.spec, x, tgt_c, work, self.shard, triton=self.triton
            )
            return h_c, x, coefs, loc
        coefs = stats_pass(self.spec, x, tgt_c, work, inplace=True, triton=self.triton)
        return h_c, x, coefs, tgt_c

    def _write_grad(
        self, x: torch.Tensor, coefs: RowCoefs, tgt: ChunkTargets | LocalTargets
    ) -> None:
        """Overwrite ``x`` (blanked at the target columns) with d(loss)/d(x)."""
        if isinstance(tgt, LocalTargets):
            grad_pass_sharded(self.spec, x, coefs, tgt, triton=self.triton)
        else:
            grad_pass(self.spec, x, x, coefs, tgt, triton=self.triton)

    def losses(self, rows: Rows) -> torch.Tensor:
        coefs = self._stats(rows)[2]
        self.saved.append(coefs)
        return coefs.loss

    def loss_and_grad(
        self, rows: Rows, scale: float | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        h_c, x, coefs, tgt_c = self._stats(rows)
        if scale is None:
            return coefs.loss, None, h_c
        self._write_grad(x, coefs.scaled_(scale), tgt_c)  # scales the gradient terms only
        return coefs.loss, x, h_c

    def grad(
        self, i: int, rows: Rows, row_weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h_c = take_rows(self.hidden, rows)
        x = project(h_c, self.weight, self.bias)
        tgt_c = self.tgt.select(rows)
        c = self.saved[i]
        coefs = c.scaled(row_weight.to(c.c1.dtype))
        if self.shard is not None:
            loc = locate(tgt_c, self.shard, self.spec.ce_weight > 0.0)
            blank_owned(x, loc)
            self._write_grad(x, coefs, loc)
        else:
            self._write_grad(x, coefs, tgt_c)
        return x, h_c
