r"""``exact_distill_loss``: distillation against the teacher's full distribution, rebuilt from
its final hidden states and its output head, chunk by chunk.

Per chunk of counted rows: teacher logits ``y = h_T W_T^T (+ b_T)`` (no gradient; times
``teacher_logit_scale``, then ``c tanh(y / c)`` with ``c = teacher_softcap``), student logits
``x = h_S W_S^T (+ b_S)``, both divided by the temperature, both log-softmaxed over the full
vocabulary; the divergence and its logits gradient are computed in the working dtype (float32,
float64 for float64 inputs) and pushed through the student head right away. Neither logits
table ever exists for more than one chunk of rows: the largest intermediates are a few
``[chunk, V]`` buffers (see :data:`CHUNK_BUFFERS`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .api import autocast_inputs
from .chunk_ops import Rows, take_rows, use_triton
from .dispatch import check_options, plan_chunks
from .exact_kernels import DEFAULT_CONFIG, ExactKernelConfig
from .fused_chunked import chunked_loss, project
from .spec import LossInputError, LossSpec, check_choice
from .validation import check_head, counted_rows
from .vocab_parallel import VocabParallel, VocabShard, exchange, resolve_shard

#: The objectives of the exact loss.
EXACT_LOSS_KINDS: tuple[str, ...] = ("forward_kl", "reverse_kl", "jsd")
#: Float32 ``[chunk, V]`` buffers alive at once (JSD; the KLs need fewer). The default chunk is
#: the top-k loss's automatic chunk for a vocabulary this many times larger.
CHUNK_BUFFERS = 6
#: ``[chunk, V]`` buffers in the logits dtype that the Triton passes hold (teacher and student
#: logits; the gradient is written over the student's): the default chunk puts both in the top-k
#: loss's one-chunk budget (2048 rows at V=128256 in bf16).
TRITON_CHUNK_BUFFERS = 2

_STUDENT = ("student_hidden", "student_weight", "student_bias")
_TEACHER = ("teacher_hidden", "teacher_weight", "teacher_bias")


@dataclass(frozen=True)
class TeacherHead:
    """The teacher's output head as the architecture applies it: ``W_T [V, d_T]``, ``b_T [V]``
    and the logit transform ``c tanh(s y / c)`` (``s`` = ``logit_scale``, ``c`` = ``softcap``,
    no tanh when ``None``)."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    logit_scale: float = 1.0
    softcap: float | None = None

    def logits(self, hidden: torch.Tensor, work: torch.dtype) -> torch.Tensor:
        """Teacher logits of ``hidden [C, d_T]`` in the working dtype (a new buffer)."""
        y = project(hidden, self.weight, self.bias).to(work)
        if self.logit_scale != 1.0:
            y.mul_(self.logit_scale)
        if self.softcap is not None:
            y.div_(self.softcap).tanh_().mul_(self.softcap)
        return y


