"""benchmarks/distill_bench.py's combination of per-seed reports (no training: fake reports)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import distill_bench  # noqa: E402


def _report(seed: int, kls: dict[str, float]) -> dict[str, Any]:
    methods: dict[str, dict[str, Any]] = {}
    for m, kl in kls.items():
        methods[m] = {"kl": kl, "ppl": 80.0, "ece": 0.02, "step_ms_median": 500.0}
        if m != "online_kd":  # offline runs: a cache of a budget, faster steps
            methods[m].update(bytes_per_position=100.0, budget=100.0, step_ms_median=300.0)
    return {
        "command": "python examples/distill.py --steps 3",
        "machine": "test box",
        "models": {"teacher_params": 10, "student_params": 5, "vocab_size": 1024},
        "plan": {"teacher_temperature": 1.0, "budgets": [100.0]},
        "heldout": {"teacher_ppl": 28.0, "positions": 100},
        "cache": {
            "num_sequences": 2,
            "num_rows": 10,
            "k": 8,
            "mean_topk_mass": 0.9,
            "bytes_per_position": 40.0,
        },
        "train": {"steps": 3, "batch_items": 2, "tokens_per_item": 4, "lr": 0.1, "seed": seed},
        "methods": methods,
        "goals": {},
        "notes": ["a note"],
    }


def test_combine_pairs_each_seed_with_its_own_online_run() -> None:
    reports = [
        _report(0, {"online_kd": 1.0, "offline_topk_tail@8": 1.10, "offline_sampled@16": 1.05}),
        _report(1, {"online_kd": 2.0, "offline_topk_tail@8": 2.02, "offline_sampled@16": 2.2}),
    ]
    methods = distill_bench.combine(reports)
    tail = methods["offline_topk_tail@8"]
    assert tail["kl_by_seed"] == [1.10, 2.02]
    assert tail["kl_vs_online_by_seed"] == pytest.approx([0.10, 0.01])
    assert tail["kl_vs_online"] == pytest.approx(1.56 / 1.5 - 1)  # on the seed means
    text = distill_bench.markdown(reports, methods)
    assert "| +10.0%, +1.0% |" in text
    assert "spread of online KD's held-out KL: 1.0000 to 2.0000 (67% of the mean)" in text
    assert "vocab 4096" in text and distill_bench.OLD_PAGES_NOTE in text
    assert distill_bench.spread_notes({"online_kd": {"kl_by_seed": [1.0]}}) == []


def test_page_names_the_sparse_loss_impl() -> None:
    """Reports from before ``--loss-impl`` ran ``fused_chunked``; newer ones carry theirs."""
    old = [_report(0, {"online_kd": 1.0, "offline_topk_tail@8": 1.1})]
    assert distill_bench.impl_note(old).endswith("`topk_distill_loss(impl=fused_chunked)`")
    new = [_report(s, {"online_kd": 1.0, "offline_topk_tail@8": 1.1}) for s in (0, 1)]
    for r in new:
        r["train"]["loss_impl"] = "auto"
    page = distill_bench.markdown(new, distill_bench.combine(new))
    assert "full-vocabulary KL; sparse-target loss `topk_distill_loss(impl=auto)`" in page
