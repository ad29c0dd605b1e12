"""The distillation comparison over paired seeds; writes the committed results pages.

    python -m experiments.distill plot experiments/results/distill_exact.json \\
        experiments/results/distill_kl_bytes.png      # every family and the exact point

    python -m experiments.distill            # seeds 0 and 1, default plan
    python -m experiments.distill --parallel -- --steps 60 --reuse-cache
                                     # seeds as concurrent processes; args after -- go on

Runs ``examples/distill.py`` once per seed (the seed sets the data order of every method and
the sampled targets' draws; the student init and the scored cache are shared), each run writing
its own report under ``--workdir`` (default ``runs/distill-bench``), then combines them into
``experiments/results/distill.json`` and ``distill.md``: per method the mean over seeds of the
held-out KL(teacher || student), ppl, top-1 ECE, step time and bytes/position, the per-seed KL,
and the goals judged on the seed means (and per seed). This command is the only writer of those
pages; the demo writes under ``runs/``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.harness import ROOT, Point, line_plot
from examples.distill_report import add_ratios, goal_lines, goals, label

OUT_JSON = ROOT / "experiments/results/distill.json"
OUT_MD = ROOT / "experiments/results/distill.md"
AVERAGED = (
    "kl",
    "ppl",
    "ece",
    "step_ms_median",
    "step_cpu_ms_median",
    "bytes_per_position",
    "mean_distinct_ids",
    "mean_batch_columns",
    "selected_share",
)


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
        if all("step_time_vs_online" in x for x in runs):
            row["step_time_vs_online_by_seed"] = [x["step_time_vs_online"] for x in runs]
        if all("online_kd" in r["methods"] for r in reports):
            row["kl_vs_online_by_seed"] = [
                x["kl"] / r["methods"]["online_kd"]["kl"] - 1.0
                for x, r in zip(runs, reports, strict=True)
            ]
        row["budget"] = runs[0].get("budget")
        out[m] = row
    add_ratios(out)
    return out


def shown_args(argv: list[str]) -> str:
    """The command line for the page, with the ``--intro`` paragraphs left out (they are on it)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--intro":
            skip = True
        elif not a.startswith("--intro="):
            out.append(a)
    return shlex.join(out)


def paired_gap(row: dict[str, Any]) -> tuple[float, float] | None:
    """Mean and standard error over seeds of a method's paired KL gap to online KD (``None``
    with fewer than two seeds)."""
    gaps = row.get("kl_vs_online_by_seed") or []
    if len(gaps) < 2:
        return None
    return statistics.fmean(gaps), statistics.stdev(gaps) / len(gaps) ** 0.5


def paired_goal2_lines(methods: dict[str, dict[str, Any]], g: dict[str, Any]) -> list[str]:
    """Goal 2 per seed: sampled's KL relative to top-k + tail's on the same data order, with
    the mean and standard error over seeds, per budget (seeds differ more than the methods)."""
    out = []
    for pair in g.get("sampled_vs_tail", {}).get("pairs", []):
        a = methods[pair["sampled"]]["kl_by_seed"]
        b = methods[pair["topk_tail"]]["kl_by_seed"]
        if len(a) < 2:
            continue
        d = [x / y - 1.0 for x, y in zip(a, b, strict=True)]
        se = statistics.stdev(d) / len(d) ** 0.5
        out.append(
            f"~{pair['budget']:g} B/pos: `{pair['sampled']}` vs `{pair['topk_tail']}` per seed "
            f"{', '.join(f'{100 * x:+.1f}%' for x in d)}; mean {100 * statistics.fmean(d):+.1f}% "
            f"(standard error {100 * se:.1f} points)"
        )
    if not out:
        return []
    return [
        "Paired per-seed KL of sampled vs top-k + tail (negative: sampled better): "
        + "; ".join(out)
        + "."
    ]


#: Two-sided 95% Student t quantiles by degrees of freedom (df > 30 uses df = 30's: wider).
T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def paired_stats(gaps: list[float]) -> dict[str, float]:
    """Mean, standard error and the two-sided 95% t interval of paired per-seed gaps."""
    n = len(gaps)
    mean = statistics.fmean(gaps)
    se = statistics.stdev(gaps) / n**0.5 if n > 1 else float("inf")
    t = T975[min(n - 1, len(T975)) - 1] if n > 1 else float("inf")
    return {"n": n, "mean": mean, "se": se, "lo": mean - t * se, "hi": mean + t * se}