@dataclass
class ExactInputs:
    """Checked, flattened inputs: ``N`` rows, student ``[N, d_S]``, teacher ``[N, d_T]``."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    teacher_hidden: torch.Tensor
    teacher: TeacherHead
    spec: LossSpec
    valid: torch.Tensor  # [N] bool
    n_valid: int
    lead_shape: tuple[int, ...]
    labels: torch.Tensor | None = None  # [N] int64 (0 on rows that do not count)
    shard: VocabShard | None = None
    triton: bool = False
    kernel_config: ExactKernelConfig = DEFAULT_CONFIG

    @property
    def work_dtype(self) -> torch.dtype:
        return torch.float64 if self.hidden.dtype == torch.float64 else torch.float32

    @property
    def all_valid(self) -> bool:
        return self.n_valid == self.valid.numel()

    # the :class:`~.fused_chunked.ChunkObjective` methods
    def losses(self, rows: Rows) -> torch.Tensor:
        return chunk_terms(self, rows, None)[0]

    def loss_and_grad(
        self, rows: Rows, scale: float | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        loss, g = chunk_terms(self, rows, scale)
        return loss, None if g is None else g.to(self.weight.dtype), take_rows(self.hidden, rows)

    def grad(
        self, i: int, rows: Rows, row_weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        g = chunk_terms(self, rows, row_weight.to(self.work_dtype)[:, None])[1]
        if g is None:
            raise RuntimeError("chunk_terms returned no gradient")
        return g.to(self.weight.dtype), take_rows(self.hidden, rows)


def exact_distill_loss(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    teacher_logit_scale: float = 1.0,
    teacher_softcap: float | None = None,
    labels: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    ignore_index: int = -100,
    loss: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    ce_weight: float = 0.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
    grad_weight_dtype: str = "auto",
    kernels: str = "auto",
    vocab_parallel: VocabParallel | None = None,
    kernel_config: ExactKernelConfig | None = None,
) -> torch.Tensor:
    r"""Exact distillation loss of a student lm-head against the teacher's full distribution.

    Shapes: ``student_hidden [..., d_S]``, ``student_weight [V, d_S]``, ``student_bias [V]``,
    ``teacher_hidden [..., d_T]`` (the teacher's final hidden states after its final norm, same
    leading shape), ``teacher_weight [V, d_T]``, ``teacher_bias [V]``, ``labels``/``mask``
    ``[...]``. A row counts when ``mask`` is true (default all) and ``labels != ignore_index``
    (the labels of counted rows must be in ``[0, V)``); other rows give 0 and no gradient.
    Gradients flow to ``student_hidden``, ``student_weight`` and ``student_bias`` only, never
    to the teacher's tensors. The teacher may have its own dtype and width.

    Per row: teacher logits ``y = c tanh(s (W_T h_T + b_T) / c)`` (``s`` =
    ``teacher_logit_scale``; ``c`` = ``teacher_softcap``, no tanh when ``None``), student
    logits ``x = W_S h_S + b_S``; at temperature ``T``: ``p = softmax(y / T)``, ``q =
    softmax(x / T)`` over all ``V`` ids. ``loss=``

    * ``"forward_kl"``: ``KD = sum_v p_v log(p_v / q_v)``; ``dKD/dz = q - p``.
    * ``"reverse_kl"``: ``KD = sum_v q_v log(q_v / p_v)``;
      ``dKD/dz_v = q_v (log(q_v / p_v) - KD)``.
    * ``"jsd"``: generalised Jensen-Shannon with ``m = beta p + (1 - beta) q``:
      ``KD = beta sum p log(p / m) + (1 - beta) sum q log(q / m)``, ``0 < beta < 1`` (the
      TRL/Liger convention, as in ``topk_distill_loss``); ``dKD/dz_v = q_v (a_v - sum q a)``
      with ``a = (1 - beta) log(q / m)``.

    Row loss ``L = T**2 * KD + ce_weight * CE`` with the hard-label cross-entropy ``CE =
    -log softmax(x)_label`` on the un-tempered student logits (``ce_weight > 0`` needs
    ``labels``; one more ``[chunk, V]`` buffer). ``reduction``: ``"mean"`` (sum over counted
    rows / their number, 0 if none), ``"sum"``, or ``"none"`` (shape ``[...]``, 0 on rows
    that do not count).

    Computation: chunks of ``chunk_size`` counted rows. With ``"mean"``/``"sum"`` the
    gradients are computed in the forward pass (teacher GEMM + 3 student GEMMs per chunk);
    with ``"none"`` the backward pass projects each chunk again. ``kernels`` and
    ``grad_weight_dtype`` as in ``topk_distill_loss``. The Triton kernels hold two ``[chunk,
    V]`` buffers in the GEMMs' dtype (:data:`TRITON_CHUNK_BUFFERS`), the torch passes up to
    :data:`CHUNK_BUFFERS` float32 ones; the default chunk fits them in the top-k loss's budget.
    The kernels do not cover ``ce_weight > 0`` or ``vocab_parallel`` (those run the torch
    passes; ``"triton"`` with them is an error). ``kernel_config``: the kernels' launch geometry
    (:class:`~.exact_kernels.ExactKernelConfig`; ``None``: :data:`~.exact_kernels.DEFAULT_CONFIG`),
    which changes the speed, not the numbers beyond float32 summation order.

    ``vocab_parallel``: a :class:`VocabParallel` when ``student_weight``/``student_bias`` *and*
    ``teacher_weight``/``teacher_bias`` are this rank's rows of heads split along the same
    vocabulary over a process group (see :mod:`.vocab_parallel`). Every rank passes the same
    hidden rows and gets the same loss; per chunk, one all-gather of the two row log-sum-exps
    and one of the row sums; ``grad_h`` is all-reduced (unless ``reduce_grad_hidden=False``).
    Under ``torch.autocast`` with float32 student tensors, they are cast to the autocast dtype
    first (as in ``topk_distill_loss``). Raises :class:`LossInputError` for any bad argument.
    """
    check_choice("loss", loss, EXACT_LOSS_KINDS)
    spec = LossSpec(loss=loss, beta=beta, temperature=temperature, ce_weight=ce_weight)
    shard = None
    if vocab_parallel is not None:
        if not isinstance(vocab_parallel, VocabParallel):
            raise LossInputError(f"vocab_parallel must be a VocabParallel, got {vocab_parallel!r}")
        if not isinstance(student_weight, torch.Tensor) or student_weight.dim() != 2:
            raise LossInputError("student_weight must be a [V, d] tensor")
        shard = resolve_shard(vocab_parallel, student_weight.shape[0], student_weight.device)
    inp = prepare_exact(
        student_hidden,
        student_weight,
        student_bias,
        teacher_hidden,
        TeacherHead(teacher_weight, teacher_bias, teacher_logit_scale, teacher_softcap),
        labels,
        mask,
        ignore_index,
        spec,
        None if shard is None else shard.vocab,
    )
    inp.shard = shard
    triton = use_triton(kernels, inp.hidden.device)
    if triton and kernels == "triton" and (shard is not None or ce_weight > 0.0):
        raise LossInputError('kernels="triton" does not cover ce_weight > 0 or vocab_parallel')
    inp.triton = triton and shard is None and ce_weight == 0.0
    if kernel_config is not None:
        if not isinstance(kernel_config, ExactKernelConfig):
            raise LossInputError(
                f"kernel_config must be an ExactKernelConfig, got {kernel_config!r}"
            )
        inp.kernel_config = kernel_config
    check_options(reduction, chunk_size, grad_weight_dtype, kernels)
    buffers = TRITON_CHUNK_BUFFERS if inp.triton else CHUNK_BUFFERS
    chunk, acc = plan_chunks(
        chunk_size, max(inp.n_valid, 1), inp.weight, shard, grad_weight_dtype, inp.n_valid, buffers
    )
    if reduction == "none":
        return chunked_loss(inp, chunk, acc, None).reshape(inp.lead_shape)
    return chunked_loss(inp, chunk, acc, 1.0 if reduction == "sum" else 1.0 / max(inp.n_valid, 1))


def prepare_exact(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    teacher_hidden: torch.Tensor,
    teacher: TeacherHead,
    labels: torch.Tensor | None,
    mask: torch.Tensor | None,
    ignore_index: int,
    spec: LossSpec,
    vocab_global: int | None = None,
) -> ExactInputs:
    """Check every argument and flatten the rows; raise :class:`LossInputError` on a problem."""
    if spec.ce_weight > 0.0 and labels is None:
        raise LossInputError("ce_weight > 0 needs labels")
    check_head(hidden, weight, bias, _STUDENT)
    check_head(teacher_hidden, teacher.weight, teacher.bias, _TEACHER)
    lead = tuple(hidden.shape[:-1])
    if tuple(teacher_hidden.shape[:-1]) != lead:
        raise LossInputError(
            f"teacher_hidden must have the leading shape {lead} of student_hidden, "
            f"got {tuple(teacher_hidden.shape)}"
        )
    if teacher.weight.shape[0] != weight.shape[0]:
        raise LossInputError(
            f"teacher_weight has V={teacher.weight.shape[0]} rows, student_weight "
            f"V={weight.shape[0]}: the two heads must share one vocabulary"
        )
    if teacher_hidden.device != hidden.device:
        raise LossInputError(
            f"teacher_hidden is on {teacher_hidden.device}, student_hidden on {hidden.device}"
        )
    if not (math.isfinite(teacher.logit_scale) and teacher.logit_scale > 0.0):
        raise LossInputError(
            f"teacher_logit_scale must be finite and > 0, got {teacher.logit_scale}"
        )
    cap = teacher.softcap
    if cap is not None and not (math.isfinite(cap) and cap > 0.0):
        raise LossInputError(f"teacher_softcap must be None or finite and > 0, got {cap}")
    valid, flat = counted_rows(lead, labels, mask, ignore_index, hidden.device)
    vocab = weight.shape[0] if vocab_global is None else vocab_global
    if flat is not None:
        if bool((valid & ((flat < 0) | (flat >= vocab))).any()):
            raise LossInputError(f"labels out of range [0, {vocab})")
        flat = torch.where(valid, flat, torch.zeros_like(flat))
    hidden, weight, bias = autocast_inputs(hidden, weight, bias)
    n = valid.numel()
    return ExactInputs(
        hidden=hidden.reshape(n, hidden.shape[-1]),
        weight=weight,
        bias=bias,
        teacher_hidden=teacher_hidden.reshape(n, teacher_hidden.shape[-1]),
        teacher=teacher,
        spec=spec,
        valid=valid,
        n_valid=int(valid.sum().item()),
        lead_shape=lead,
        labels=flat,
    )


def _vdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise ``sum_v a_v b_v`` of two ``[C, V]`` tensors."""
    return torch.linalg.vecdot(a, b, dim=1)


