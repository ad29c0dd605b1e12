"""The distillation loss in isolation: peak memory and time vs positions, the memory floor, the
exact loss.

Modes::

    python -m benchmarks.loss sweep --check --out benchmarks/results/loss.json      # CUDA GPU
    python -m benchmarks.loss sweep --variants fp32acc,bf16acc,floor \\
        --configs 128256x4096,201088x4096,128256x8192
    python -m benchmarks.loss sweep --device cpu --sizes 64 --configs 500x32 --k 8 --check
    python -m benchmarks.loss plot benchmarks/results/loss.json benchmarks/results
    python -m benchmarks.loss exact --check --configs 128256x4096 --out exact_gpu.json
    python -m benchmarks.loss exact --device cpu --sizes 2048 --configs 8192x256 --gemm-chunks 512

``sweep``: per ``(V, d)`` config and N, forward + backward of the mean forward KL of bf16 student
hidden ``h [N, d]`` and head ``W [V, d]`` against synthetic top-k targets, for each variant
(:func:`variants`: ours, the memory-floor settings :data:`FLOOR`, plain torch, Liger's fused KL
on a dense target if installed): peak ``max_memory_allocated``, its growth over the inputs, the
median step time (CUDA events), TFLOP/s counting ``6 N d V`` beside the bf16 lm-head GEMM rate
of the same run. ``--check`` first compares every variant with a float64 dense reference (small
N) and the bf16 grad_W with float32 (large N). ``plot`` redraws ``loss_memory.png`` and
``loss_time.png`` from a committed result.

``exact``: ``exact_distill_loss`` (teacher hidden + head; variants
``exact_<loss>[_torch][_c<rows>][_bf16acc]``) beside the fused top-k loss on the top-k of
the same teacher's logits: time, memory (CPU: the peak bytes of the tensors a step creates),
TFLOP/s counting ``8 N d V`` as a fraction of the lm-head GEMM rate, and one chunk's four bare
GEMMs per ``--gemm-chunks``. ``--check`` first compares the Triton and torch passes with float64.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from logitcache.client.loss import exact_distill_loss, fused_chunked, topk_distill_loss

from benchmarks.harness import (
    Point,
    Recorder,
    add_csv_option,
    free_memory,
    line_plot,
    log,
    machine_line,
    median_time,
    options,
    suite_parser,
    time_call,
)

GIB = 1 << 30
DEFAULT_VARIANTS = (
    "fused_chunked fused_chunked_recompute forward_chunked torch_dense_gather dense "
    "liger_kl_dense_target fused_chunked_torchpath fused_chunked_c8192"
).split()


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
def targets(x: dict) -> tuple[torch.Tensor, ...]:
    """The loss's positional inputs: student hidden, head, top-k ids and logprobs."""
    return x["h"], x["w"], x["ids"], x["lp"]


def ours(impl: str, backend: str = "auto", chunk: int | None = None) -> Callable:
    def fn(x: dict) -> torch.Tensor:
        return topk_distill_loss(*targets(x), impl=impl, chunk_size=chunk, kernels=backend)

    return fn


#: The memory-floor variants (``impl="fused_chunked"``): grad_W accumulated in fp32 or straight
#: into the bf16 grad buffer, and the logits chunk as a byte budget or a row count.
FLOOR = {
    "fp32acc": {"grad_weight_dtype": "float32", "budget": 1 << 30},
    "bf16acc": {"grad_weight_dtype": "weight", "budget": 1 << 30},
    "floor": {"grad_weight_dtype": "weight", "budget": 1 << 29},
    "floor_c1920": {"grad_weight_dtype": "weight", "rows": 1920},
}


def floor_variant(name: str) -> Callable:
    opts = FLOOR[name]

    def fn(x: dict) -> torch.Tensor:
        vocab = x["w"].shape[0]
        rows = opts.get("rows") or max(256, opts["budget"] // (2 * vocab) // 256 * 256)
        dtype = opts["grad_weight_dtype"]
        return topk_distill_loss(*targets(x), chunk_size=rows, grad_weight_dtype=dtype)

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
        **{name: floor_variant(name) for name in FLOOR},
    }
    try:
        import liger_kernel  # noqa: F401

        if device == "cuda":
            out["liger_kl_dense_target"] = liger_kl_dense_target
    except ImportError:
        pass
    return out


