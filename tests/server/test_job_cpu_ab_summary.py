"""benchmarks/job_cpu_ab.py's summary: a process's first timed job (it also grows the kept
buffers, once per process) is summarised apart from its later ones, the later ones of a round
folded into their median run, and B - A paired by round."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import job_cpu_ab  # noqa: E402


def _run(rnd: int, tree: str, rep: int | None, us: float) -> dict:
    r = {
        "round": rnd,
        "tree": tree,
        "prefill": 0,
        "k": 100,
        "us_per_position": us,
        "sys_us_per_position": us / 10,
        "stage_us_per_position": {"encode": us / 2},
        "load_avg_1min_before": 0.5,
    }
    if rep is not None:
        r["rep"] = rep
    return r


def test_first_and_later_jobs_are_summarised_apart() -> None:
    runs = []
    for rnd, (a, b) in enumerate([((2.4, 2.2, 2.0, 2.1), (2.1, 1.9, 1.8, 2.0))], start=1):
        for tree, figs in (("a", a), ("b", b)):
            runs += [_run(rnd, tree, rep, us) for rep, us in enumerate(figs)]
    runs += [_run(2, "a", 0, 2.5), _run(2, "a", 1, 2.3), _run(2, "b", 0, 2.6), _run(2, "b", 1, 1.7)]
    s = job_cpu_ab.summarize(runs)
    assert set(s) == {"prefill=0 k=100 first", "prefill=0 k=100 later"}
    first, later = s["prefill=0 k=100 first"], s["prefill=0 k=100 later"]
    assert first["a_rounds"] == [2.4, 2.5] and first["b_rounds"] == [2.1, 2.6]
    assert first["b_lower_rounds"] == 1  # round 2: B's first job was dearer
    assert later["a_rounds"] == [2.1, 2.3]  # round 1: the median of 2.2, 2.0, 2.1
    assert later["b_rounds"] == [1.9, 1.7]
    assert later["b_lower_rounds"] == 2 and later["median_paired_diff"] < 0


def test_runs_without_a_rep_field_keep_one_summary() -> None:
    runs = [_run(1, "a", None, 2.0), _run(1, "b", None, 1.9)]
    s = job_cpu_ab.summarize(runs)
    assert list(s) == ["prefill=0 k=100"] and s["prefill=0 k=100"]["b_lower_rounds"] == 1