def rule_verdict(st: dict[str, float]) -> str:
    """The goal-2 rule declared before the 24-seed runs (experiments/results/
    distill_t128_plan2.txt), on the paired gap sampled / top-k+tail - 1: mean <= 0 -> met;
    mean > 0 with the 95% interval reaching 0 -> met only as "no worse within the noise";
    interval wholly above 0 -> NOT met."""
    if st["mean"] <= 0:
        return "**met** (paired mean <= 0)"
    if st["lo"] <= 0:
        return (
            '**met only as "no worse within the noise"** (paired mean > 0, its 95% interval '
            "includes 0)"
        )
    return "**NOT met** (sampled worse: the 95% interval lies above 0)"


def pair_stats(reports: list[dict[str, Any]], pairs: list[str]) -> dict[str, Any]:
    """Per ``A:B`` pair: seeds, gaps and :func:`paired_stats` (pairs with >= 2 seeds)."""
    out = {}
    for spec in pairs:
        seeds, gaps = pair_gaps(reports, *spec.split(":", 1))
        if len(gaps) >= 2:
            out[spec] = {"seeds": seeds, "gaps": gaps, **paired_stats(gaps)}
    return out


def pair_gaps(reports: list[dict[str, Any]], a: str, b: str) -> tuple[list[int], list[float]]:
    """Seeds where both ``a`` and ``b`` ran, and ``KL(a) / KL(b) - 1`` on each."""
    seeds, gaps = [], []
    for r in reports:
        ms = r["methods"]
        if a in ms and b in ms:
            seeds.append(r["train"]["seed"])
            gaps.append(ms[a]["kl"] / ms[b]["kl"] - 1.0)
    return seeds, gaps


def rule_lines(
    reports: list[dict[str, Any]],
    pairs: list[str],
    others: dict[str, list[dict[str, Any]]] | None = None,
) -> list[str]:
    """Per ``A:B`` pair the paired per-seed KL of A vs B over the seeds that ran both, with
    mean, standard error, 95% interval and :func:`rule_verdict`; then the same for each named
    secondary set of reports in ``others`` (reported beside, not deciding)."""
    if not pairs:
        return []
    out = [
        "Goal 2 by the rule declared before the runs (distill_t128_plan2.txt): per seed "
        "d = KL(sampled) / KL(top-k + tail) - 1 on the same data order; met if the mean of d "
        '<= 0; met only as "no worse within the noise" if the mean > 0 but its two-sided 95% '
        "t interval includes 0; NOT met if the interval lies above 0.",
        "",
    ]
    out += pair_rule_lines(reports, pairs)
    for name, reps in (others or {}).items():
        out += ["", f"Secondary set (reported, does not decide): {name}:", ""]
        out += pair_rule_lines(reps, pairs)
    return out


def pair_rule_lines(reports: list[dict[str, Any]], pairs: list[str]) -> list[str]:
    """:func:`rule_lines`' one line per pair on one set of reports."""
    out = []
    for spec in pairs:
        a, _, b = spec.partition(":")
        seeds, gaps = pair_gaps(reports, a, b)
        if len(gaps) < 2:
            out.append(f"- `{a}` vs `{b}`: fewer than two seeds ran both")
            continue
        st = paired_stats(gaps)
        ka = statistics.fmean(r["methods"][a]["kl"] for r in reports if r["train"]["seed"] in seeds)
        kb = statistics.fmean(r["methods"][b]["kl"] for r in reports if r["train"]["seed"] in seeds)
        run = seeds == list(range(seeds[0], seeds[-1] + 1))
        span = f"seeds {seeds[0]}-{seeds[-1]}" if run else f"seeds {seeds}"
        out.append(
            f"- `{a}` vs `{b}`, {st['n']} seeds ({span}): mean KL {ka:.4f} vs {kb:.4f}; paired "
            f"mean {100 * st['mean']:+.2f}% (standard error {100 * st['se']:.2f} points, 95% "
            f"interval {100 * st['lo']:+.2f}% to {100 * st['hi']:+.2f}%): "
            f"{rule_verdict(st)}. Per seed: {', '.join(f'{100 * x:+.1f}%' for x in gaps)}"
        )
    return out