# ----------------------------------------------------------------------------- timing
def free() -> None:
    free_memory(torch.cuda.is_available())


def gemm_rate(n: int, d: int, vocab: int, device: str, cuda: bool, hold_s: float = 0.0) -> float:
    """bf16 TFLOP/s of ``[n, d] @ [d, vocab]``: median of 10 after 3 warm-ups, or after
    ``hold_s`` seconds of back-to-back GEMMs (the rate sustained once the clocks settle)."""
    a = torch.randn(n, d, device=device, dtype=torch.bfloat16)
    b = torch.randn(vocab, d, device=device, dtype=torch.bfloat16)
    warm = 3
    if hold_s > 0:
        warm = max(warm, int(hold_s / max(time_call(cuda, lambda: a @ b.t()), 1e-6)))
    t = median_time(cuda, lambda: a @ b.t(), warmup=warm)
    free()
    return 2 * n * d * vocab / t / 1e12


def time_cell(fn: Callable, x: dict, cuda: bool, reps: int, cap_s: float) -> dict:
    def step() -> None:
        x["h"].grad = x["w"].grad = None
        fn(x).backward()

    first = time_call(cuda, step)  # warm-up 1 (kernel compile, allocator)
    x["h"].grad = x["w"].grad = None
    n_warm = 1 if first > cap_s / 4 else 2
    for _ in range(n_warm - 1):
        time_call(cuda, step)
        x["h"].grad = x["w"].grad = None
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    n_reps = max(2, min(reps, int(cap_s / max(first, 1e-6))))
    ts = []
    for _ in range(n_reps):
        ts.append(time_call(cuda, step))
        x["h"].grad = x["w"].grad = None
    res = {"ms": statistics.median(ts) * 1e3, "ms_all": [round(t * 1e3, 2) for t in ts]}
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        res.update(peak_gib=peak / GIB, delta_gib=(peak - base) / GIB, input_gib=base / GIB)
    return res


def run_cell(row: dict, timed: Callable[[], dict], flops: float) -> dict:
    """``row`` with the timings of ``timed()`` and their TFLOP/s (``flops`` per step), or its
    status (``OOM``, ``error: ...``: one variant failing must not end the run); a progress line."""
    try:
        row.update(timed(), status="ok")
        row["tflops"] = flops / (row["ms"] / 1e3) / 1e12
    except torch.OutOfMemoryError:
        row["status"] = "OOM"
    except Exception as e:
        row["status"] = f"error: {type(e).__name__}: {str(e)[:300]}"
    free()
    log(json.dumps({k: v for k, v in row.items() if k != "ms_all"}))
    return row


# ----------------------------------------------------------------------------- checks
def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def rel_errors(got: tuple, ref: tuple) -> dict[str, float]:
    """Relative errors of a ``(loss, grad_h, grad_w)`` against a reference's."""
    rel_loss = abs(got[0] - ref[0]) / abs(ref[0])
    return dict(rel_loss=rel_loss, rel_grad_h=rel(got[1], ref[1]), rel_grad_w=rel(got[2], ref[2]))


def grads_of(fn: Callable, x: dict) -> tuple[float, torch.Tensor, torch.Tensor]:
    x["h"].grad = x["w"].grad = None
    loss = fn(x)
    loss.backward()
    out = (loss.item(), x["h"].grad.detach().clone(), x["w"].grad.detach().clone())
    x["h"].grad = x["w"].grad = None
    return out


def leaves_as(x: dict, dtype: torch.dtype) -> dict:
    """``x`` with ``h`` and ``w`` as new leaves of ``dtype`` (the targets shared)."""
    return x | {n: x[n].detach().to(dtype).requires_grad_() for n in ("h", "w")}


