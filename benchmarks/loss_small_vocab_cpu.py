"""The sparse distillation loss vs a full-vocabulary dense KL at the tiny fixture's shapes, on
one CPU thread (issue #12: why offline steps are ~0.6x of online KD's on the tiny setup).

Shapes of ``examples/distill.py``'s training step: 512 rows (4 x 128 tokens), student hidden
128, vocabulary 1,024; targets as the offline methods train on them: top-k + tail at k = 48 and
128, sampled rows 64 and 174 columns wide (trimmed 96- and 384-draw batches). For each case it
prints the median of ``--repeats`` forward + backward passes of ``topk_distill_loss`` for each
``impl`` (wall and CPU time of this thread), of a dense full-vocabulary loss (student
log-softmax over V times fixed targets: what online KD computes beside its teacher forward),
and of a gather-based forward KL with the tail bucket (full student log-softmax gathered at the
ids; no checks, inexact outside mass: a sketch, not a package impl). Every round runs each
variant once, in turn, so a shared machine's load falls on all of them alike.

``--sweep``: ``impl="small_vocab"`` vs ``"fused_chunked"`` over rows x vocabulary (k = 128,
hidden 128), the measurements behind ``dispatch.picks_small_vocab``.

    .venv/bin/python benchmarks/loss_small_vocab_cpu.py
    .venv/bin/python benchmarks/loss_small_vocab_cpu.py --sweep
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable

import torch
from logitcache.client.loss import topk_distill_loss

ROWS, HIDDEN, VOCAB = 512, 128, 1024
IMPLS = ("auto", "dense", "forward_chunked", "fused_chunked", "small_vocab")
#: (label, target kind, teacher columns)
CASES = (("topk_tail", "topk", 48), ("topk_tail", "topk", 128), ("sampled", "sampled", 64))
CASES += (("sampled", "sampled", 174),)
SWEEP = ((512, 1024), (4096, 1024), (512, 2048), (512, 4096), (1024, 4096), (512, 8192))
SWEEP += ((128, 32768), (32, 131072))


def timed_rounds(fns: dict[str, Callable[[], torch.Tensor]], repeats: int) -> dict[str, tuple]:
    """Median (wall ms, CPU ms) of ``fn().backward()`` per name, the names alternating."""
    wall: dict[str, list[float]] = {n: [] for n in fns}
    cpu: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            w, c = time.perf_counter(), time.thread_time()
            fn().backward()
            cpu[name].append(time.thread_time() - c)
            wall[name].append(time.perf_counter() - w)
    mid = repeats // 2
    return {n: (sorted(wall[n])[mid] * 1e3, sorted(cpu[n])[mid] * 1e3) for n in fns}


def impl_fns(impls: tuple[str, ...], *args: torch.Tensor | None, **kw: str) -> dict:
    """``name -> fn()``: ``topk_distill_loss(*args, impl=name, **kw)`` for each impl."""
    return {i: functools.partial(topk_distill_loss, *args, impl=i, **kw) for i in impls}


def dense_loss(h: torch.Tensor, w: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the full student log-softmax against a dense target (online KD's)."""
    return -(target * (h @ w.T).log_softmax(-1)).sum()


def gather_kl(
    h: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, lp: torch.Tensor, tail: torch.Tensor
) -> torch.Tensor:
    """Forward KL over [top-k ids | tail bucket] from the full student log-softmax."""
    logq = (h @ w.T).log_softmax(-1)
    lq = logq.gather(1, ids)
    lqo = torch.log1p(-lq.exp().sum(-1).clamp(max=1 - 1e-6))
    kd = (lp.exp() * (lp - lq)).sum(-1)
    return (kd + torch.xlogy(tail, tail) - tail * lqo).sum()


def targets(kind: str, k: int, rows: int, vocab: int, g: torch.Generator) -> tuple:
    """``(ids, logprobs, tail)``: top-k rows with 5% tail, or sampled rows whose last quarter of
    columns is padding (``-65504``, as the cache stores it) with weights summing to 1."""
    ids = torch.rand(rows, vocab, generator=g).argsort(dim=1)[:, :k]
    lp = torch.log_softmax(torch.randn(rows, k, generator=g), -1)
    if kind == "topk":
        return ids, lp + torch.log(torch.tensor(0.95)), torch.full((rows,), 0.05)
    pad = k // 4
    lp[:, k - pad :] = -65504.0
    return ids, torch.log_softmax(lp, -1).clamp_min(-65504.0), None


def tiny_step(repeats: int) -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(ROWS, HIDDEN, generator=g, requires_grad=True)
    w = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.3).requires_grad_()
    dense_target = torch.softmax(torch.randn(ROWS, VOCAB, generator=g), -1)
    for label, kind, k in CASES:
        ids, lp, tail = targets(kind, k, ROWS, VOCAB, g)
        fns = impl_fns(IMPLS, h, w, ids, lp, tail, targets=kind)
        fns["dense full-vocabulary loss"] = functools.partial(dense_loss, h, w, dense_target)
        if kind == "topk":
            fns["gather-based sketch"] = functools.partial(gather_kl, h, w, ids, lp, tail)
        res = timed_rounds(fns, repeats)
        for name, (wall, cpu) in res.items():
            what = f"topk_distill_loss impl={name}" if name in IMPLS else name
            print(f"{label} k={k} {what}: {wall:.2f} ms (CPU {cpu:.2f} ms)", flush=True)


def sweep(repeats: int) -> None:
    g = torch.Generator().manual_seed(1)
    for rows, vocab in SWEEP:
        h = torch.randn(rows, HIDDEN, generator=g, requires_grad=True)
        w = (torch.randn(vocab, HIDDEN, generator=g) * 0.1).requires_grad_()
        ids, lp, tail = targets("topk", 128, rows, vocab, g)
        fns = impl_fns(("small_vocab", "fused_chunked"), h, w, ids, lp, tail)
        res = timed_rounds(fns, repeats)
        (sw, sc), (fw, fc) = res["small_vocab"], res["fused_chunked"]
        print(
            f"sweep N={rows} V={vocab}: small_vocab {sc:.1f} ms CPU, fused_chunked {fc:.1f} ms "
            f"CPU, ratio {sc / fc:.2f} (wall {sw:.1f} / {fw:.1f} ms)",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweep", action="store_true", help="small_vocab vs fused over N x V")
    ap.add_argument("--repeats", type=int, default=None, help="rounds (default 30; sweep 9)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"1 torch thread; 1-minute load average {os.getloadavg()[0]:.2f} at the start")
    if args.sweep:
        sweep(args.repeats or 9)
    else:
        tiny_step(args.repeats or 30)
    print(f"1-minute load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
