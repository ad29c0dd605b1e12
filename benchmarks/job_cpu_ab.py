"""Alternating A/B rounds of ``job_cpu_bench.py`` between two source trees (issue #19).

Each tree is a directory holding the project's packages (``cache_format/``, ``server/``, ...),
such as a commit exported with ``git archive``; every run is a fresh process of *this* checkout's
``benchmarks/job_cpu_bench.py`` run through ``benchmarks/run_with_tree.py`` (the editable
install's ``MAPPING`` pointed at that tree before anything of the project is imported), so both
trees run the same bench script. Rounds
alternate which tree goes first (odd rounds: ``--a`` first); each round runs, per tree, one
process per ``--prefill`` value. Every run's JSON is kept, and a summary (median and min per
tree, prefill and k; the median paired difference; in how many rounds B was lower) printed and
written. The figures are process CPU time (``getrusage``), as the bench measures them.

Usage (the session 8 measurement, benchmarks/results/job_cpu_s8.md)::

    git archive <base> | tar -x -C /tmp/base
    git archive <new> | tar -x -C /tmp/new
    .venv/bin/python benchmarks/job_cpu_ab.py --a /tmp/base --b /tmp/new --rounds 10 \\
        --prefill 1600 0 --out /tmp/ab -- --k 20 100 --repeats 1 --sequences 512
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent / "job_cpu_bench.py"
RUN_WITH_TREE = Path(__file__).resolve().parent / "run_with_tree.py"


def run_one(tree: Path, bench_args: list[str], prefill: int, out: Path) -> dict:
    """One bench process over ``tree``; its JSON."""
    cmd = [sys.executable, str(RUN_WITH_TREE), str(tree), str(BENCH), *bench_args]
    cmd += ["--prefill", str(prefill), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench failed ({tree}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def _job(run: dict) -> str:
    """Which timed job of its process a run is, when the bench ran more than one per k
    (``--repeats``): ``first`` (the process's first job of that size: it also grows the kept
    buffers, once per process) or ``later``; ``all`` for runs without the field."""
    rep = run.get("rep")
    return "all" if rep is None else "first" if rep == 0 else "later"


def summarize(runs: list[dict]) -> dict:
    """Per prefill, k and job (:func:`_job`): each tree's per-round figures (the median of a
    round's runs), median and min; B - A paired."""
    runs = _per_round(runs)
    out: dict = {}
    keys = sorted({(r["prefill"], r["k"], _job(r)) for r in runs})
    for prefill, k, job in keys:
        sel = [r for r in runs if r["prefill"] == prefill and r["k"] == k and _job(r) == job]
        by = {t: sorted((r for r in sel if r["tree"] == t), key=lambda r: r["round"]) for t in "ab"}
        a = [r["us_per_position"] for r in by["a"]]
        b = [r["us_per_position"] for r in by["b"]]
        diffs = [y - x for x, y in zip(a, b, strict=False)]
        stages = {
            t: {
                n: statistics.median(r["stage_us_per_position"][n] for r in by[t])
                for n in by[t][0]["stage_us_per_position"]
            }
            for t in "ab"
            if by[t]
        }
        out[f"prefill={prefill} k={k}" + ("" if job == "all" else f" {job}")] = {
            "a_rounds": a,
            "b_rounds": b,
            "a_median": statistics.median(a),
            "b_median": statistics.median(b),
            "a_min": min(a),
            "b_min": min(b),
            "a_sys_median": statistics.median(r["sys_us_per_position"] for r in by["a"]),
            "b_sys_median": statistics.median(r["sys_us_per_position"] for r in by["b"]),
            "median_paired_diff": statistics.median(diffs),
            "b_lower_rounds": sum(d < 0 for d in diffs),
            "rounds": len(diffs),
            "median_stages": stages,
            "load_1min": [r["load_avg_1min_before"] for r in sel],
        }
    return out


def _per_round(runs: list[dict]) -> list[dict]:
    """One run per (round, tree, prefill, k, job): the later jobs of a round folded into their
    median run (the run at the median figure)."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["round"], r["tree"], r["prefill"], r["k"], _job(r)), []).append(r)
    out = []
    for sel in groups.values():
        sel = sorted(sel, key=lambda r: r["us_per_position"])
        out.append(sel[(len(sel) - 1) // 2])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", type=Path, required=True, help="tree A (the base)")
    p.add_argument("--b", type=Path, required=True, help="tree B (the change)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--prefill", type=int, nargs="+", default=[1600, 0])
    p.add_argument("--out", type=Path, required=True, help="directory for every run's JSON")
    p.add_argument("--json", type=Path, default=None, help="the summary (default: OUT/ab.json)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: job_cpu_bench args")
    args = p.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    for rnd in range(1, args.rounds + 1):
        order = "ab" if rnd % 2 else "ba"
        for tree in order:
            root = (args.a if tree == "a" else args.b).resolve()
            for prefill in args.prefill:
                path = args.out / f"r{rnd:02d}-{tree}-p{prefill}.json"
                res = run_one(root, bench_args, prefill, path)
                seen_k: dict[int, int] = {}
                for r in res["runs"]:
                    keep = {n: v for n, v in r.items() if n != "thread_cpu_s"}
                    rep = seen_k[r["k"]] = seen_k.get(r["k"], -1) + 1  # 0: the process's first
                    runs.append(
                        {"round": rnd, "tree": tree, "prefill": prefill, "rep": rep, **keep}
                    )
                    print(
                        f"round {rnd} {tree} prefill {prefill} k={r['k']}: "
                        f"{r['us_per_position']:.2f} (sys {r['sys_us_per_position']:.2f}) "
                        f"load {r['load_avg_1min_before']:.1f}  {time.strftime('%H:%M:%S')}",
                        flush=True,
                    )
    summary = summarize(runs)
    for name, s in summary.items():
        print(
            f"{name}: A median {s['a_median']:.2f} (min {s['a_min']:.2f}), B median "
            f"{s['b_median']:.2f} (min {s['b_min']:.2f}), paired diff "
            f"{s['median_paired_diff']:+.2f}, B lower in {s['b_lower_rounds']} of {s['rounds']}"
        )
    result = {
        "command": " ".join(["python", "benchmarks/job_cpu_ab.py", *sys.argv[1:]]),
        "bench_command": " ".join(["python", "benchmarks/job_cpu_bench.py", *bench_args]),
        "a": str(args.a),
        "b": str(args.b),
        "machine": f"{os.cpu_count()} CPU cores (shared), no GPU",
        "runs": runs,
        "summary": summary,
    }
    (args.json or args.out / "ab.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