def check(args: argparse.Namespace, device: str) -> dict:
    """Every variant vs a float64 dense reference (small N); bf16 grad_W vs fp32 (large N)."""
    out: dict[str, Any] = {"small": [], "large": {}}
    vocab, dim = args.configs[0]
    x = make_inputs(args.check_n, dim, vocab, args.k, device, seed=1)
    x64 = leaves_as(x, torch.float64)
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
    impls = [(i, "auto") for i in ("forward_chunked", "fused_chunked", "fused_chunked_recompute")]
    impls.append(("fused_chunked", "torch"))
    for cname, kw in configs.items():

        def mk(impl: str, backend: str, kw: dict = kw) -> Callable:
            def call(x: dict) -> torch.Tensor:
                opts = dict(impl=impl, chunk_size=args.check_chunk, kernels=backend)
                return topk_distill_loss(*targets(x), **opts, **kw)

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
            errs = dict(config=cname, variant=name, loss=got[0], loss_ref=ref[0])
            errs.update(rel_errors(got, ref))
            errs["finite"] = bool(torch.isfinite(got[1]).all() and torch.isfinite(got[2]).all())
            out["small"].append(errs)
            log("check", json.dumps(errs))
            free()
        del ref
        free()
    del x, x64
    free()
    if args.check_large_n:
        xl = make_inputs(args.check_large_n, dim, vocab, args.k, device, seed=2)
        x32 = leaves_as(xl, torch.float32)
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        ref = grads_of(ours("fused_chunked", "torch", 2048), x32)
        torch.backends.cuda.matmul.allow_tf32 = tf32
        del x32
        free()
        got = grads_of(ours("fused_chunked"), xl)
        out["large"] = dict(n=args.check_large_n, **rel_errors(got, ref))
        out["large"]["fp32_epilogue"] = fused_chunked.addmm_fp32_epilogue_used(
            xl["h"].device, torch.bfloat16
        )
        print(f"check large N={args.check_large_n}: fused bf16 vs fp32 {out['large']}", flush=True)
        del xl, ref, got
        free()
    return out


# ----------------------------------------------------------------------------- sweep
def sweep(args: argparse.Namespace, device: str, t_end: float) -> list[dict]:
    cuda = device == "cuda"
    table: list[dict] = []
    fns = variants(device)
    chosen = [v for v in args.variants if v in fns]
    limits = {"fused_chunked_torchpath": args.torchpath_max_n, "dense": args.dense_max_n}
    for vocab, dim in args.configs:
        oomed: set[str] = set()
        for n in args.sizes:
            xs: dict[str, dict] = {}
            for name in chosen:
                row = dict(variant=name, n=n, vocab=vocab, d=dim, k=args.k)
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

                def step(fn: Callable = fns[name], xs: dict = xs, r: dict = row) -> dict:
                    if not xs:  # the inputs, made for the first variant that runs at this N
                        xs["x"] = make_inputs(r["n"], r["d"], r["vocab"], args.k, device)
                    return time_cell(fn, xs["x"], cuda, args.reps, args.cell_cap_s)

                table.append(run_cell(row, step, 6 * n * dim * vocab))
                if table[-1]["status"] == "OOM":
                    oomed.add(name)
            xs.clear()
            free()
    return table


# ----------------------------------------------------------------------------- exact
EXACT_VARIANTS = "topk_fused_chunked topk_floor exact_forward_kl exact_reverse_kl exact_jsd".split()


def exact_inputs(n: int, d: int, vocab: int, k: int, device: str, seed: int = 0) -> dict:
    """Student and teacher of width ``d`` sharing one vocabulary; the top-k targets are the
    teacher's own top-k logprobs (with their tail mass), computed 4096 rows at a time."""
    g = torch.Generator(device=device).manual_seed(seed)
    dt = torch.bfloat16 if device == "cuda" else torch.float32

    def r(*shape: int, s: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * s).to(dt)

    x = dict(h=r(n, d).requires_grad_(), w=r(vocab, d, s=2 / math.sqrt(d)).requires_grad_())
    x.update(ht=r(n, d), wt=r(vocab, d, s=2 / math.sqrt(d)))
    lp = torch.empty(n, k, device=device)
    ids = torch.empty(n, k, dtype=torch.long, device=device)
    with torch.no_grad():
        for s in range(0, n, 4096):
            y = torch.log_softmax((x["ht"][s : s + 4096] @ x["wt"].t()).float(), -1)
            lp[s : s + 4096], ids[s : s + 4096] = y.topk(k, dim=1)
            del y
    x.update(ids=ids, lp=lp, tail=(1 - lp.exp().sum(1)).clamp(0, 1))
    return x


