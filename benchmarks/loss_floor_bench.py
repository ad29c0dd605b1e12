"""Issue #20 on one GPU: the loss at the memory floor, vocab-parallel (world 1), sampled targets.

One command does, in order (JSON to ``--out``, PNG plot next to it when matplotlib imports):

1. Baselines: the bf16 lm-head GEMM ``[8192 x d] @ [d x V]`` of every config (the ratio
   baseline, measured in the same run).
2. Checks (fresh random inputs, relative errors ``||x - ref|| / ||ref||``):
   * Triton fused paths vs a float64 dense reference at N=2048 for top-k and ``targets="sampled"``
     rows (with ``-inf`` padding), for both ``grad_weight_dtype`` settings;
   * the vocab-parallel code path in a real ``torch.distributed`` NCCL group of one rank vs the
     single-device loss (same inputs), and its time beside it;
   * grad_W at the largest N vs a float64 computation on the bf16 inputs, for every variant.
3. Sweep: every variant x N for each config (``V, d``), forward + backward of the mean forward KL
   (the problem of ``loss_bench.py``); peak memory, median time, TFLOP/s (6NdV), % of GEMM.

Variants (all ours, ``impl="fused_chunked"``, Triton on CUDA):

* ``fp32acc``: grad_W accumulated in fp32, 1 GiB logits chunk (the previous default);
* ``bf16acc``: grad_W chunks added straight into the bf16 grad buffer, 1 GiB chunk;
* ``floor``: bf16 accumulation and a 512 MiB chunk (2048 rows at V=128256);
* ``floor_c<R>``: the same with an ``R``-row chunk (2016, 1984, 1920, 1792).

``--anatomy VARIANT`` adds one step of that variant at ``--large-n`` under
:class:`loss_memory.LiveBytes`: the tensors alive at the peak, and the allocator's peak beside the
tracked one (the difference is memory that is no tensor, e.g. cuBLAS workspaces).

    python benchmarks/loss_floor_bench.py --out $OUT/loss_floor.json            # on the GPU
    python benchmarks/loss_floor_report.py benchmarks/results/loss_floor.json   # PNG + tables
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loss_bench import (  # noqa: E402  (also puts the package on the path)
    Timer,
    free,
    gemm_rate,
    make_inputs,
    rel,
    time_cell,
    topk_distill_loss,
)
from loss_floor_report import plot, tables  # noqa: E402
from loss_memory import LiveBytes  # noqa: E402

loss_pkg = sys.modules[topk_distill_loss.__module__.rsplit(".", 1)[0]]
chunk_ops = sys.modules[loss_pkg.__name__ + ".chunk_ops"]

CONFIGS = [(128256, 4096), (201088, 4096), (128256, 8192)]
DEVICE = "cuda"  # --device cpu with tiny --configs is a smoke test of this script
VARIANTS = {
    "fp32acc": dict(grad_weight_dtype="float32", budget=1 << 30),
    "bf16acc": dict(grad_weight_dtype="weight", budget=1 << 30),
    "floor": dict(grad_weight_dtype="weight", budget=1 << 29),
    "floor_c2016": dict(grad_weight_dtype="weight", rows=2016),
    "floor_c1984": dict(grad_weight_dtype="weight", rows=1984),
    "floor_c1920": dict(grad_weight_dtype="weight", rows=1920),
    "floor_c1792": dict(grad_weight_dtype="weight", rows=1792),
}
#: what the sweep runs (``--variants``); ``floor_c1792`` only in the follow-up run
SWEEP_VARIANTS = ["fp32acc", "bf16acc", "floor"]


def chunk_for(vocab: int, budget: int) -> int:
    """Rows per chunk for a bf16 ``[C, V]`` buffer of ``budget`` bytes (multiple of 256)."""
    return max(256, budget // (2 * vocab) // 256 * 256)


def variant_fn(name: str, vocab: int, **extra: Any):
    opts = VARIANTS[name]
    chunk = opts["rows"] if "rows" in opts else chunk_for(vocab, opts["budget"])

    def fn(x: dict) -> torch.Tensor:
        return topk_distill_loss(
            x["h"],
            x["w"],
            x["ids"],
            x["lp"],
            chunk_size=chunk,
            grad_weight_dtype=opts["grad_weight_dtype"],
            **extra,
        )

    return fn, chunk


def grads(fn, x: dict) -> tuple[float, torch.Tensor, torch.Tensor]:
    x["h"].grad = x["w"].grad = None
    loss = fn(x)
    loss.backward()
    out = (loss.item(), x["h"].grad.detach().clone(), x["w"].grad.detach().clone())
    x["h"].grad = x["w"].grad = None
    return out


def as64(x: dict) -> dict:
    return {
        "h": x["h"].detach().double().requires_grad_(),
        "w": x["w"].detach().double().requires_grad_(),
        "ids": x["ids"],
        "lp": x["lp"],
    }


def sampled_inputs(x: dict, m: int, seed: int) -> dict:
    """Sampled rows with the shape of ``x``'s top-k rows: weights from the teacher logprobs
    (renormalised), one id in five padded with ``-inf``."""
    g = torch.Generator(device=x["lp"].device).manual_seed(seed)
    lw = torch.log_softmax(
        x["lp"][:, :m] + torch.rand(x["lp"][:, :m].shape, generator=g, device=x["lp"].device), -1
    )
    pad = torch.rand(lw.shape, generator=g, device=lw.device) < 0.2
    pad[:, 0] = False
    lw = torch.log_softmax(lw.masked_fill(pad, float("-inf")), -1)
    return {**x, "ids": x["ids"][:, :m].contiguous(), "lp": lw}


def check_small(n: int, vocab: int, d: int, k: int) -> list[dict]:
    """Triton fused paths vs float64 dense, for top-k and sampled rows."""
    out = []
    x = make_inputs(n, d, vocab, k, DEVICE, seed=11)
    for targets in ("topk", "sampled"):
        xt = x if targets == "topk" else sampled_inputs(x, k, seed=12)
        ref = grads(
            lambda z, t=targets: topk_distill_loss(
                z["h"], z["w"], z["ids"], z["lp"], impl="dense", targets=t
            ),
            as64(xt),
        )
        for impl in ("fused_chunked", "fused_chunked_recompute", "forward_chunked"):
            for acc in ("float32", "weight"):
                if impl == "forward_chunked" and acc == "weight":
                    continue
                got = grads(
                    lambda z, i=impl, a=acc, t=targets: topk_distill_loss(
                        z["h"],
                        z["w"],
                        z["ids"],
                        z["lp"],
                        impl=i,
                        targets=t,
                        grad_weight_dtype=a,
                        chunk_size=512,
                    ),
                    xt,
                )
                row = dict(
                    targets=targets,
                    impl=impl,
                    grad_weight_dtype=acc,
                    n=n,
                    vocab=vocab,
                    loss=got[0],
                    loss_ref=ref[0],
                    rel_loss=abs(got[0] - ref[0]) / abs(ref[0]),
                    rel_grad_h=rel(got[1], ref[1]),
                    rel_grad_w=rel(got[2], ref[2]),
                    finite=bool(torch.isfinite(got[1]).all() and torch.isfinite(got[2]).all()),
                    triton=chunk_ops.use_triton("auto", x["h"].device),
                )
                out.append(row)
                print(
                    "check",
                    {k2: (round(v, 8) if isinstance(v, float) else v) for k2, v in row.items()},
                    flush=True,
                )
        del ref
        free()
    return out


def check_vocab_parallel_world1(n: int, vocab: int, d: int, k: int, timer: Timer) -> dict:
    """The vocab-parallel path in an NCCL group of one rank vs the single-device path."""
    import torch.distributed as dist

    VocabParallel = loss_pkg.VocabParallel
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if DEVICE == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{29500 + os.getpid() % 1000}",
            rank=0,
            world_size=1,
        )
    x = make_inputs(n, d, vocab, k, DEVICE, seed=21)
    res: dict[str, Any] = {"n": n, "vocab": vocab, "d": d, "world": dist.get_world_size()}
    for targets in ("topk", "sampled"):
        xt = x if targets == "topk" else sampled_inputs(x, k, seed=22)

        def single(z, t=targets):
            return topk_distill_loss(z["h"], z["w"], z["ids"], z["lp"], targets=t)

        def vp(z, t=targets):
            return topk_distill_loss(
                z["h"], z["w"], z["ids"], z["lp"], targets=t, vocab_parallel=VocabParallel()
            )

        a, b = grads(single, xt), grads(vp, xt)
        res[targets] = dict(
            loss_single=a[0],
            loss_vp=b[0],
            rel_loss=abs(a[0] - b[0]) / abs(a[0]),
            rel_grad_h=rel(b[1], a[1]),
            rel_grad_w=rel(b[2], a[2]),
            bitwise=bool(a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])),
        )
        print("vp world 1", targets, res[targets], flush=True)
        if targets == "topk":
            res["ms_single"] = time_cell(single, xt, timer, 5, 4.0)["ms"]
            res["ms_vp"] = time_cell(vp, xt, timer, 5, 4.0)["ms"]
            print("vp world 1 ms", res["ms_single"], res["ms_vp"], flush=True)
    del x
    free()
    return res


def check_large(n: int, vocab: int, d: int, k: int) -> dict:
    """grad_W / grad_h / loss of every variant at large N vs float64 on the same bf16 inputs."""
    x = make_inputs(n, d, vocab, k, DEVICE, seed=31)
    t0 = time.time()
    x64 = as64(x)
    ref_fn = lambda z: topk_distill_loss(  # noqa: E731
        z["h"], z["w"], z["ids"], z["lp"], chunk_size=1024, kernels="torch"
    )
    ref = grads(ref_fn, x64)
    del x64
    free()
    out: dict[str, Any] = {"n": n, "vocab": vocab, "d": d, "ref_s": time.time() - t0}
    for name in VARIANTS:
        fn, chunk = variant_fn(name, vocab)
        got = grads(fn, x)
        out[name] = dict(
            chunk=chunk,
            n_chunks=math.ceil(n / chunk),
            rel_loss=abs(got[0] - ref[0]) / abs(ref[0]),
            rel_grad_h=rel(got[1], ref[1]),
            rel_grad_w=rel(got[2], ref[2]),
        )
        print("large check", name, out[name], flush=True)
        del got
        free()
    del x, ref
    free()
    return out


def anatomy(name: str, n: int, vocab: int, d: int, k: int) -> dict:
    """One fwd+bwd step of ``name`` at ``n`` under :class:`LiveBytes` (after one warm-up step)."""
    x = make_inputs(n, d, vocab, k, DEVICE, seed=41)
    fn, chunk = variant_fn(name, vocab)
    grads(fn, x)  # warm-up: kernels compiled, cuBLAS workspaces allocated
    free()
    cuda = DEVICE == "cuda"
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    mode = LiveBytes().known(*x.values())
    with mode:
        loss = fn(x)
        loss.backward()
    out: dict[str, Any] = {"variant": name, "n": n, "vocab": vocab, "d": d, "chunk": chunk}
    out.update(mode.report())
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        out.update(
            base_bytes=base,
            allocator_peak_bytes=peak,
            allocator_over_base_bytes=peak - base,
            not_tensors_bytes=peak - base - mode.peak,
        )
    x["h"].grad = x["w"].grad = None
    del x, loss
    free()
    print("anatomy", json.dumps(out), flush=True)
    return out


def sweep(
    sizes: list[int], k: int, timer: Timer, t_end: float, reps: int, cap: float
) -> list[dict]:
    table = []
    for vocab, d in CONFIGS:
        for n in sizes:
            x = None
            for name in SWEEP_VARIANTS:
                fn, chunk = variant_fn(name, vocab)
                row = dict(variant=name, n=n, vocab=vocab, d=d, k=k, chunk=chunk)
                if time.time() > t_end:
                    table.append({**row, "status": "not run (time cap)"})
                    continue
                try:
                    if x is None:
                        x = make_inputs(n, d, vocab, k, DEVICE)
                    res = time_cell(fn, x, timer, reps, cap)
                    res["tflops"] = 6 * n * d * vocab / (res["ms"] / 1e3) / 1e12
                    table.append({**row, "status": "ok", **res})
                    print(
                        f"{name:8s} V={vocab} d={d} N={n:7d} {res['ms']:9.1f} ms "
                        f"{res['tflops']:6.1f} TF/s peak {res.get('peak_gib', 0):6.2f} GiB",
                        flush=True,
                    )
                except torch.OutOfMemoryError:
                    table.append({**row, "status": "OOM"})
                finally:
                    if x is not None:
                        x["h"].grad = x["w"].grad = None
                    free()
            del x
            free()
    return table


def main() -> None:
    global DEVICE, CONFIGS, SWEEP_VARIANTS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--sizes",
        type=lambda s: [int(v) for v in s.split(",")],
        default=[4096, 8192, 16384, 32768, 65536, 131072, 262144],
    )
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--cell-cap-s", type=float, default=5.0)
    ap.add_argument("--budget-s", type=float, default=440.0)
    ap.add_argument("--check-n", type=int, default=2048)
    ap.add_argument("--large-n", type=int, default=262144)
    ap.add_argument("--vp-n", type=int, default=32768)
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variants", default=",".join(SWEEP_VARIANTS))
    ap.add_argument("--configs", default=None, help="VxD,... (default: the three of the issue)")
    ap.add_argument("--anatomy", default=None, help="a variant: tensors alive at its peak")
    args = ap.parse_args()

    t0 = time.time()
    DEVICE = args.device
    SWEEP_VARIANTS = args.variants.split(",")
    if args.configs:
        CONFIGS = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    timer = Timer(DEVICE)
    try:
        import triton
    except ImportError:
        triton = None

    result: dict[str, Any] = {
        "meta": dict(
            argv=sys.argv,
            torch=torch.__version__,
            triton=getattr(triton, "__version__", None),
            python=platform.python_version(),
            device=torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        ),
        "k": args.k,
    }
    print(result["meta"], flush=True)
    result["configs"] = CONFIGS
    result["gemm_tflops"] = {f"{v}x{d}": gemm_rate(8192, d, v, DEVICE, timer) for v, d in CONFIGS}
    print("bf16 lm-head GEMM TFLOP/s", result["gemm_tflops"], flush=True)
    if not args.skip_checks:
        result["check_small"] = check_small(args.check_n, CONFIGS[0][0], CONFIGS[0][1], args.k)
        result["check_vp_world1"] = check_vocab_parallel_world1(
            args.vp_n, CONFIGS[0][0], CONFIGS[0][1], args.k, timer
        )
        if args.large_n:
            result["check_large"] = check_large(args.large_n, CONFIGS[0][0], CONFIGS[0][1], args.k)
        print(f"checks done at {time.time() - t0:.0f} s", flush=True)
    if args.out:  # keep the checks even if the sweep dies
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    result["sweep"] = sweep(
        args.sizes, args.k, timer, t0 + args.budget_s, args.reps, args.cell_cap_s
    )
    if args.anatomy:
        vocab, d = CONFIGS[0]
        result["anatomy"] = anatomy(args.anatomy, args.large_n, vocab, d, args.k)
    result["wall_s"] = time.time() - t0
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
        print("plot:", plot(result, args.out.with_suffix(".png")))
    print(tables(result))
    print(f"done in {result['wall_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
