"""benchmarks/distill_bench.py's page additions: CPU-time ratios, paired-gap standard error, the
load line and the comparison with a previous result (fake reports, no training)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))

import distill_bench  # noqa: E402
from distill_report import method_summary  # noqa: E402
from test_distill_bench import _report as base_report  # noqa: E402


def _report(seed: int, kls: dict[str, float], cpu_ms: dict[str, float]) -> dict[str, Any]:
    """test_distill_bench's fake report plus what this page reads: step CPU times, wall ratios,
    batch columns and the load average while training."""
    rep = base_report(seed, kls)
    for m, row in rep["methods"].items():
        row.update(step_time_vs_online=1.0, step_cpu_ms_median=cpu_ms.get(m, 1.0))
        if m != "online_kd":
            row.update(
                step_ms_median=310.0, step_time_vs_online=0.62, mean_batch_columns=70.0 + seed
            )
    rep["train"]["load_avg"] = {
        "min": 2.0 + seed,
        "mean": 3.0,
        "max": 4.5,
        "samples": 3,
        "cores": 2,
    }
    rep["notes"] = []
    return rep


def test_page_shows_cpu_ratio_paired_error_load_and_previous() -> None:
    cpu = {"online_kd": 400.0, "offline_topk_tail@8": 200.0}
    reports = [
        _report(0, {"online_kd": 1.0, "offline_topk_tail@8": 1.03}, cpu),
        _report(1, {"online_kd": 1.0, "offline_topk_tail@8": 1.01}, cpu),
    ]
    methods = distill_bench.combine(reports)
    tail = methods["offline_topk_tail@8"]
    assert tail["step_cpu_vs_online"] == pytest.approx(0.5)
    assert tail["step_time_vs_online"] == pytest.approx(0.62)
    assert tail["mean_batch_columns"] == pytest.approx(70.5)
    assert distill_bench.paired_gap(tail) == pytest.approx((0.02, 0.01))
    previous = {"mean": {"offline_topk_tail@8": {"kl": 1.5, "kl_vs_online": 0.05}}}
    text = distill_bench.markdown(
        reports, methods, intro=["WHAT CHANGED", ""], previous=previous, previous_tag="old run"
    )
    # wall time 0.62x misses; CPU time 0.5x with KL +2.0% meets: both verdicts are printed
    assert "Best offline: `offline_topk_tail@8`, KL +2.0% vs online KD, step time 0.62x" in text
    assert "in place of wall time, same KL: **met**" in text
    assert "mean +2.0% (standard error 1.0 points over 2 seeds)" in text
    assert "seed 0 2.0-4.5 (mean 3.0); seed 1 3.0-4.5 (mean 3.0)" in text
    assert "| 0.62x, 0.62x | 0.50x |" in text
    assert "1.5000 → 1.0200 | +5.0% → +2.0% | 0.00x → 0.62x | 70.5 |" in text
    assert text.index("WHAT CHANGED") < text.index("| method |")


def test_goal2_paired_per_seed_line() -> None:
    kls = [
        {"online_kd": 1.0, "offline_topk_tail@8": 1.0, "offline_sampled@16": 0.98},
        {"online_kd": 1.0, "offline_topk_tail@8": 1.0, "offline_sampled@16": 1.04},
    ]
    reports = [_report(i, k, {}) for i, k in enumerate(kls)]
    methods = distill_bench.combine(reports)
    text = distill_bench.markdown(reports, methods)
    assert (
        "~100 B/pos: `offline_sampled@16` vs `offline_topk_tail@8` per seed -2.0%, +4.0%; "
        "mean +1.0% (standard error 3.0 points)" in text
    )


def test_page_without_new_fields_keeps_its_old_form() -> None:
    reports = [_report(0, {"online_kd": 1.0, "offline_topk_tail@8": 1.1}, {})]
    for m in reports[0]["methods"].values():
        m.pop("step_cpu_ms_median", None)
    reports[0]["train"].pop("load_avg")
    methods = distill_bench.combine(reports)
    text = distill_bench.markdown(reports, methods)
    assert "CPU** time" not in text and "load average" not in text
    assert distill_bench.paired_gap(methods["offline_topk_tail@8"]) is None


def test_shown_args_leaves_out_intro_paragraphs() -> None:
    argv = ["--combine-only", "--intro", "long text", "--seeds", "0,1", "--intro=x"]
    assert distill_bench.shown_args(argv) == "--combine-only --seeds 0,1"


def test_method_summary_reports_cpu_time_and_columns() -> None:
    class FakeRun:
        method = "offline_sampled@16"
        step_s = [1.0] * 8
        step_cpu_s = [0.5] * 8
        data_s = [0.0] * 8
        columns = [10, 12, 14, 12, 12, 12, 12, 12]
        rows = 5
        losses = [2.0] * 8

    s = method_summary(FakeRun(), {"kl": 1.0})
    assert s["step_cpu_ms_median"] == pytest.approx(500.0)
    assert s["mean_batch_columns"] == pytest.approx(12.0)
    FakeRun.method = "online_kd"
    assert "mean_batch_columns" not in method_summary(FakeRun(), {"kl": 1.0})