def cpu_goal_lines(methods: dict[str, dict[str, Any]]) -> list[str]:
    """Goal 1 judged again with the step's CPU time in the training thread instead of its wall
    time (a second view of the same runs; the verdict above stays the wall-time one)."""
    if not all("step_cpu_ms_median" in r for r in methods.values()):
        return []
    cpu = {m: {**r, "step_ms_median": r["step_cpu_ms_median"]} for m, r in methods.items()}
    g = goals(cpu).get("offline_within")
    if g is None:
        return []
    return [
        "Goal 1 with step **CPU** time (training thread, `time.thread_time`) in place of wall "
        f"time, same KL: **{'met' if g['met'] else 'NOT met'}**. Best offline `{g['best']}`, KL "
        f"{100 * g['kl_vs_online']:+.1f}%, step CPU time {g['step_time_vs_online']:.2f}x."
    ]


def load_lines(reports: list[dict[str, Any]]) -> list[str]:
    """Per seed: the 1-minute load average while it trained (when the report has it)."""
    parts = []
    for r in reports:
        load = r["train"].get("load_avg")
        if load:
            parts.append(
                f"seed {r['train']['seed']} {load['min']:.1f}-{load['max']:.1f} "
                f"(mean {load['mean']:.1f})"
            )
    if not parts:
        return []
    cores = reports[0]["train"]["load_avg"].get("cores", "?")
    return [f"- 1-minute load average while training, on {cores} cores: " + "; ".join(parts)]


def previous_lines(
    methods: dict[str, dict[str, Any]], previous: dict[str, Any], tag: str
) -> list[str]:
    """A table of this run's seed means beside an earlier result's (``previous["mean"]``)."""
    prev = previous.get("mean", {})
    lines = [
        f"Compared with the previous result ({tag}):",
        "",
        "| method | held-out KL before → now | vs online KD before → now | step vs online "
        "before → now | teacher columns per batch now |",
        "|---|---|---|---|---:|",
    ]
    for name, r in methods.items():
        p = prev.get(name)
        if p is None:
            continue
        cols = r.get("mean_batch_columns")
        lines.append(
            f"| {label(name)} | {p['kl']:.4f} → {r['kl']:.4f} | "
            f"{100 * p.get('kl_vs_online', 0):+.1f}% → {100 * r.get('kl_vs_online', 0):+.1f}% | "
            f"{p.get('step_time_vs_online', 0):.2f}x → {r.get('step_time_vs_online', 0):.2f}x | "
            f"{'' if cols is None else f'{cols:.1f}'} |"
        )
    return lines


def impl_note(reports: list[dict[str, Any]]) -> str:
    """``; sparse-target loss impl X`` from the reports (``--loss-impl``; reports before it
    have none: their runs used ``fused_chunked``)."""
    impls = sorted({r["train"].get("loss_impl", "fused_chunked") for r in reports})
    return f"; sparse-target loss `topk_distill_loss(impl={'/'.join(impls)})`"


def command_note(reports: list[dict[str, Any]]) -> str:
    """``(per seed: `cmd` with `--seed`)``; where the seeds ran different commands (other
    than ``--seed`` and the seed's output paths), each command with the seeds that ran it."""
    import re

    groups: dict[str, tuple[str, list[int]]] = {}  # normalised command -> (first, seeds)
    for r in reports:
        seed = r["train"]["seed"]
        key = re.sub(rf"(--seed |seed){seed}\b", r"\g<1>S", r["command"])
        groups.setdefault(key, (r["command"], []))[1].append(seed)
    if len(groups) == 1:
        return f"(per seed: `{reports[0]['command']}` with `--seed`)"
    return (
        "(per seed, with `--seed`: "
        + "; ".join(f"seeds {seeds}: `{cmd}`" for cmd, seeds in groups.values())
        + ")"
    )