def parse_exact(name: str) -> dict[str, Any]:
    """``exact_<loss>[_torch][_c<rows>][_bf16acc]`` -> the call's options."""
    parts = name[len("exact_") :].split("_")
    opts: dict[str, Any] = {"kernels": "auto", "chunk_size": None, "grad_weight_dtype": "auto"}
    loss = []
    for part in parts:
        if part == "torch":
            opts["kernels"] = "torch"
        elif part == "bf16acc":
            opts["grad_weight_dtype"] = "weight"
        elif part.startswith("c") and part[1:].isdigit():
            opts["chunk_size"] = int(part[1:])
        else:
            loss.append(part)
    opts["loss"] = "_".join(loss)
    return opts


def exact_variant(name: str, chunk: int | None) -> Callable:
    if name == "topk_floor":
        return floor_variant("floor")
    if name == "topk_fused_chunked":

        def topk(x: dict) -> torch.Tensor:
            return topk_distill_loss(
                x["h"], x["w"], x["ids"], x["lp"], x["tail"], impl="fused_chunked", chunk_size=chunk
            )

        return topk
    opts = parse_exact(name)
    opts["chunk_size"] = opts["chunk_size"] or chunk

    def fn(x: dict) -> torch.Tensor:
        return exact_distill_loss(x["h"], x["w"], x["ht"], x["wt"], **opts)

    return fn


def gemm_chunk_ms(c: int, d: int, vocab: int, device: str, cuda: bool) -> float:
    """Median ms of one chunk's four bare GEMMs of the exact loss at ``c`` rows (bf16 on CUDA):
    teacher and student ``[c, d] @ [d, V]``, ``grad_h = [c, V] @ [V, d]``, ``grad_W += [V, c]
    @ [c, d]`` (into a buffer of the weight's dtype)."""
    dt = torch.bfloat16 if cuda else torch.float32
    h = torch.randn(c, d, device=device, dtype=dt)
    ht = torch.randn(c, d, device=device, dtype=dt)
    w = torch.randn(vocab, d, device=device, dtype=dt) * 0.03
    wt = torch.randn(vocab, d, device=device, dtype=dt) * 0.03
    gw = torch.zeros(vocab, d, device=device, dtype=dt)

    def four() -> None:
        torch.mm(ht, wt.t())
        g = torch.mm(h, w.t())
        torch.mm(g, w)
        gw.addmm_(g.t(), h)

    t = median_time(cuda, four, warmup=2)
    free()
    return t * 1e3


def exact_check(device: str) -> list[dict]:
    """Kernels vs torch passes vs a float64 dense reference (every objective, T=2, soft-cap)."""
    out = []
    g = torch.Generator(device=device).manual_seed(7)
    n, d, vocab = 512, 64, 8192
    f64 = torch.float64
    hs = torch.randn(n, d, generator=g, device=device, dtype=f64)
    ws = torch.randn(vocab, d, generator=g, device=device, dtype=f64) * 0.3
    ht = torch.randn(n, d, generator=g, device=device, dtype=f64)
    wt = torch.randn(vocab, d, generator=g, device=device, dtype=f64) * 0.3
    for loss in ("forward_kl", "reverse_kl", "jsd"):
        kw = dict(loss=loss, temperature=2.0, teacher_softcap=5.0, chunk_size=200)
        res = {}
        runs = [("triton", f64), ("triton", torch.bfloat16)] if device == "cuda" else []
        for kernels, dt in [("torch", f64), *runs, ("torch", torch.float32)]:
            a = hs.to(dt).clone().requires_grad_()
            b = ws.to(dt).clone().requires_grad_()
            val = exact_distill_loss(a, b, ht.to(dt), wt.to(dt), kernels=kernels, **kw)
            val.backward()
            assert a.grad is not None and b.grad is not None
            res[f"{kernels}_{str(dt)[6:]}"] = (val.double(), a.grad.double(), b.grad.double())
        ref = res.pop("torch_float64")
        for key, got in res.items():
            names = ("rel_loss", "rel_grad_h", "rel_grad_w")
            row: dict[str, Any] = dict(loss=loss, variant=key)
            row.update({k: rel(a, b) for k, a, b in zip(names, got, ref, strict=True)})
            out.append(row)
            print("check", json.dumps(row), flush=True)
    return out


