"""The distillation comparison of issue #12 over two seeds; writes the committed results pages.

    .venv/bin/python benchmarks/distill_bench.py            # seeds 0 and 1, default plan
    .venv/bin/python benchmarks/distill_bench.py --parallel -- --steps 60 --reuse-cache
                                     # seeds as concurrent processes; args after -- go on

Runs ``examples/distill.py`` once per seed (the seed sets the data order of every method and
the sampled targets' draws; the student init and the scored cache are shared), each run writing
its own report under ``--workdir`` (default ``runs/distill-bench``), then combines them into
``benchmarks/results/distill.json`` and ``distill.md``: per method the mean over seeds of the
held-out KL(teacher || student), ppl, top-1 ECE, step time and bytes/position, the per-seed KL,
and the goals judged on the seed means (and per seed). This command is the only writer of those
pages; the demo writes under ``runs/``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from distill_report import add_ratios, goal_lines, goals, label  # noqa: E402

OUT_JSON = ROOT / "benchmarks/results/distill.json"
OUT_MD = ROOT / "benchmarks/results/distill.md"
AVERAGED = ("kl", "ppl", "ece", "step_ms_median", "bytes_per_position", "mean_distinct_ids")


def combine(reports: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Seed means of every method present in all reports (``kl_by_seed`` keeps each seed's)."""
    names = [m for m in reports[0]["methods"] if all(m in r["methods"] for r in reports)]
    out: dict[str, dict[str, Any]] = {}
    for m in names:
        runs = [r["methods"][m] for r in reports]
        row: dict[str, Any] = {
            k: statistics.fmean(x[k] for x in runs) for k in AVERAGED if k in runs[0]
        }
        row["kl_by_seed"] = [x["kl"] for x in runs]
        if all("online_kd" in r["methods"] for r in reports):
            row["kl_vs_online_by_seed"] = [
                x["kl"] / r["methods"]["online_kd"]["kl"] - 1.0
                for x, r in zip(runs, reports, strict=True)
            ]
        row["budget"] = runs[0].get("budget")
        out[m] = row
    add_ratios(out)
    return out


def markdown(reports: list[dict[str, Any]], methods: dict[str, dict[str, Any]]) -> str:
    r0 = reports[0]
    seeds = [r["train"]["seed"] for r in reports]
    c = r0["cache"]
    lines = [
        "# Distillation from the cache vs online KD (tiny local teacher, issue #12)",
        "",
        f"- command: `python benchmarks/distill_bench.py {' '.join(sys.argv[1:])}` "
        f"(per seed: `{r0['command']}` with `--seed`)",
        f"- machine: {r0['machine']} (shared with other jobs: step times are medians of "
        "interleaved steps, so every method is slowed alike)",
        f"- teacher {r0['models']['teacher_params']:,} params, student "
        f"{r0['models']['student_params']:,} params, vocab {r0['models']['vocab_size']}; "
        f"teacher temperature {r0['plan']['teacher_temperature']}; teacher held-out ppl "
        f"{r0['heldout']['teacher_ppl']:.2f} on the eval windows",
        f"- scored cache: {c['num_sequences']} sequences, {c['num_rows']:,} rows, k={c['k']}, "
        f"teacher mass in the top-k {c['mean_topk_mass']:.3f}, "
        f"{c['bytes_per_position']:.0f} B/position; offline caches derived per budget "
        f"({', '.join(f'{b:g}' for b in r0['plan']['budgets'])} B/position)",
        f"- training: {r0['train']['steps']} steps x {r0['train']['batch_items']} x "
        f"{r0['train']['tokens_per_item']} tokens, AdamW lr {r0['train']['lr']}; seeds "
        f"{seeds} (data order + sampling); same init; held-out "
        f"{r0['heldout']['positions']:,} positions, full-vocabulary KL",
        "",
        "| method | B/pos | held-out KL (mean) | KL per seed | vs online KD | vs online KD, "
        "per seed (paired) | ppl | top-1 ECE | step ms | step vs online |",
        "|---|---:|---:|---|---:|---|---:|---:|---:|---:|",
    ]
    for name, r in methods.items():
        b = r.get("bytes_per_position")
        extra = ""
        if "mean_distinct_ids" in r:
            extra = f" ({r['mean_distinct_ids']:.1f} distinct ids/row)"
        lines.append(
            f"| {label(name)}{extra} | {'' if b is None else f'{b:.0f}'} | {r['kl']:.4f} | "
            f"{', '.join(f'{x:.4f}' for x in r['kl_by_seed'])} | "
            f"{100 * r.get('kl_vs_online', 0):+.1f}% | "
            f"{', '.join(f'{100 * x:+.1f}%' for x in r.get('kl_vs_online_by_seed', []))} | "
            f"{r['ppl']:.2f} | {r['ece']:.4f} | "
            f"{r['step_ms_median']:.0f} | {r.get('step_time_vs_online', 0):.2f}x |"
        )
    lines += ["", "On the seed means:", "", *goal_lines(goals(methods)), "", "Per seed:", ""]
    for rep in reports:
        lines += [f"- seed {rep['train']['seed']}: " + " ".join(goal_lines(rep["goals"]))]
    lines += ["", *[f"- {n}" for n in r0["notes"]], *[f"- {n}" for n in spread_notes(methods)]]
    lines.append(f"- {OLD_PAGES_NOTE}")
    return "\n".join(lines) + "\n"


