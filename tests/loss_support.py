"""Random distillation problems for the loss tests (CPU, deterministic)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist


@dataclass
class Problem:
    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    ids: torch.Tensor
    logprobs: torch.Tensor
    tail: torch.Tensor
    labels: torch.Tensor
    mask: torch.Tensor

    def leaves(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.hidden, self.weight, self.bias


def make_problem(
    n: int = 24,
    d: int = 16,
    vocab: int = 40,
    k: int = 6,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    logit_scale: float = 1.0,
    lead: tuple[int, ...] | None = None,
) -> Problem:
    """Teacher: top-k of a random distribution, logprobs ``log_softmax(...) + log M`` with
    ``M ~ U(0.8, 0.95)``; tail = 1 - M. Student logits have std about ``2 * logit_scale``.
    Row 1 has an ignored label, row 2 is masked out (when n > 2)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, d, generator=g, dtype=torch.float64) * (2 * logit_scale / d**0.5)
    bias = torch.randn(vocab, generator=g, dtype=torch.float64) * 0.1
    scores = torch.rand(n, vocab, generator=g, dtype=torch.float64)
    ids = scores.topk(k, dim=1).indices
    mass = torch.rand(n, 1, generator=g, dtype=torch.float64) * 0.15 + 0.8
    raw = torch.randn(n, k, generator=g, dtype=torch.float64) * 2
    logprobs = torch.log_softmax(raw.sort(dim=1, descending=True).values, -1) + mass.log()
    tail = (1 - logprobs.exp().sum(-1)).clamp(0, 1)
    labels = torch.randint(0, vocab, (n,), generator=g)
    mask = torch.ones(n, dtype=torch.bool)
    if n > 2:
        labels[1] = -100
        mask[2] = False
    shape = (n,) if lead is None else lead

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).requires_grad_()

    return Problem(
        hidden=leaf(hidden.reshape(*shape, d)),
        weight=leaf(weight),
        bias=leaf(bias),
        ids=ids.reshape(*shape, k),
        logprobs=logprobs.reshape(*shape, k).float(),
        tail=tail.reshape(shape).float(),
        labels=labels.reshape(shape),
        mask=mask.reshape(shape),
    )


def run(prob: Problem, **kw: object) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss value and the gradients of (hidden, weight, bias) for one call."""
    from logitcache.client.loss import topk_distill_loss

    for t in prob.leaves():
        t.grad = None
    kw.setdefault("bias", prob.bias)
    out = topk_distill_loss(prob.hidden, prob.weight, prob.ids, prob.logprobs, **kw)
    out.sum().backward()
    return out.detach(), [t.grad.clone() for t in prob.leaves()]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def sample_targets(
    p: torch.Tensor, draws: int, m: int, tau: float = 1.0, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random-sampling KD rows from teacher probabilities ``p [R, V]`` (the #12 contract).

    Draw ``draws`` ids per row from ``q ∝ p^(1/tau)``; keep the distinct ones with weights
    ``w ∝ count * p / q`` (normalised); pad to ``m`` columns with unused ids and ``log w = -inf``.
    Returns ``ids [R, m]`` (int64, distinct per row) and ``log w [R, m]`` (float64).
    """
    rows, vocab = p.shape
    q = p.pow(1.0 / tau)
    q = q / q.sum(-1, keepdim=True)
    picks = torch.multinomial(q, draws, replacement=True, generator=generator)
    counts = torch.zeros(rows, vocab, dtype=torch.float64).scatter_add_(
        1, picks, torch.ones(rows, draws, dtype=torch.float64)
    )
    w = counts * p / q
    w = w / w.sum(-1, keepdim=True)
    # sampled ids first (largest weight first), then unused ids as padding
    order = torch.where(counts > 0, w, -1.0 - torch.arange(vocab, dtype=torch.float64))
    ids = order.argsort(dim=1, descending=True)[:, :m]
    logw = w.gather(1, ids).log()  # exactly -inf on padding (weight 0)
    if bool((counts > 0).sum(-1).max() > m):
        raise ValueError("m is smaller than the number of distinct sampled ids")
    return ids, logw


# ----------------------------------------------------------------------------- multi-process
# Worker bodies for tests/loss/test_loss_vocab_parallel.py (gloo on CPU, started by fork). Each
# worker builds the same float64 problem on every rank, runs the loss on its shard of the lm-head
# and compares with the single-process result computed in the same process; a failed comparison
# raises, and torch.multiprocessing re-raises it in the test with the traceback.

TOL = 1e-10  # float64: the only difference is the order of one logsumexp and one grad_h sum