def markdown(
    reports: list[dict[str, Any]],
    methods: dict[str, dict[str, Any]],
    *,
    intro: list[str] | None = None,
    previous: dict[str, Any] | None = None,
    previous_tag: str = "",
    rules: list[str] | None = None,
    rule_sets: dict[str, list[dict[str, Any]]] | None = None,
) -> str:
    r0 = reports[0]
    seeds = [r["train"]["seed"] for r in reports]
    c = r0["cache"]
    lines = [
        "# Distillation from the cache vs online KD (tiny local teacher, issue #12)",
        "",
        f"- command: `python -m experiments.distill {shown_args(sys.argv[1:])}` "
        + command_note(reports),
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
        f"{r0['heldout']['positions']:,} positions, full-vocabulary KL{impl_note(reports)}",
        *load_lines(reports),
        "",
        *(intro or []),
        "| method | B/pos | held-out KL (mean) | KL per seed | vs online KD | vs online KD, "
        "per seed (paired) | ppl | top-1 ECE | step ms | step vs online | step vs online, per "
        "seed | step CPU vs online |",
        "|---|---:|---:|---|---:|---|---:|---:|---:|---:|---|---:|",
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
            f"{r['step_ms_median']:.0f} | {r.get('step_time_vs_online', 0):.2f}x | "
            f"{', '.join(f'{x:.2f}x' for x in r.get('step_time_vs_online_by_seed', []))} | "
            + (f"{r['step_cpu_vs_online']:.2f}x |" if "step_cpu_vs_online" in r else " |")
        )
    g = goals(methods)
    lines += ["", "On the seed means:", "", *goal_lines(g)]
    best = g.get("offline_within", {}).get("best")
    pg = paired_gap(methods[best]) if best else None
    if pg is not None:
        lines.append(
            f"Paired per-seed KL gap of `{best}` to online KD: mean {100 * pg[0]:+.1f}% "
            f"(standard error {100 * pg[1]:.1f} points over {len(reports)} seeds)."
        )
    lines += paired_goal2_lines(methods, g)
    lines += cpu_goal_lines(methods)
    if rules:
        lines += ["", *rule_lines(reports, rules, rule_sets)]
    if previous is not None:
        lines += ["", *previous_lines(methods, previous, previous_tag)]
    lines += ["", "Per seed:", ""]
    for rep in reports:
        lines += [f"- seed {rep['train']['seed']}: " + " ".join(goal_lines(goals(rep["methods"])))]
    lines += ["", *[f"- {n}" for n in r0["notes"]], *[f"- {n}" for n in spread_notes(methods)]]
    lines.append(f"- {OLD_PAGES_NOTE}")
    return "\n".join(lines) + "\n"


