"""Summaries of a distillation comparison: per-method figures, ratios, and the markdown page."""

from __future__ import annotations

import statistics
from typing import Any

LABELS = {
    "untrained": "untrained student",
    "ce": "CE only (no distillation)",
    "online_kd": "online KD, full-vocab KL (teacher in the loop)",
    "offline_topk": "offline top-k cache KD, no tail",
    "offline_topk_tail": "offline top-k cache KD + tail mass",
}


def label(method: str) -> str:
    """Human name of a method spec (``offline_topk_tail@16`` included)."""
    base, _, k = method.partition("@")
    return LABELS[base] + (f", first {k} of the cached k" if k else "")


def method_summary(run: Any, evaluation: dict[str, float], warmup: int = 5) -> dict[str, Any]:
    """Figures of one trained method (step times leave out the first ``warmup`` steps)."""
    steps = run.step_s[warmup:] or run.step_s
    data = run.data_s[warmup:] or run.data_s
    return {
        **evaluation,
        "step_ms_median": 1000 * statistics.median(steps),
        "step_ms_mean": 1000 * statistics.fmean(steps),
        "data_wait_share": sum(data) / (sum(data) + sum(steps)),
        "rows_trained": run.rows,
        "loss_first": run.losses[0],
        "loss_last10": statistics.fmean(run.losses[-10:]),
        "loss_curve": run.losses,
    }


def add_ratios(methods: dict[str, dict[str, Any]]) -> None:
    """KL gap and step-time ratio of every method against online KD (when it ran)."""
    base = methods.get("online_kd")
    if base is None:
        return
    for m in methods.values():
        m["kl_vs_online"] = m["kl"] / base["kl"] - 1.0
        m["step_time_vs_online"] = m["step_ms_median"] / base["step_ms_median"]


def verdict(methods: dict[str, dict[str, Any]], tolerance: float = 0.05) -> str | None:
    """One honest sentence on the goal (offline top-k within a few percent of online KD)."""
    if "online_kd" not in methods:
        return None
    best = min(
        (m for m in methods if m.startswith("offline")),
        key=lambda m: methods[m]["kl"],
        default=None,
    )
    if best is None:
        return None
    gap, speed = methods[best]["kl_vs_online"], methods[best]["step_time_vs_online"]
    met = "met" if gap <= tolerance and speed < 1.0 else "NOT met"
    return (
        f"Goal (offline top-k within {100 * tolerance:.0f}% of online KD's held-out KL, at a "
        f"fraction of its step time): **{met}**. Best offline variant `{best}`: KL "
        f"{100 * gap:+.1f}% vs online KD, step time {speed:.2f}x online KD's."
    )


def markdown(rep: dict[str, Any]) -> str:
    """The results page."""
    c, m = rep["cache"], rep["methods"]
    lines = [
        "# End-to-end distillation on the tiny local teacher",
        "",
        f"- command: `{rep['command']}`",
        f"- machine: {rep['machine']}",
        f"- teacher {rep['models']['teacher_params']:,} params, student "
        f"{rep['models']['student_params']:,} params, vocab {rep['models']['vocab_size']}; "
        f"teacher held-out ppl on the eval windows {rep['heldout']['teacher_ppl']:.2f}",
        f"- cache: batch job over HTTP ({rep['job']['backend']} backend), "
        f"{c['num_sequences']} sequences, {c['num_rows']:,} rows, k={c['k']}, mean teacher "
        f"mass in the top-k {c['mean_topk_mass']:.3f} (tail {1 - c['mean_topk_mass']:.3f}); "
        f"job {rep['job']['wall_s']:.1f} s wall, {rep['job']['tokens_per_s']:,.0f} tokens/s; "
        f"`validate`: {c['validation']}",
        f"- training: {rep['train']['steps']} steps x {rep['train']['batch_items']} packed items "
        f"x {rep['train']['tokens_per_item']} tokens, AdamW lr {rep['train']['lr']}, seed "
        f"{rep['train']['seed']}, same data order and init for every method, runs interleaved "
        f"step by step; {rep['train']['threads']} torch thread(s)",
        f"- held-out: {rep['heldout']['positions']:,} positions (windows of "
        f"{rep['heldout']['window']} tokens of held-out modules); KL(teacher||student) is over "
        "the full vocabulary with the teacher run in PyTorch",
        "",
        "| method | held-out KL(t‖s) | KL vs online KD | held-out ppl | step ms (median) | "
        "step time vs online KD | data wait | train loss (first → last 10) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    u = rep["untrained"]
    lines.append(f"| {label('untrained')} | {u['kl']:.4f} | | {u['ppl']:.1f} | | | | |")
    for name, r in m.items():
        vs = f"{100 * r['kl_vs_online']:+.1f}%" if "kl_vs_online" in r else ""
        sp = f"{r['step_time_vs_online']:.2f}x" if "step_time_vs_online" in r else ""
        lines.append(
            f"| {label(name)} | {r['kl']:.4f} | {vs} | {r['ppl']:.2f} | "
            f"{r['step_ms_median']:.1f} | {sp} | {100 * r['data_wait_share']:.1f}% | "
            f"{r['loss_first']:.3f} → {r['loss_last10']:.3f} |"
        )
    v = verdict(m)
    if v:
        lines += ["", v]
    if rep.get("notes"):
        lines += ["", *[f"- {n}" for n in rep["notes"]]]
    return "\n".join(lines) + "\n"
