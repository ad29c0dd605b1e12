"""``impl="fused_chunked"``: the lm-head projection fused into the loss, chunked over positions.

The full ``[N, V]`` logits never exist: rows are processed ``chunk`` at a time (only rows that
count, so masked and ignored positions cost nothing) and each chunk's logits buffer is reused
in place for its gradient. Two schedules, same numbers:

* **gradient in forward** (:class:`FusedGradInForward`, the default for ``reduction`` "mean" and
  "sum"): per chunk, ``x = h_c W^T``; stats; ``g`` written over ``x``; ``grad_h_c = g W`` and
  ``grad_W += g^T h_c`` right away. Three GEMMs per chunk (``6 N d V`` FLOPs in all); backward
  only scales the stored gradients by the incoming scalar.
* **recompute** (:class:`FusedRecompute`, used for ``reduction="none"`` or on request): forward
  keeps per-row statistics only (``O(N k)``); backward projects each chunk again. Four GEMMs
  per chunk (``8 N d V``), but no gradient is held between forward and backward.

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
from typing import Any

import torch

from .chunk_ops import ChunkTargets, grad_pass, stats_pass
from .forward_chunked import cat_coefs, slice_coefs, targets_of
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

Rows = slice | torch.Tensor


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


def take_rows(t: torch.Tensor, rows: Rows) -> torch.Tensor:
    """The rows ``rows`` (a slice or an index tensor) of ``t``."""
    return t[rows] if isinstance(rows, slice) else t.index_select(0, rows)


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


def scaled_once(ctx: Any, grad_out: torch.Tensor, what: str) -> tuple[torch.Tensor | None, ...]:
    """The gradients stored in ``ctx.grads`` during forward, times ``grad_out``, released (a
    second backward is an error: the buffers are handed to autograd)."""
    if ctx.grads is None:
        raise RuntimeError(f"{what} supports one backward only")
    out = tuple(None if g is None else g.mul_(grad_out.to(g.dtype)) for g in ctx.grads)
    ctx.grads = None
    return out


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


def _chunk_pass(
    spec: LossSpec,
    prep: Prepared,
    tgt: ChunkTargets,
    rows: Rows,
    triton: bool,
    shard: VocabShard | None,
) -> tuple[torch.Tensor, torch.Tensor, RowCoefs, ChunkTargets | LocalTargets]:
    """Project one chunk and take its statistics; ``x`` keeps ``-inf`` at the target columns."""
    h_c = take_rows(prep.hidden, rows)
    x = project(h_c, prep.weight, prep.bias)
    tgt_c = tgt.select(rows)
    if shard is not None:
        coefs, loc = stats_pass_sharded(spec, x, tgt_c, prep.work_dtype, shard, triton=triton)
        return h_c, x, coefs, loc
    coefs = stats_pass(spec, x, tgt_c, prep.work_dtype, inplace=True, triton=triton)
    return h_c, x, coefs, tgt_c


def _write_grad(
    spec: LossSpec,
    x: torch.Tensor,
    coefs: RowCoefs,
    tgt: ChunkTargets | LocalTargets,
    triton: bool,
) -> None:
    """Overwrite ``x`` (blanked at the target columns) with d(loss)/d(x)."""
    if isinstance(tgt, LocalTargets):
        grad_pass_sharded(spec, x, coefs, tgt, triton=triton)
    else:
        grad_pass(spec, x, x, coefs, tgt, triton=triton)


class FusedGradInForward(torch.autograd.Function):
    """Scalar ``scale * sum(row losses)``; all gradients are computed during forward."""

    @staticmethod
    @no_autocast
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        spec: LossSpec,
        prep: Prepared,
        chunk: int,
        scale: float,
        need: tuple[bool, bool, bool],
        acc_dtype: torch.dtype | None = None,
        shard: VocabShard | None = None,
        triton: bool = False,
    ) -> torch.Tensor:
        tgt = targets_of(prep)
        grads = ChunkGrads(prep.hidden, prep.weight, prep.bias, prep.all_valid, need, acc_dtype)
        total = torch.zeros((), dtype=prep.work_dtype, device=hidden.device)
        for rows in row_blocks(prep.valid, prep.all_valid, chunk):
            h_c, x, coefs, tgt_c = _chunk_pass(spec, prep, tgt, rows, triton, shard)
            total += coefs.loss.sum()
            if any(need):
                _write_grad(spec, x, coefs.scaled_(scale), tgt_c, triton)
            del coefs  # its [C, k] terms must not sit beside the chunk during the GEMMs
            if any(need):
                grads.add(rows, x, h_c, prep.weight)
            del x, h_c, tgt_c
        ctx.grads = grads.finish(shard)
        return total * scale

    @staticmethod
    @no_autocast
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out = scaled_once(ctx, grad_out, "fused_chunked (gradient in forward)")
        return (*out, None, None, None, None, None, None, None, None)


class FusedRecompute(torch.autograd.Function):
    """Per-row losses ``[N]``; backward recomputes each chunk's projection."""

    @staticmethod
    @no_autocast
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        spec: LossSpec,
        prep: Prepared,
        chunk: int,
        acc_dtype: torch.dtype | None = None,
        shard: VocabShard | None = None,
        triton: bool = False,
    ) -> torch.Tensor:
        tgt = targets_of(prep)
        blocks = row_blocks(prep.valid, prep.all_valid, chunk)
        parts = []
        for rows in blocks:
            _, x, coefs, _ = _chunk_pass(spec, prep, tgt, rows, triton, shard)
            parts.append(coefs)
            del x
        n = prep.valid.numel()
        out = torch.zeros(n, dtype=prep.work_dtype, device=hidden.device)
        all_coefs = cat_coefs(parts) if parts else None
        if all_coefs is not None:
            if prep.all_valid:
                out = all_coefs.loss
            else:  # index tensors (row_blocks gives slices only when every row counts)
                index = [r for r in blocks if isinstance(r, torch.Tensor)]
                out.index_copy_(0, torch.cat(index), all_coefs.loss)
        ctx.prep, ctx.spec, ctx.blocks, ctx.coefs = prep, spec, blocks, all_coefs
        ctx.triton = triton
        ctx.acc_dtype, ctx.shard = acc_dtype, shard
        ctx.need = needs_grad(hidden, weight, bias)
        return out

    @staticmethod
    @no_autocast
    def backward(ctx: Any, grad_rows: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        prep, spec = ctx.prep, ctx.spec
        shard = ctx.shard
        grads = ChunkGrads(
            prep.hidden, prep.weight, prep.bias, prep.all_valid, ctx.need, ctx.acc_dtype
        )
        tgt = targets_of(prep)
        start = 0
        for rows in ctx.blocks:
            h_c = take_rows(prep.hidden, rows)
            x = project(h_c, prep.weight, prep.bias)
            tgt_c = tgt.select(rows)
            c = slice_coefs(ctx.coefs, slice(start, start + x.shape[0]))
            start += x.shape[0]
            w = take_rows(grad_rows, rows).to(c.c1.dtype)
            if shard is not None:
                loc = locate(tgt_c, shard, spec.ce_weight > 0.0)
                blank_owned(x, loc)
                grad_pass_sharded(spec, x, c.scaled(w), loc, triton=ctx.triton)
            else:
                grad_pass(spec, x, x, c.scaled(w), tgt_c, triton=ctx.triton)
            grads.add(rows, x, h_c, prep.weight)
            del x
        return (*grads.finish(shard), None, None, None, None, None, None)