def _total(t: torch.Tensor, shard: VocabShard | None) -> torch.Tensor:
    """Row sums ``t [C, ...]`` of this shard's columns summed over the group (rank order, so
    every rank gets the same bits)."""
    return t if shard is None else exchange(t.reshape(t.shape[0], -1), shard).sum(0).view_as(t)


def chunk_terms(
    inp: ExactInputs, rows: Rows, row_weight: float | torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Row losses ``T**2 KD [C]`` of one chunk and (unless ``row_weight`` is ``None``) the
    gradient of ``sum(row_weight * loss)`` with respect to the raw student logits ``[C, V]``
    (``row_weight``: one scalar, or ``[C, 1]``), in the working dtype (Triton passes: in the
    student logits' dtype, written over them)."""
    if inp.triton:
        return _chunk_terms_triton(inp, rows, row_weight)
    spec, work = inp.spec, inp.work_dtype
    t = spec.temperature
    lp = inp.teacher.logits(take_rows(inp.teacher_hidden, rows), work)
    lq = project(take_rows(inp.hidden, rows), inp.weight, inp.bias).to(work)
    raw = lq.clone() if spec.ce_weight > 0.0 else None  # the un-tempered logits, for CE
    if t != 1.0:
        lp.mul_(spec.inv_temperature)
        lq.mul_(spec.inv_temperature)
    lse = torch.stack([torch.logsumexp(lp, dim=1), torch.logsumexp(lq, dim=1)], dim=1)
    if inp.shard is not None:  # the full-vocabulary log-sum-exps from every shard's
        lse = torch.logsumexp(exchange(lse, inp.shard), dim=0)
    lp.sub_(lse[:, :1])  # log-softmax at temperature T, in place
    lq.sub_(lse[:, 1:])
    with_grad = row_weight is not None
    g: torch.Tensor | None = None
    if spec.loss == "forward_kl":
        p = lp.exp()
        kd = _total(_vdot(p, lp.sub_(lq)), inp.shard)
        if with_grad:
            g = lq.exp_().sub_(p)
    elif spec.loss == "reverse_kl":
        q = lq.exp()
        d = lq.sub_(lp)
        kd = _total(_vdot(q, d), inp.shard)
        if with_grad:
            g = d.sub_(kd[:, None]).mul_(q)
    else:
        b = spec.beta
        logm = torch.logaddexp(lp + math.log(b), lq + math.log1p(-b))
        p, q = lp.exp(), lq.exp()
        sums = torch.stack([_vdot(p, lp.sub_(logm)), _vdot(q, lq.sub_(logm))], dim=1)
        tp, tq = _total(sums, inp.shard).unbind(1)
        kd = b * tp + (1.0 - b) * tq
        if with_grad:  # a = (1 - b) log(q / m), held in lq
            g = lq.mul_(1.0 - b).sub_((1.0 - b) * tq[:, None]).mul_(q)
    loss = kd * (t * t)
    if raw is None:
        if g is not None and row_weight is not None:
            g.mul_(row_weight * t)  # d(T^2 KD)/dx = T dKD/dz
        return loss, g
    if g is not None:
        g.mul_(t)
    return _add_ce(inp, rows, raw, loss, g, row_weight)


def _chunk_terms_triton(
    inp: ExactInputs, rows: Rows, row_weight: float | torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`chunk_terms` through the kernels of :mod:`.exact_kernels` (no shard, no CE)."""
    from . import exact_kernels as ek

    spec, head, cfg = inp.spec, inp.teacher, inp.kernel_config
    t = spec.temperature
    tf = ek.Transform(head.logit_scale, head.softcap, spec.inv_temperature, spec.beta)
    y = project(take_rows(inp.teacher_hidden, rows), head.weight, head.bias)
    x = project(take_rows(inp.hidden, rows), inp.weight, inp.bias)
    coef: float | torch.Tensor | None = None
    if isinstance(row_weight, torch.Tensor):
        coef = row_weight.reshape(-1) * t
    elif row_weight is not None:
        coef = row_weight * t
    stats = ek.row_stats(y, x, tf, cfg)
    sums = ek.jsd_sums(y, x, tf, stats, cfg) if spec.loss == "jsd" else None
    if sums is not None:
        kd = spec.beta * sums[:, 0] + (1.0 - spec.beta) * sums[:, 1]
        term = sums[:, 1]
    else:
        kd = term = stats[:, 2 if spec.loss == "forward_kl" else 3]
    if coef is not None:
        ek.row_grad(y, x, tf, spec.loss, stats, term, coef, cfg)
    return kd.to(inp.work_dtype) * (t * t), None if coef is None else x


def _add_ce(
    inp: ExactInputs,
    rows: Rows,
    raw: torch.Tensor,
    loss: torch.Tensor,
    g: torch.Tensor | None,
    row_weight: float | torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Add ``ce_weight * CE`` to the row losses and (``g``) its gradient ``ce_weight *
    (softmax(x) - onehot(label))``, then apply ``row_weight``; ``raw`` (the chunk's raw logits,
    this shard's columns) is overwritten."""
    if inp.labels is None:
        raise LossInputError("ce_weight > 0 needs labels")
    shard, ce = inp.shard, inp.spec.ce_weight
    lab = take_rows(inp.labels, rows)
    if shard is not None:
        lab = lab - shard.start
    own = (lab >= 0) & (lab < raw.shape[1])
    idx = torch.where(own, lab, torch.zeros_like(lab))[:, None]
    zero = torch.zeros((), dtype=raw.dtype, device=raw.device)
    x_lab = _total(torch.where(own, raw.gather(1, idx).squeeze(1), zero), shard)
    lse1 = torch.logsumexp(raw, dim=1)
    if shard is not None:
        lse1 = torch.logsumexp(exchange(lse1[:, None], shard), dim=0).squeeze(1)
    loss = loss + ce * (lse1 - x_lab)
    if g is not None and row_weight is not None:
        g.add_(raw.sub_(lse1[:, None]).exp_().mul_(ce))
        g.scatter_add_(1, idx, torch.where(own, -ce * torch.ones_like(x_lab), zero)[:, None])
        g.mul_(row_weight)
    return loss, g
