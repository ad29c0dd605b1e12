"""Summarise a one-GPU ``ddp_distill.py train`` run and its resumed run (``ddp_gpu.md``).

Reads the ``train`` JSON of the uninterrupted run (checkpointing at step ``N``) and of the run
resumed from that checkpoint, and reports with ``ddp_distill``'s own checks:

* epoch coverage from the delivered tokens (trained steps + drained leftovers, ``coverage``);
* throughput after ``--warmup`` steps (``throughput``: rows/s = supervised positions/s,
  tokens/s = attended positions/s, data-wait share = time in ``next(loader)`` / step time);
* peak GPU memory (``torch.cuda.max_memory_allocated``) and peak RSS;
* resume: steps after ``N`` of both runs, same planned order, same delivered tokens, loss
  difference (``resume_check``).

    python benchmarks/ddp_gpu_summary.py --full full.json --resumed resumed.json \
        --cache-json cache.json --warmup 20 --json ddp_gpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ddp_distill as dd  # noqa: E402
import numpy as np  # noqa: E402


def summarise(full: dict[str, Any], resumed: dict[str, Any], cache: dict[str, Any], warmup: int):
    """The summary dict (see the module docstring)."""
    at = int(full["config"]["checkpoint_at"])
    resumed_warmup = min(warmup, len(resumed["ranks"][0]["log"]) // 2)
    log = full["ranks"][0]["log"]
    shares = [e["data_s"] / e["step_s"] for e in log[warmup:]]
    return {
        "cache": cache,
        "config": full["config"],
        "env": full["env"],
        "steps": len(log),
        "coverage": dd.coverage(full, int(cache["num_sequences"])),
        "coverage_planned": dd.coverage(full, int(cache["num_sequences"]), key="planned"),
        "throughput": dd.throughput(full, warmup),
        "throughput_resumed": dd.throughput(resumed, resumed_warmup),
        "data_wait_share_max_step": max(shares),
        "data_wait_share_p99_step": sorted(shares)[int(0.99 * (len(shares) - 1))],
        "memory": full["ranks"][0]["memory"],
        "resume": dd.resume_check(full, resumed, at),
        "resume_loss_diff": resume_loss_diff(full, resumed),
        "loss_first_last": [log[0]["loss"], log[-1]["loss"]],
        "loss_curve_every_50": [e["loss"] for e in log[::50]],
    }


def resume_loss_diff(full: dict[str, Any], resumed: dict[str, Any]) -> dict[str, float]:
    """|loss(full) - loss(resumed)| over the resumed steps: first step, median, max, max relative.
    The first resumed step runs on the restored weights, so a non-zero first value means the
    checkpoint did not restore them; later values add kernel non-determinism (bf16 on GPU)."""
    a = {e["step"]: e["loss"] for e in full["ranks"][0]["log"]}
    b = {e["step"]: e["loss"] for e in resumed["ranks"][0]["log"]}
    diffs = [abs(a[s] - b[s]) for s in sorted(b)]
    rel = [abs(a[s] - b[s]) / abs(a[s]) for s in sorted(b)]
    return {
        "first": diffs[0],
        "median": float(np.median(diffs)),
        "max": max(diffs),
        "max_rel": max(rel),
    }


def sweep(paths: list[str], warmup: int) -> list[dict[str, Any]]:
    """Throughput + data-wait share + memory of short ``train`` runs (one per worker count)."""
    out = []
    for path in paths:
        run = json.loads(Path(path).read_text())
        log = run["ranks"][0]["log"][warmup:]
        out.append(
            {
                "workers": run["config"]["workers"],
                "steps": run["config"]["steps"],
                "throughput": dd.throughput(run, warmup),
                "data_ms_median": 1000 * float(np.median([e["data_s"] for e in log])),
                "memory": run["ranks"][0]["memory"],
            }
        )
    return out


def table(s: dict[str, Any]) -> str:
    """A short markdown table of the summary."""
    tp, cov, rs, mem = s["throughput"], s["coverage"], s["resume"], s["memory"]
    rows = [
        ("steps (one epoch)", f"{s['steps']}"),
        ("tokens/s (rows/s)", f"{tp['tokens_per_s']:,.0f} ({tp['rows_per_s']:,.0f})"),
        ("median step", f"{tp['step_ms_median']:.1f} ms"),
        ("peak GPU memory", f"{mem.get('peak_gpu_gib')} GiB (peak RSS {mem['peak_rss_mib']} MiB)"),
        (
            "data-wait share",
            f"{100 * tp['data_wait_share_per_rank'][0]:.2f}% overall, p99 step "
            f"{100 * s['data_wait_share_p99_step']:.2f}%, worst step "
            f"{100 * s['data_wait_share_max_step']:.1f}%",
        ),
        (
            "epoch coverage",
            f"{cov['sequences_per_rank']} sequences, dup {cov['duplicates_within_ranks']}, "
            f"missing {cov['missing']}, foreign {cov['foreign']}, exactly once "
            f"{cov['exactly_once']}; trained {cov['trained_per_rank']}",
        ),
        (
            f"resume at step {rs['checkpoint_step']}",
            f"{rs['resumed_steps_per_rank']} steps, same order {rs['same_order_per_rank']}, "
            f"same tokens {rs['same_tokens_per_rank']}, max |loss diff| {rs['max_abs_loss_diff']}",
        ),
        ("loss first -> last", f"{s['loss_first_last'][0]:.4f} -> {s['loss_first_last'][1]:.4f}"),
    ]
    return "| figure | value |\n|---|---|\n" + "".join(f"| {a} | {b} |\n" for a, b in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", required=True)
    parser.add_argument("--resumed", required=True)
    parser.add_argument("--cache-json", required=True, help="ddp_gpu_cache.py --json output")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--json", default="")
    parser.add_argument("--sweep", nargs="*", default=[], help="train JSONs of a workers sweep")
    parser.add_argument("--sweep-json", default="")
    args = parser.parse_args()
    load = lambda p: json.loads(Path(p).read_text())  # noqa: E731
    s = summarise(load(args.full), load(args.resumed), load(args.cache_json), args.warmup)
    text = table(s)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(s, indent=1) + "\n")
    if args.sweep:
        rows = sweep(args.sweep, args.warmup)
        for r in rows:
            tp = r["throughput"]
            print(
                f"workers {r['workers']}: {tp['tokens_per_s']:,.0f} tokens/s, data wait "
                f"{100 * tp['data_wait_share_per_rank'][0]:.1f}% ({r['data_ms_median']:.2f} ms "
                f"median per step), median step {tp['step_ms_median']:.1f} ms"
            )
        if args.sweep_json:
            Path(args.sweep_json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