def exact_mode(args: argparse.Namespace, device: str, rec: Recorder) -> dict[str, Any]:
    """Per config and size: every variant's fwd+bwd time and memory, the bare GEMMs of the same
    shapes, and the exact loss's rate as a fraction of the lm-head GEMM rate."""
    cuda = device == "cuda"
    out: dict[str, Any] = {"rows": [], "gemm": {}}
    if args.check:
        try:
            out["check"] = exact_check(device)
        except Exception as e:  # report it and time what still runs
            out["check_error"] = f"{type(e).__name__}: {str(e)[:500]}"
            print("check failed:", out["check_error"], flush=True)
    for vocab, d in args.configs:
        key = f"{vocab}x{d}"
        gemm = dict(lm_head_tflops=gemm_rate(8192, d, vocab, device, cuda) if cuda else None)
        if cuda:
            gemm["lm_head_tflops_sustained"] = gemm_rate(8192, d, vocab, device, cuda, hold_s=3.0)
        for c in sorted(set(args.gemm_chunks)):
            gemm[f"four_gemms_ms_c{c}"] = gemm_chunk_ms(c, d, vocab, device, cuda)
        out["gemm"][key] = gemm
        print("bare GEMMs", key, json.dumps(gemm), flush=True)
        for n in args.sizes:
            try:
                x = exact_inputs(n, d, vocab, args.k, device)
            except torch.OutOfMemoryError:
                out["rows"].append(dict(n=n, vocab=vocab, d=d, status="OOM (inputs)"))
                free()
                continue
            for name in args.variants:
                row: dict[str, Any] = dict(variant=name, n=n, vocab=vocab, d=d, k=args.k)
                flops = (8 if name.startswith("exact") else 6) * n * d * vocab
                run_cell(row, functools.partial(exact_cell, name, x, args, cuda), flops)
                if row["status"] == "ok":
                    if gemm["lm_head_tflops"]:
                        row["of_lm_head_gemm"] = row["tflops"] / gemm["lm_head_tflops"]
                        sustained = gemm["lm_head_tflops_sustained"]
                        row["of_sustained_gemm"] = row["tflops"] / sustained
                    cfg = {"n": n, "vocab": vocab, "d": d, "k": args.k}
                    rec.add(name, "ms", "ms", row["ms"], samples=len(row["ms_all"]), config=cfg)
                out["rows"].append(row)
            del x
            free()
    add_exact_ratios(out["rows"])
    return out


def exact_cell(name: str, x: dict, args: argparse.Namespace, cuda: bool) -> dict:
    fn = exact_variant(name, args.chunk)
    res = time_cell(fn, x, cuda, args.reps, args.cell_cap_s)
    if not cuda:  # the CPU has no allocator peak: count the tensors the step creates
        from tests.memory_support import LiveBytes

        mode = LiveBytes().known(*x.values())
        with mode:
            fn(x).backward()
        res["tracked_peak_mib"] = mode.peak / (1 << 20)
        x["h"].grad = x["w"].grad = None
    return res


def add_exact_ratios(rows: list[dict]) -> None:
    """Per (config, N): time and memory of every row against the top-k loss of the same run."""
    for r in rows:
        if r.get("status") != "ok":
            continue
        cell = (r["vocab"], r["d"], r["n"])
        mates = [
            m for m in rows if m.get("status") == "ok" and (m["vocab"], m["d"], m["n"]) == cell
        ]
        for base in ("topk_fused_chunked", "topk_floor"):
            b = next((m for m in mates if m["variant"] == base), None)
            if b is None:
                continue
            r[f"ms_vs_{base}"] = r["ms"] / b["ms"]
            if "delta_gib" in r:
                r[f"delta_minus_{base}_gib"] = r["delta_gib"] - b["delta_gib"]


# ----------------------------------------------------------------------------- plots
def loss_series(
    result: Mapping, field: str, vocab: int = 128256, d: int = 4096
) -> dict[str, list[Point]]:
    """``field`` (``peak_gib`` or ``ms``) vs positions per variant of a ``sweep`` result at one
    (vocab, d), cells that did not finish left out."""
    series: dict[str, list[Point]] = {}
    for r in result["sweep"]:
        if r["vocab"] == vocab and r["d"] == d and r["status"] == "ok":
            series.setdefault(r["variant"], []).append((float(r["n"]), float(r[field])))
    return series


