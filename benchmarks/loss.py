"""Isolated lm-head sweep for the top-k distillation loss (the paper's toy benchmark).

For each vocabulary V and number of positions N: student hidden ``h [N, d]`` and lm-head
``W [V, d]`` in bf16 with ``requires_grad``, teacher top-k ids (distinct per row) and logprobs
``log_softmax(sorted N(0, 2^2)) + log M`` with ``M ~ U(0.85, 0.95)``, ``W ~ N(0, (2/sqrt d)^2)``.
One step = forward + backward of the mean forward KL (the Multiverse objective,
``sum_S p (log p - log q)``); grads are set to None before each step. Reported per cell:
peak ``torch.cuda.max_memory_allocated`` over the timed steps (inputs and one set of grads
included), ``delta`` = peak minus the memory held before the step, the median step time over
CUDA events, and TFLOP/s counting ``6 N d V``. The bf16 GEMM rate of the lm-head shape
(``[8192 x d] @ [d x V]``) is measured in the same run as the ratio baseline.

Phase 1 (``--check``) compares every variant with a float64 dense reference at a small N on the
GPU, and the bf16 fused grad_W with a float32 computation at a large N.

    python benchmarks/loss_bench.py --check --out results.json          # the H200 run
    python benchmarks/loss_bench.py --device cpu --sizes 64 --vocabs 500 --dim 32 --k 8 --check
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:
    from logitcache.client.loss import chunk_ops, fused_chunked, topk_distill_loss
except ImportError:  # run from a bare checkout (the GPU box has no editable install)
    import importlib
    import types

    root = Path(__file__).resolve().parents[1]
    pkg = types.ModuleType("logitcache")
    pkg.__path__ = []  # namespace stand-in
    sys.modules["logitcache"] = pkg
    client = types.ModuleType("logitcache.client")
    client.__path__ = [str(root / "client")]
    sys.modules["logitcache.client"] = client
    loss_pkg = importlib.import_module("logitcache.client.loss")
    chunk_ops = importlib.import_module("logitcache.client.loss.chunk_ops")
    fused_chunked = importlib.import_module("logitcache.client.loss.fused_chunked")
    topk_distill_loss = loss_pkg.topk_distill_loss

GIB = 1 << 30


# ----------------------------------------------------------------------------- inputs
def make_inputs(n: int, d: int, vocab: int, k: int, device: str, seed: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    bf = torch.bfloat16
    h = torch.randn(n, d, generator=g, device=device, dtype=torch.float32).to(bf)
    w = (torch.randn(vocab, d, generator=g, device=device) * (2 / math.sqrt(d))).to(bf)
    ids = torch.empty(n, k, dtype=torch.long, device=device)
    step = max(1, (1 << 28) // vocab)
    for s in range(0, n, step):  # distinct ids per row: top-k of random scores, in slices
        e = min(n, s + step)
        ids[s:e] = torch.rand(e - s, vocab, generator=g, device=device).topk(k, dim=1).indices
    raw = torch.randn(n, k, generator=g, device=device) * 2
    mass = torch.rand(n, 1, generator=g, device=device) * 0.1 + 0.85
    lp = torch.log_softmax(raw.sort(dim=1, descending=True).values, -1) + mass.log()
    return {"h": h.requires_grad_(), "w": w.requires_grad_(), "ids": ids, "lp": lp}


# ----------------------------------------------------------------------------- variants
def ours(impl: str, backend: str = "auto", chunk: int | None = None) -> Callable:
    def fn(x: dict) -> torch.Tensor:
        chunk_ops.BACKEND = backend
        try:
            return topk_distill_loss(x["h"], x["w"], x["ids"], x["lp"], impl=impl, chunk_size=chunk)
        finally:
            chunk_ops.BACKEND = "auto"

    return fn


def torch_dense_gather(x: dict) -> torch.Tensor:
    """Plain torch: bf16 logits, fp32 log_softmax, gather, the formula; autograd."""
    logq = torch.log_softmax((x["h"] @ x["w"].t()).float(), dim=-1).gather(1, x["ids"])
    p = x["lp"].exp()
    return (p * (x["lp"] - logq)).sum(-1).mean()


def liger_kl_dense_target(x: dict) -> torch.Tensor:
    """Liger-Kernel LigerFusedLinearKLDivLoss on a dense fp32 target built from the top-k."""
    from liger_kernel.ops import LigerFusedLinearKLDivFunction

    n, vocab = x["h"].shape[0], x["w"].shape[0]
    target = torch.zeros(n, vocab, device=x["h"].device).scatter_(1, x["ids"], x["lp"].exp())
    # (input, weight, target, shift_labels, reduction, ignore_index, temperature, eps, accum)
    return LigerFusedLinearKLDivFunction.apply(
        x["h"], x["w"], target, None, "batchmean", -100, 1.0, 1e-10, None
    )


def variants(device: str) -> dict[str, Callable]:
    out = {
        "dense": ours("dense"),
        "torch_dense_gather": torch_dense_gather,
        "forward_chunked": ours("forward_chunked"),
        "fused_chunked": ours("fused_chunked"),
        "fused_chunked_recompute": ours("fused_chunked_recompute"),
        "fused_chunked_torchpath": ours("fused_chunked", backend="torch"),
        "fused_chunked_c8192": ours("fused_chunked", chunk=8192),
    }
    try:
        import liger_kernel  # noqa: F401

        if device == "cuda":
            out["liger_kl_dense_target"] = liger_kl_dense_target
    except ImportError:
        pass
    return out


# ----------------------------------------------------------------------------- timing
class Timer:
    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def run(self, f: Callable[[], Any]) -> float:
        """Seconds of one call of ``f``."""
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            f()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        t0 = time.perf_counter()
        f()
        return time.perf_counter() - t0


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gemm_rate(n: int, d: int, vocab: int, device: str, timer: Timer) -> float:
    """bf16 TFLOP/s of ``[n, d] @ [d, vocab]`` (median of 10 after 3 warm-ups)."""
    a = torch.randn(n, d, device=device, dtype=torch.bfloat16)
    b = torch.randn(vocab, d, device=device, dtype=torch.bfloat16)

    def mm() -> torch.Tensor:
        return a @ b.t()

    for _ in range(3):
        mm()
    timer.sync()
    ts = [timer.run(mm) for _ in range(10)]
    free()
    return 2 * n * d * vocab / statistics.median(ts) / 1e12


def time_cell(fn: Callable, x: dict, timer: Timer, reps: int, cap_s: float) -> dict:
    device_cuda = timer.cuda

    def step() -> None:
        x["h"].grad = None
        x["w"].grad = None
        fn(x).backward()

    if device_cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
    first = timer.run(step)  # warm-up 1 (kernel compile, allocator)
    x["h"].grad = x["w"].grad = None
    n_warm = 1 if first > cap_s / 4 else 2
    for _ in range(n_warm - 1):
        timer.run(step)
        x["h"].grad = x["w"].grad = None
    if device_cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    n_reps = max(2, min(reps, int(cap_s / max(first, 1e-6))))
    ts = []
    for _ in range(n_reps):
        ts.append(timer.run(step))
        x["h"].grad = x["w"].grad = None
    res = {"ms": statistics.median(ts) * 1e3, "ms_all": [round(t * 1e3, 2) for t in ts]}
    if device_cuda:
        peak = torch.cuda.max_memory_allocated()
        res.update(peak_gib=peak / GIB, delta_gib=(peak - base) / GIB, input_gib=base / GIB)
    return res


# ----------------------------------------------------------------------------- checks
def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def grads_of(fn: Callable, x: dict) -> tuple[float, torch.Tensor, torch.Tensor]:
    x["h"].grad = x["w"].grad = None
    loss = fn(x)
    loss.backward()
    out = (loss.item(), x["h"].grad.detach().clone(), x["w"].grad.detach().clone())
    x["h"].grad = x["w"].grad = None
    return out


def check(args: argparse.Namespace, device: str) -> dict:
    """Every variant vs a float64 dense reference (small N); bf16 grad_W vs fp32 (large N)."""
    out: dict[str, Any] = {"small": [], "large": {}}
    vocab = args.vocabs[0]
    x = make_inputs(args.check_n, args.dim, vocab, args.k, device, seed=1)
    x64 = {
        "h": x["h"].detach().double().requires_grad_(),
        "w": x["w"].detach().double().requires_grad_(),
        "ids": x["ids"],
        "lp": x["lp"],
    }
    tail = (1 - x["lp"].exp().sum(-1)).clamp(0, 1)
    labels = torch.randint(0, vocab, (args.check_n,), device=device)
    configs = {
        "forward_kl": {},
        "forward_kl+tail+ce0.2+T2": dict(
            tail_mass=tail, labels=labels, ce_weight=0.2, temperature=2.0
        ),
        "jsd+tail": dict(loss="jsd", tail_mass=tail),
        "reverse_kl": dict(loss="reverse_kl"),
        "renormalized_kl": dict(loss="renormalized_kl"),
    }
    impls = [
        ("forward_chunked", "auto"),
        ("fused_chunked", "auto"),
        ("fused_chunked_recompute", "auto"),
        ("fused_chunked", "torch"),
    ]
    for cname, kw in configs.items():

        def mk(impl: str, backend: str, kw: dict = kw) -> Callable:
            def call(x: dict) -> torch.Tensor:
                chunk_ops.BACKEND = backend
                try:
                    return topk_distill_loss(
                        x["h"],
                        x["w"],
                        x["ids"],
                        x["lp"],
                        impl=impl,
                        chunk_size=args.check_chunk,
                        **kw,
                    )
                finally:
                    chunk_ops.BACKEND = "auto"

            return call

        ref = grads_of(mk("dense", "torch"), x64)
        free()
        rows = [("dense_bf16", mk("dense", "torch"))] + [
            (f"{i}" + ("" if b == "auto" else "_torchpath"), mk(i, b)) for i, b in impls
        ]
        if cname == "forward_kl":
            rows.append(("torch_dense_gather", torch_dense_gather))
            if "liger_kl_dense_target" in variants(device):
                rows.append(("liger_kl_dense_target", liger_kl_dense_target))
        for name, fn in rows:
            got = grads_of(fn, x)
            errs = dict(
                config=cname,
                variant=name,
                loss=got[0],
                loss_ref=ref[0],
                rel_loss=abs(got[0] - ref[0]) / abs(ref[0]),
                rel_grad_h=rel(got[1], ref[1]),
                rel_grad_w=rel(got[2], ref[2]),
                finite=bool(torch.isfinite(got[1]).all() and torch.isfinite(got[2]).all()),
            )
            out["small"].append(errs)
            print(
                f"check {cname:26s} {name:30s} loss {got[0]:+.6f} (ref {ref[0]:+.6f}) "
                f"rel loss {errs['rel_loss']:.1e} grad_h {errs['rel_grad_h']:.1e} "
                f"grad_W {errs['rel_grad_w']:.1e}",
                flush=True,
            )
            free()
        del ref
        free()
    del x, x64
    free()
    if args.check_large_n:
        xl = make_inputs(args.check_large_n, args.dim, vocab, args.k, device, seed=2)
        x32 = {
            "h": xl["h"].detach().float().requires_grad_(),
            "w": xl["w"].detach().float().requires_grad_(),
            "ids": xl["ids"],
            "lp": xl["lp"],
        }
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        ref = grads_of(ours("fused_chunked", "torch", 2048), x32)
        torch.backends.cuda.matmul.allow_tf32 = tf32
        del x32
        free()
        got = grads_of(ours("fused_chunked"), xl)
        out["large"] = dict(
            n=args.check_large_n,
            rel_loss=abs(got[0] - ref[0]) / abs(ref[0]),
            rel_grad_h=rel(got[1], ref[1]),
            rel_grad_w=rel(got[2], ref[2]),
            fp32_epilogue=fused_chunked.addmm_fp32_epilogue_used(xl["h"].device, torch.bfloat16),
        )
        print(f"check large N={args.check_large_n}: fused bf16 vs fp32 {out['large']}", flush=True)
        del xl, ref, got
        free()
    return out


# ----------------------------------------------------------------------------- sweep
def sweep(args: argparse.Namespace, device: str, timer: Timer, t_end: float) -> list[dict]:
    table: list[dict] = []
    fns = variants(device)
    chosen = [v for v in args.variants if v in fns]
    limits = {"fused_chunked_torchpath": args.torchpath_max_n, "dense": args.dense_max_n}
    for vocab in args.vocabs:
        oomed: set[str] = set()
        for n in args.sizes:
            flops = 6 * n * args.dim * vocab
            x = None
            for name in chosen:
                row = dict(variant=name, n=n, vocab=vocab, d=args.dim, k=args.k)
                if name == "fused_chunked_c8192" and n not in args.c8192_sizes:
                    continue
                if n > limits.get(name, n):
                    continue
                if name in oomed:
                    table.append({**row, "status": "OOM (at a smaller N)"})
                    continue
                if time.time() > t_end:
                    table.append({**row, "status": "not run (time cap)"})
                    continue
                try:
                    if x is None:
                        x = make_inputs(n, args.dim, vocab, args.k, device)
                    res = time_cell(fns[name], x, timer, args.reps, args.cell_cap_s)
                    res["tflops"] = flops / (res["ms"] / 1e3) / 1e12
                    table.append({**row, "status": "ok", **res})
                    print(
                        f"{name:26s} V={vocab} N={n:7d} {res['ms']:9.1f} ms "
                        f"{res['tflops']:6.1f} TF/s peak {res.get('peak_gib', 0):6.2f} GiB "
                        f"delta {res.get('delta_gib', 0):6.2f}",
                        flush=True,
                    )
                except torch.OutOfMemoryError:
                    oomed.add(name)
                    table.append({**row, "status": "OOM"})
                    print(f"{name:26s} V={vocab} N={n:7d} OOM", flush=True)
                finally:
                    if x is not None:
                        x["h"].grad = x["w"].grad = None
                    free()
            del x
            free()
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--sizes",
        type=lambda s: [int(v) for v in s.split(",")],
        default=[4096, 8192, 16384, 32768, 65536, 131072, 262144],
    )
    ap.add_argument(
        "--vocabs", type=lambda s: [int(v) for v in s.split(",")], default=[128256, 201088]
    )
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument(
        "--variants",
        type=lambda s: s.split(","),
        default=[
            "fused_chunked",
            "fused_chunked_recompute",
            "forward_chunked",
            "torch_dense_gather",
            "dense",
            "liger_kl_dense_target",
            "fused_chunked_torchpath",
            "fused_chunked_c8192",
        ],
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cell-cap-s", type=float, default=6.0, help="time budget per cell")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting cells after")
    ap.add_argument("--torchpath-max-n", type=int, default=32768)
    ap.add_argument("--dense-max-n", type=int, default=32768)
    ap.add_argument(
        "--c8192-sizes", type=lambda s: [int(v) for v in s.split(",")], default=[32768, 262144]
    )
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--check-n", type=int, default=2048)
    ap.add_argument("--check-chunk", type=int, default=512)
    ap.add_argument("--check-large-n", type=int, default=32768)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    t0 = time.time()
    device = args.device
    timer = Timer(device)
    meta: dict[str, Any] = {
        "argv": sys.argv,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    try:
        from importlib.metadata import version

        import liger_kernel  # noqa: F401

        meta["liger_kernel"] = version("liger-kernel")
    except Exception:  # noqa: BLE001 - optional peer
        meta["liger_kernel"] = None
    print(meta, flush=True)
    result: dict[str, Any] = {"meta": meta}
    if device == "cuda":
        result["gemm_tflops"] = {
            str(v): gemm_rate(8192, args.dim, v, device, timer) for v in args.vocabs
        }
        result["gemm_tflops_8192cube"] = gemm_rate(8192, 8192, 8192, device, timer)
        print("bf16 GEMM TFLOP/s", result["gemm_tflops"], result["gemm_tflops_8192cube"])
    if args.check:
        result["check"] = check(args, device)
        print(f"check done at {time.time() - t0:.0f} s", flush=True)
    result["sweep"] = sweep(args, device, timer, t0 + args.budget_s)
    result["fp32_epilogue"] = fused_chunked.addmm_fp32_epilogue_used(
        torch.device(device), torch.bfloat16
    )
    result["wall_s"] = time.time() - t0
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    print(f"done in {result['wall_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