#: The sharpened-teacher pages beside this one predate the 1024-token default teacher (their
#: reports' ``models.root`` is the fixture cache key of recipe ``v1``, f0b94d0a8961f8fe).
OLD_PAGES_NOTE = (
    "the sharpened-teacher pages `distill_T0.45*.md`, `distill_T0.55*.md`, `distill_T0.6*.md` "
    "beside this one were measured on the first sessions' teacher (fixture recipe `v1`: "
    "docstrings only, vocab 4096, held-out ppl ~286, worse than a bigram; 100 steps x 8 x 128 "
    "tokens), not on the teacher of this page; they are superseded for the T=1 comparison"
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


def distill_series(result: Mapping) -> tuple[dict[str, list[Point]], float]:
    """Held-out KL vs bytes/position per offline method family of a ``distill_bench`` result
    (``experiments/results/distill.json``: ``mean[method] = {"kl", "bytes_per_position"}``,
    methods ``<family>@<size>``; ``offline_exact``, one size, is a one-point family ``exact``),
    and online KD's KL (the reference line)."""
    mean = result["mean"]
    series: dict[str, list[Point]] = {}
    for method, row in mean.items():
        if row.get("bytes_per_position") is None:
            continue
        if method == "offline_exact":
            series["exact (hidden states)"] = [(float(row["bytes_per_position"]), float(row["kl"]))]
            continue
        if "@" not in method:
            continue
        base, _, size = method.partition("@")
        _, mark, tau = size.partition("~tau")  # a sampled variant at its own proposal tau
        family = base.removeprefix("offline_") + (f" tau={tau}" if mark else "")
        series.setdefault(family, []).append((float(row["bytes_per_position"]), float(row["kl"])))
    return series, float(mean["online_kd"]["kl"])


def distill_plot(result_json: str | Path, out: str | Path) -> Path:
    """The distillation chart (held-out KL vs stored bytes/position) from a committed result."""
    result = json.loads(Path(result_json).read_text())
    series, online = distill_series(result)
    seeds = result.get("seeds") or [result]
    first = seeds[0] if isinstance(seeds, list) else result
    note = f"{Path(result_json).name}, mean of {len(seeds)} seed(s); {first.get('machine', '')}"
    if "models" in first and "train" in first:
        note += (
            f"; teacher vocab {first['models']['vocab_size']}, "
            f"{first['train']['steps']} steps x {first['train']['batch_items']} x "
            f"{first['train']['tokens_per_item']} tokens"
        )
    return line_plot(
        out,
        series,
        title="distillation: held-out KL vs bytes stored per position",
        xlabel="bytes / position (whole store on disk)",
        ylabel="held-out KL (teacher || student)",
        hline=online,
        hline_label="online KD (no cache)",
        note=note,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args_in = sys.argv[1:] if argv is None else argv
    if args_in[:1] == ["plot"]:  # python -m experiments.distill plot RESULT.json OUT.png
        print(distill_plot(args_in[1], args_in[2]))
        return {}
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
    p.add_argument(
        "--previous",
        type=Path,
        help="an earlier distill.json to compare with (its seed means beside this run's)",
    )
    p.add_argument("--previous-tag", default="", help="how the page names --previous")
    p.add_argument(
        "--intro",
        action="append",
        default=[],
        help="a paragraph for the page above the table (what changed since --previous); repeat",
    )
    p.add_argument(
        "--ablation",
        metavar="NAME=WORKDIR",
        action="append",
        default=[],
        help="combine-only: the issue #12 ablation page from each named configuration's per-seed "
        "reports (WORKDIR/seed<s>/distill.json) plus a row check of the scored cache at each "
        "configuration's item layout; repeat per configuration",
    )
    p.add_argument(
        "--pair",
        metavar="SAMPLED:TOPK_TAIL",
        action="append",
        default=[],
        help="judge goal 2 on this pair of methods by the pre-declared paired rule (seeds that "
        "ran both; repeat)",
    )
    p.add_argument(
        "--rule-set",
        metavar="NAME=WORKDIR@SEEDS",
        action="append",
        default=[],
        help="--pair's rule again on another set of per-seed reports (WORKDIR/seed<s>/"
        "distill.json), reported as secondary; repeat",
    )
    p.add_argument("--check-batches", type=int, default=30, help="--ablation row-check batches")
    p.add_argument(
        "--ablation-methods",
        help="comma list: the --ablation page shows only these methods (default: all)",
    )
    args, rest = p.parse_known_args(argv)
    rest = [a for a in rest if a != "--"]
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.ablation:
        return ablation(args, seeds)

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
        from examples import distill

        for seed in seeds:
            distill.main(seed_args(seed))
    reports = [json.loads((args.workdir / f"seed{s}" / "distill.json").read_text()) for s in seeds]
    methods = combine(reports)
    result = {"seeds": reports, "mean": methods, "goals": goals(methods)}
    rule_sets = {}
    for spec in args.rule_set:
        name, dirs, picked = parse_ablation(spec, seeds)
        rule_sets[name] = [
            json.loads((dirs[0] / f"seed{s}" / "distill.json").read_text()) for s in picked
        ]
    if args.pair:
        result["paired_rule"] = pair_stats(reports, args.pair)
        result["paired_rule_secondary"] = {
            name: pair_stats(reps, args.pair) for name, reps in rule_sets.items()
        }
    args.out_json.write_text(json.dumps(result, indent=1) + "\n")
    previous = json.loads(args.previous.read_text()) if args.previous else None
    intro = [x for para in args.intro for x in (para, "")]
    text = markdown(
        reports,
        methods,
        intro=intro,
        previous=previous,
        previous_tag=args.previous_tag,
        rules=args.pair,
        rule_sets=rule_sets,
    )
    args.out_md.write_text(text)
    print(text)
    return result


def parse_ablation(spec: str, seeds: list[int]) -> tuple[str, list[Path], list[int]]:
    """``NAME=DIR[+DIR2...][@s,s]`` -> (name, work dirs, seeds; ``--seeds`` when no ``@``)."""
    name, eq, rest = spec.partition("=")
    where, at, only = rest.partition("@")
    dirs = [Path(d) for d in where.split("+") if d]
    try:
        picked = [int(x) for x in only.split(",")] if at else seeds
    except ValueError:
        picked = []
    if not eq or not name or not dirs or not picked:
        raise SystemExit(f"--ablation takes NAME=WORKDIR[+WORKDIR2][@seeds], got {spec!r}")
    return name, dirs, picked


def merged_report(dirs: list[Path], seed: int) -> dict[str, Any]:
    """Seed ``seed``'s report of ``dirs[0]`` with the methods of the other work dirs' reports of
    that seed added (same seed, steps and item layout required; a later work dir without that
    seed's report adds nothing); ``merged_methods`` names the
    added ones. An added method's step times are rescaled to keep its ratio to its own run's
    online KD (when both runs have one): step times of two runs are not comparable."""
    paths = [d / f"seed{seed}" / "distill.json" for d in dirs]
    reports = [json.loads(f.read_text()) for i, f in enumerate(paths) if i == 0 or f.exists()]
    out = reports[0]
    out["merged_methods"] = []
    keys = ("seed", "steps", "tokens_per_item", "batch_items", "lr")
    for extra in reports[1:]:
        if any(extra["train"][k] != out["train"][k] for k in keys):
            raise SystemExit(f"seed {seed}: {dirs} ran different training plans")
        own = extra["methods"].get("online_kd")
        base = out["methods"].get("online_kd")
        for m, row in extra["methods"].items():
            if m not in out["methods"]:
                if own and base:  # keep the step-time ratio measured within its own run
                    for key in ("step_ms_median", "step_cpu_ms_median"):
                        if key in row and key in own and key in base:
                            row[key] = row[key] / own[key] * base[key]
                else:
                    out.setdefault("unscaled_methods", []).append(m)
                out["methods"][m] = row
                out["merged_methods"].append(m)
    return out


def ablation(args: argparse.Namespace, seeds: list[int]) -> dict[str, Any]:
    """``--ablation``: the page of issue #12's ablation (examples/distill_ablation.py)."""
    import torch
    from distill_ablation import ablation_markdown, row_check, same_stream
    from logitcache.fixtures.tiny import build_tiny_models
    from transformers import LlamaForCausalLM

    configs = {
        name: [merged_report(dirs, s) for s in config_seeds]
        for name, dirs, config_seeds in (parse_ablation(spec, seeds) for spec in args.ablation)
    }
    if args.ablation_methods:
        keep = [m.strip() for m in args.ablation_methods.split(",") if m.strip()]
        for reports in configs.values():
            for r in reports:
                r["methods"] = {m: r["methods"][m] for m in keep if m in r["methods"]}
    torch.set_num_threads(1)
    models = build_tiny_models(verbose=False)
    teacher = LlamaForCausalLM.from_pretrained(str(models.teacher_dir)).float().eval()
    url = next(iter(configs.values()))[0]["cache"]["url"]
    checks: list[dict[str, Any]] = []
    for reports in configs.values():
        t = reports[0]["train"]
        if reports[0]["cache"]["url"] != url:
            raise SystemExit("the configurations trained from different scored caches")
        layout = (t["tokens_per_item"], t["batch_items"])
        if any((c["tokens_per_item"], c["batch_items"]) == layout for c in checks):
            continue
        kw = {
            "tokens_per_item": t["tokens_per_item"],
            "batch_items": t["batch_items"],
            "batches": args.check_batches,
            "tokenizer": models.load_tokenizer(),
            "vocab_size": models.vocab_size,
        }
        check = row_check(url, teacher, **kw)
        caches = sorted(
            {m["cache"] for r in reports for m in r["methods"].values() if "cache" in m}
        )
        urls = [url, *(c for c in caches if c != url)]
        check.update(same_stream=same_stream(urls, **kw), stream_caches=len(urls))
        checks.append(check)
    text = ablation_markdown(
        configs,
        checks,
        command=f"python -m experiments.distill {shown_args(sys.argv[1:])}",
        intro=args.intro,
        label=label,
        verdicts={name: goal_lines(goals(combine(reps))) for name, reps in configs.items()},
    )
    means = {name: combine(reps) for name, reps in configs.items()}
    for reps in configs.values():  # the page's JSON without the per-step loss curves (run dirs)
        for r in reps:
            for row in r["methods"].values():
                row.pop("loss_curve", None)
    result = {
        "row_checks": checks,
        "configs": {name: {"seeds": reps, "mean": means[name]} for name, reps in configs.items()},
    }
    args.out_json.write_text(json.dumps(result, indent=1) + "\n")
    args.out_md.write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