def loss_plots(result_json: str | Path, out_dir: str | Path, vocab: int = 128256) -> list[Path]:
    """``loss_memory.png`` and ``loss_time.png`` (every variant vs positions) in ``out_dir``."""
    result = json.loads(Path(result_json).read_text())
    meta = result.get("meta", {})
    note = (
        f"{Path(result_json).name}: {meta.get('device', '')}, torch {meta.get('torch', '')}; "
        f"V={vocab}, d=4096, k=100, fwd+bwd; a variant's line ends where it ran out of memory"
    )
    common = dict(xlabel="positions N", logx=True, logy=True, note=note, size=(7.2, 4.4))
    out = []
    for png, field, what, unit in (
        ("loss_memory.png", "peak_gib", "peak memory", "peak GiB"),
        ("loss_time.png", "ms", "fwd+bwd time", "ms"),
    ):
        title = f"distillation loss: {what} vs positions, every variant"
        series = loss_series(result, field, vocab)
        out.append(line_plot(Path(out_dir) / png, series, title=title, ylabel=unit, **common))  # type: ignore[arg-type]
    return out


def main(argv: list[str] | None = None) -> None:
    ap, sub = suite_parser("loss", __doc__)
    pl = sub.add_parser("plot", help="loss_memory.png and loss_time.png from a result JSON")
    pl.add_argument("result", type=Path)
    pl.add_argument("out_dir", type=Path)
    ints = {"type": lambda s: [int(v) for v in s.split(",")], "nargs": None}
    names = {"type": lambda s: s.split(","), "nargs": None}
    configs = {
        "type": lambda s: [tuple(int(v) for v in c.split("x")) for c in s.split(",")],
        "nargs": None,
    }
    sw = sub.add_parser("sweep", help="every variant x N x config: memory and time")
    ex = sub.add_parser("exact", help="exact loss (teacher hidden + head) vs the top-k loss")
    options(ex, sizes=([32768, 65536, 131072, 262144], None, ints))
    options(ex, variants=(EXACT_VARIANTS, None, names), gemm_chunks=([2048, 4096], None, ints))
    options(ex, check=(False, "kernels vs float64 first"), reps=3)
    options(ex, chunk=(None, "rows per chunk (default: each's)", {"type": int}))
    options(sw, sizes=([4096, 8192, 16384, 32768, 65536, 131072, 262144], None, ints))
    options(sw, c8192_sizes=([32768, 262144], None, ints), check=False)
    options(sw, variants=(DEFAULT_VARIANTS, None, names))
    options(sw, reps=5, torchpath_max_n=32768, dense_max_n=32768, check_n=2048, check_chunk=512)
    options(sw, check_large_n=32768, budget_s=(420.0, "stop starting cells after"))
    for s in (sw, ex):
        options(s, device=None, configs=([(128256, 4096), (201088, 4096)], None, configs), k=100)
        options(s, cell_cap_s=(6.0, "time budget per cell"), out=(None, None, {"type": Path}))
        add_csv_option(s)
    args = ap.parse_args(argv)
    if args.mode == "plot":
        print(*loss_plots(args.result, args.out_dir), sep="\n")
        return
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rec = Recorder("loss", args.mode, csv_path=args.csv)
    t0 = time.time()
    result: dict[str, Any] = {"meta": rec.machine | {"line": machine_line(rec.machine)}}
    print(result["meta"]["line"], flush=True)
    if args.mode == "exact":
        result["exact"] = exact_mode(args, device, rec)
        return rec.finish(result, args.out, indent=1, show=-1)
    if device == "cuda":
        result["gemm_tflops"] = {
            f"{v}x{d}": gemm_rate(8192, d, v, device, True) for v, d in args.configs
        }
        print("bf16 lm-head GEMM TFLOP/s", result["gemm_tflops"], flush=True)
    if args.check:
        result["check"] = check(args, device)
        print(f"check done at {time.time() - t0:.0f} s", flush=True)
    result["sweep"] = sweep(args, device, t0 + args.budget_s)
    for r in result["sweep"]:
        if r["status"] != "ok":
            continue
        cfg = {k: r[k] for k in ("n", "vocab", "d", "k")}
        rec.add(r["variant"], "ms", "ms", r["ms"], samples=len(r["ms_all"]), config=cfg)
        if "peak_gib" in r:
            rec.add(r["variant"], "peak_gib", "GiB", r["peak_gib"], config=cfg)
    result["wall_s"] = time.time() - t0
    rec.finish(result, args.out, indent=1, show=-1)
    print(f"done in {result['wall_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