#: The sharpened-teacher pages beside this one predate the 1024-token default teacher.
OLD_PAGES_NOTE = (
    "the sharpened-teacher pages `distill_T0.45*.md`, `distill_T0.55*.md`, `distill_T0.6*.md` "
    "beside this one were measured on the earlier default teacher (fixture recipe `v2`, vocab "
    "4096, top-100 mass 0.78), not on the teacher of this page"
)


def spread_notes(methods: dict[str, dict[str, Any]]) -> list[str]:
    """How far apart the seeds are: online KD's KL per seed against the gaps between methods."""
    online = methods.get("online_kd")
    if online is None or len(online["kl_by_seed"]) < 2:
        return []
    kls = online["kl_by_seed"]
    spread = (max(kls) - min(kls)) / statistics.fmean(kls)
    gaps = [abs(r["kl_vs_online"]) for m, r in methods.items() if m != "online_kd"]
    return [
        f"seed-to-seed spread of online KD's held-out KL: {min(kls):.4f} to {max(kls):.4f} "
        f"({100 * spread:.0f}% of the mean); the offline methods' gaps to online KD on the means "
        f"are {100 * min(gaps):.1f}% to {100 * max(gaps):.1f}%: the paired per-seed column "
        "compares each method with online KD on the same data order"
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--workdir", type=Path, default=ROOT / "runs/distill-bench")
    p.add_argument("--out-json", type=Path, default=OUT_JSON)
    p.add_argument("--out-md", type=Path, default=OUT_MD)
    p.add_argument(
        "--parallel",
        action="store_true",
        help="run the seeds as concurrent subprocesses (they share the scored and top-k caches; "
        "the writer lock serialises their appends and known keys are skipped)",
    )
    p.add_argument(
        "--combine-only", action="store_true", help="only combine existing per-seed reports"
    )
    args, rest = p.parse_known_args(argv)
    rest = [a for a in rest if a != "--"]
    seeds = [int(s) for s in args.seeds.split(",")]

    def seed_args(seed: int) -> list[str]:
        out = args.workdir / f"seed{seed}"
        return [
            "--workdir",
            str(args.workdir),
            "--seed",
            str(seed),
            "--out-json",
            str(out / "distill.json"),
            "--out-md",
            str(out / "distill.md"),
            *rest,
        ]

    if args.combine_only:
        pass
    elif args.parallel:
        import subprocess

        procs = [
            subprocess.Popen([sys.executable, str(ROOT / "examples/distill.py"), *seed_args(s)])
            for s in seeds
        ]
        codes = [proc.wait() for proc in procs]
        if any(codes):
            raise SystemExit(f"a seed run failed: exit codes {codes}")
    else:
        import distill

        for seed in seeds:
            distill.main(seed_args(seed))
    reports = [json.loads((args.workdir / f"seed{s}" / "distill.json").read_text()) for s in seeds]
    methods = combine(reports)
    result = {"seeds": reports, "mean": methods, "goals": goals(methods)}
    args.out_json.write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(reports, methods)
    args.out_md.write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