def _init(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _bounds(vocab: int, world: int, rank: int) -> tuple[int, int]:
    """``torch.chunk`` layout (uneven when ``world`` does not divide ``vocab``)."""
    size = -(-vocab // world)
    start = min(rank * size, vocab)
    return start, min(start + size, vocab)


CONFIGS: list[dict] = [
    dict(loss="forward_kl"),
    dict(loss="forward_kl", tail=True, ce_weight=0.3, temperature=2.0),
    dict(loss="forward_kl", ce_weight=0.5),
    dict(loss="jsd", tail=True),
    dict(loss="reverse_kl"),
    dict(loss="renormalized_kl"),
    dict(loss="forward_kl", targets="sampled"),
    dict(loss="forward_kl", tail=True, impl="fused_chunked_recompute", reduction="none"),
]


def vocab_parallel_worker(rank: int, world: int, port: int) -> None:
    """Every config: loss and grads of the sharded run equal the single-process run."""
    from logitcache.client.loss import VocabParallel, topk_distill_loss

    _init(rank, world, port)
    try:
        vocab = 41
        lo, hi = _bounds(vocab, world, rank)
        # world 4 (twice the processes on a 2-core box) runs the configs with the most paths
        picked = range(len(CONFIGS)) if world <= 2 else (0, 1, 6, 7)
        for i in picked:
            cfg = dict(CONFIGS[i])
            impl = cfg.pop("impl", "fused_chunked")
            prob = make_problem(n=23, d=8, vocab=vocab, k=5, seed=10 + i)
            if cfg.pop("tail", False):
                cfg["tail_mass"] = prob.tail
            if cfg.get("targets") == "sampled":
                prob.logprobs = torch.log_softmax(prob.logprobs, -1)
                prob.logprobs[:, -1] = float("-inf")  # one padded id per row
                prob.logprobs = torch.log_softmax(prob.logprobs, -1)
            kw = dict(labels=prob.labels, mask=prob.mask, chunk_size=7, **cfg)
            ref_loss, ref_grads = run(prob, impl=impl, **kw)
            h = prob.hidden.detach().clone().requires_grad_()
            w = prob.weight.detach()[lo:hi].clone().requires_grad_()
            b = prob.bias.detach()[lo:hi].clone().requires_grad_()
            out = topk_distill_loss(
                h,
                w,
                prob.ids,
                prob.logprobs,
                bias=b,
                impl=impl,
                vocab_parallel=VocabParallel(),
                **kw,
            )
            out.sum().backward()
            assert rel_err(out.detach(), ref_loss) < TOL, (cfg, out, ref_loss)
            assert rel_err(h.grad, ref_grads[0]) < TOL, cfg
            assert rel_err(w.grad, ref_grads[1][lo:hi]) < TOL, cfg
            assert rel_err(b.grad, ref_grads[2][lo:hi]) < TOL, cfg
        _dtensor_colwise_check(rank, world)
        _different_rows_rejected(rank, world)
    finally:
        dist.destroy_process_group()


def _dtensor_colwise_check(rank: int, world: int) -> None:
    """torch ``ColwiseParallel`` on an ``nn.Linear`` lm-head: the DTensor path, same grads."""
    from logitcache.client.loss import TopKDistillHead
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    prob = make_problem(n=12, d=8, vocab=37, k=4, seed=3)
    ref_loss, ref_grads = run(prob, chunk_size=5)
    lin = torch.nn.Linear(8, 37, dtype=torch.float64)
    with torch.no_grad():
        lin.weight.copy_(prob.weight)
        lin.bias.copy_(prob.bias)
    head = TopKDistillHead(lin, chunk_size=5)
    mesh = init_device_mesh("cpu", (world,))
    parallelize_module(head, mesh, {"lm_head": ColwiseParallel()})
    h = prob.hidden.detach().clone().requires_grad_()
    loss = head(h, prob.ids, prob.logprobs)
    loss.backward()
    assert rel_err(loss.detach(), ref_loss) < TOL
    assert rel_err(h.grad, ref_grads[0]) < TOL
    assert tuple(head.lm_head.weight.grad.placements) == tuple(head.lm_head.weight.placements)
    assert rel_err(head.lm_head.weight.grad.full_tensor(), ref_grads[1]) < TOL
    assert rel_err(head.lm_head.bias.grad.full_tensor(), ref_grads[2]) < TOL


def _different_rows_rejected(rank: int, world: int) -> None:
    from logitcache.client.loss import LossInputError, VocabParallel, topk_distill_loss

    prob = make_problem(n=6, d=4, vocab=20, k=3, seed=100 + rank)  # different rows per rank
    lo, hi = _bounds(20, world, rank)
    try:
        topk_distill_loss(
            prob.hidden, prob.weight[lo:hi], prob.ids, prob.logprobs, vocab_parallel=VocabParallel()
        )
    except LossInputError as e:
        assert "same hidden rows" in str(e)
    else:
        raise AssertionError("different rows on the ranks were not detected")


class _Student(torch.nn.Module):
    """A one-layer body and a :class:`TopKDistillHead` (float64)."""

    def __init__(self, d: int, vocab: int) -> None:
        from logitcache.client.loss import TopKDistillHead

        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(d, d, dtype=torch.float64)
        lm_head = torch.nn.Linear(d, vocab, bias=False, dtype=torch.float64)
        self.head = TopKDistillHead(lm_head, chunk_size=4)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, lps: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)), ids, lps)


def fsdp_worker(rank: int, world: int, port: int) -> None:
    """FSDP2 ``fully_shard`` student with a sharded lm-head: grads equal the unsharded run."""
    from torch.distributed.fsdp import fully_shard

    _init(rank, world, port)
    try:
        d, vocab, n_per_rank = 8, 30, 10
        full = make_problem(n=n_per_rank * world, d=d, vocab=vocab, k=4, seed=7)

        def step(m: torch.nn.Module, rows: slice) -> torch.Tensor:
            loss = m(full.hidden.detach()[rows], full.ids[rows], full.logprobs[rows])
            loss.backward()
            return loss.detach()

        ref = _Student(d, vocab)
        step(ref, slice(None))  # one process, all rows, mean over all rows
        model = _Student(d, vocab)
        fully_shard(model.head)
        fully_shard(model)
        w = model.head.lm_head.weight
        assert tuple(w.placements)[0].is_shard(0), w.placements
        assert w.to_local().shape[0] == -(-vocab // world) or rank == world - 1
        step(model, slice(rank * n_per_rank, (rank + 1) * n_per_rank))
        for name, p in model.named_parameters():
            want = dict(ref.named_parameters())[name].grad
            got = p.grad.full_tensor()
            assert rel_err(got, want) < TOL, (name, rel_err(got, want))
    finally:
        dist.destroy_process_group()


EXACT_CONFIGS: list[dict] = [
    dict(loss="forward_kl"),
    dict(loss="reverse_kl", temperature=2.0),
    dict(loss="jsd", beta=0.3, temperature=0.5, ce_weight=0.4),
    dict(loss="forward_kl", temperature=1.5, reduction="none", ce_weight=0.2),
]


def exact_vocab_parallel_worker(rank: int, world: int, port: int) -> None:
    """``exact_distill_loss`` with both heads split along the vocabulary equals one process."""
    from logitcache.client.loss import VocabParallel, exact_distill_loss

    _init(rank, world, port)
    try:
        vocab, n = 41, 23
        lo, hi = _bounds(vocab, world, rank)
        for i, cfg in enumerate(EXACT_CONFIGS):
            g = torch.Generator().manual_seed(20 + i)
            shapes = [(n, 8), (vocab, 8), (vocab,), (n, 6), (vocab, 6), (vocab,)]
            hs, ws, bs, ht, wt, bt = (
                torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes
            )
            labels = torch.randint(0, vocab, (n,), generator=g)
            labels[1] = -100
            mask = torch.rand(n, generator=g) > 0.2
            weights = torch.rand(n, generator=g, dtype=torch.float64)
            outs = []
            for part in (slice(0, vocab), slice(lo, hi)):
                leaves = [t.clone().requires_grad_() for t in (hs, ws[part], bs[part])]
                out = exact_distill_loss(
                    leaves[0],
                    leaves[1],
                    ht,
                    wt[part],
                    student_bias=leaves[2],
                    teacher_bias=bt[part],
                    labels=labels,
                    mask=mask,
                    chunk_size=5,
                    vocab_parallel=None if part.stop - part.start == vocab else VocabParallel(),
                    **cfg,
                )
                (out * weights if out.dim() else out).sum().backward()
                outs.append((out.detach(), [t.grad for t in leaves]))
            (ref, ref_g), (got, got_g) = outs
            assert rel_err(got, ref) < TOL, (cfg, got, ref)
            assert rel_err(got_g[0], ref_g[0]) < TOL, cfg
            assert rel_err(got_g[1], ref_g[1][lo:hi]) < TOL, cfg
            assert rel_err(got_g[2], ref_g[2][lo:hi]) < TOL, cfg
    finally:
        dist.destroy_process_group()


# The ranks fork from a fresh interpreter that has imported only torch and the workers: forking
# the pytest process itself hangs once an earlier test file on the same xdist worker has started
# threads (the in-process vLLM engine, OpenMP pools), and would inherit any process group left
# initialised there. spawn would re-import torch in every rank (~10 s each on 2 cores).
_LAUNCH = """
import socket, sys
import torch.multiprocessing as mp
import loss_support

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
fn, world = getattr(loss_support, sys.argv[1]), int(sys.argv[2])
mp.start_processes(fn, args=(world, port), nprocs=world, start_method="fork", join=True)
"""


def spawn_workers(worker: str, world: int) -> None:
    """Run ``loss_support.<worker>(rank, world, port)`` in ``world`` gloo processes; a failed
    assertion in any rank fails the caller with its traceback."""
    run = subprocess.run(
        [sys.executable, "-c", _LAUNCH, worker, str(world)],
        cwd=Path(__file__).resolve().parent,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
