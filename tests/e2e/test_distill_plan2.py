"""Issue #12's 24-seed plan (benchmarks/results/distill_t128_plan2.txt): sampled methods at their
own proposal temperature (``offline_sampled@384~tau0.8``), the pre-declared paired goal-2 rule
of benchmarks/distill_bench.py (``--pair``), the tau variance of sampled_head_bench.py and the
chart's families. Fakes only: no training, no service."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))

import distill  # noqa: E402
import distill_bench  # noqa: E402
import sampled_head_bench as shb  # noqa: E402
from plots import distill_series  # noqa: E402
from test_distill_bench import _report  # noqa: E402


def test_split_tau_parses_and_refuses() -> None:
    assert distill.split_tau("offline_sampled@384~tau0.8") == ("offline_sampled@384", 0.8)
    assert distill.split_tau("offline_sampled_head@128+8~tau1.5") == (
        "offline_sampled_head@128+8",
        1.5,
    )
    assert distill.split_tau("offline_topk_tail@128") == ("offline_topk_tail@128", None)
    for bad in ("offline_topk@8~tau0.8", "offline_sampled~tau0.8", "offline_sampled@8~tau0"):
        with pytest.raises(ValueError):
            distill.split_tau(bad)
    with pytest.raises(ValueError):
        distill.split_tau("offline_sampled@8~taux")


def test_args_take_a_tau_method_and_probe_candidates(tmp_path: Path) -> None:
    plan, _ = distill.parse_args(
        [
            "--workdir",
            str(tmp_path),
            "--methods",
            "online_kd,offline_sampled,offline_sampled@384~tau0.8",
            "--draw-candidates",
            "96,384",
            "--topk-candidates",
            "48,128",
        ]
    )
    assert plan.methods == ("online_kd", "offline_sampled", "offline_sampled@384~tau0.8")
    assert plan.draw_candidates == (96, 384) and plan.topk_candidates == (48, 128)
    with pytest.raises(SystemExit):
        distill.parse_args(["--methods", "offline_topk@8~tau0.8"])
    with pytest.raises(SystemExit):
        distill.parse_args(["--draw-candidates", "0,4"])
    # an explicit tau spec gets no budget (goal 2's budget pairs stay the plain tau's) and its tau
    plan, _ = distill.parse_args(
        ["--workdir", str(tmp_path), "--methods", "online_kd,offline_sampled@384~tau0.8"]
    )
    specs, where = distill.resolve_methods(plan, "unused", None, tmp_path)
    assert specs == ["online_kd", "offline_sampled@384~tau0.8"]
    assert where["offline_sampled@384~tau0.8"] == {
        "n": 384,
        "budget": None,
        "proposal_temperature": 0.8,
    }


def test_spec_run_trains_the_plain_loss_on_the_specs_own_cache(monkeypatch) -> None:  # noqa: ANN001
    seen: dict[str, Any] = {}

    class FakeRun:
        method = ""

    def fake_make_run(method, load_student, make_dataset, teacher, settings):  # noqa: ANN001, ANN202
        seen["method"] = method
        seen["dataset"] = make_dataset(method)
        r = FakeRun()
        r.method = method
        return r

    monkeypatch.setattr(distill, "make_run", fake_make_run)
    run = distill.spec_run(
        "offline_sampled@384~tau0.8", None, lambda m: f"cache of {m}", None, None
    )
    assert seen == {
        "method": "offline_sampled@384",
        "dataset": "cache of offline_sampled@384~tau0.8",
    }
    assert run.method == "offline_sampled@384~tau0.8"


def test_paired_rule_has_three_outcomes() -> None:
    st = distill_bench.paired_stats([0.01, 0.03])
    assert st["mean"] == pytest.approx(0.02) and st["se"] == pytest.approx(0.01)
    assert st["lo"] == pytest.approx(0.02 - 12.706 * 0.01)
    assert "within the noise" in distill_bench.rule_verdict(st)
    assert "**met** (paired mean <= 0)" == distill_bench.rule_verdict({"mean": 0.0, "lo": -1})
    assert "**NOT met**" in distill_bench.rule_verdict(
        distill_bench.paired_stats([0.02] * 3 + [0.03])
    )
    # 24 seeds use t(23) = 2.069
    st = distill_bench.paired_stats([0.0, 0.02] * 12)
    assert st["hi"] - st["mean"] == pytest.approx(2.069 * st["se"])


def test_pair_lines_use_the_seeds_that_ran_both(tmp_path: Path) -> None:
    a, b = "offline_sampled@384~tau0.8", "offline_topk_tail@128"
    reports = [
        _report(0, {"online_kd": 1.0, b: 1.0}),
        _report(1, {"online_kd": 1.0, b: 1.0, a: 1.02}),
        _report(2, {"online_kd": 1.0, b: 2.0, a: 1.98}),
    ]
    seeds, gaps = distill_bench.pair_gaps(reports, a, b)
    assert seeds == [1, 2] and gaps == pytest.approx([0.02, -0.01])
    text = "\n".join(distill_bench.rule_lines(reports, [f"{a}:{b}"]))
    assert f"`{a}` vs `{b}`, 2 seeds (seeds 1-2): mean KL 1.5000 vs 1.5000" in text
    assert "paired mean +0.50% (standard error 1.50 points" in text
    assert "Per seed: +2.0%, -1.0%" in text
    # the page: the rule section only when --pair is given, after the table
    methods = distill_bench.combine(reports)
    assert "declared before the runs" not in distill_bench.markdown(reports, methods)
    page = distill_bench.markdown(reports, methods, rules=[f"{a}:{b}"])
    assert page.index("| method |") < page.index("declared before the runs")
    for i, r in enumerate(reports):
        d = tmp_path / f"seed{i}"
        d.mkdir()
        (d / "distill.json").write_text(__import__("json").dumps(r))
    out = distill_bench.main(
        [
            "--combine-only",
            "--workdir",
            str(tmp_path),
            "--seeds",
            "0,1,2",
            "--out-json",
            str(tmp_path / "p.json"),
            "--out-md",
            str(tmp_path / "p.md"),
            "--pair",
            f"{a}:{b}",
            "--rule-set",
            f"last two={tmp_path}@1,2",
        ]
    )
    assert out["paired_rule"][f"{a}:{b}"]["seeds"] == [1, 2]
    assert out["paired_rule_secondary"]["last two"][f"{a}:{b}"]["n"] == 2
    assert a not in out["mean"]  # the table keeps the methods every seed ran
    page = (tmp_path / "p.md").read_text()
    assert "Secondary set (reported, does not decide): last two:" in page
    assert page.count("paired mean +0.50% (standard error 1.50 points") == 2


def test_page_lists_each_per_seed_command_with_its_seeds() -> None:
    reports = [_report(s, {"online_kd": 1.0}) for s in (0, 1, 8)]
    for r in reports:
        s = r["train"]["seed"]
        extra = "" if s == 0 else " --reuse-cache"
        r["command"] = f"python examples/distill.py --seed {s} --out-json w/seed{s}/d.json{extra}"
    note = distill_bench.command_note(reports)
    assert note == (
        "(per seed, with `--seed`: seeds [0]: `python examples/distill.py --seed 0 --out-json "
        "w/seed0/d.json`; seeds [1, 8]: `python examples/distill.py --seed 1 --out-json "
        "w/seed1/d.json --reuse-cache`)"
    )
    assert distill_bench.command_note(reports[1:]).startswith("(per seed: `python")


def test_delta_variance_is_exact_at_tau_one_and_matches_monte_carlo() -> None:
    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(2.5 * torch.randn(64, 256, generator=g), -1)
    p = lp.double().exp()
    exact = ((1 - (p * p).sum(-1)) / 32).numpy()
    assert np.allclose(shb.delta_variance(lp, 32, 1.0), exact)
    for tau in (0.8, 1.25):  # first order in 1/N: 200 draws, 64 seeds -> within a few %
        mc = shb.mc_variance(lp, 0, 200, 64, tau)
        assert mc == pytest.approx(float(shb.delta_variance(lp, 200, tau).mean()), rel=0.08)


def test_tau_choice_compares_at_the_bytes_of_tau_one() -> None:
    def cfg(tau: float, n: int, b: float, v: float) -> dict[str, Any]:
        return {"tau": tau, "draws": n, "bytes_per_position": b, "variance_delta": v,
                "variance_mc": v}  # fmt: skip

    configs = [
        cfg(1.0, 256, 200.0, 0.004),
        cfg(1.0, 384, 250.0, 0.002),
        cfg(0.8, 384, 200.0, 0.004),
        cfg(0.8, 512, 300.0, 0.001),  # 0.002 at 250 B log-log: ratio ~1
        cfg(1.5, 256, 240.0, 0.003),
        cfg(1.5, 320, 260.0, 0.0025),
    ]
    ch = shb.tau_choice(configs, 384)
    by = {t["tau"]: t for t in ch["taus"]}
    assert ch["target_bytes"] == 250.0 and by[1.0]["ratio_delta"] == pytest.approx(1.0)
    assert by[0.8]["ratio_delta"] == pytest.approx(
        np.exp(np.log(0.004) + np.log(250 / 200) / np.log(300 / 200) * np.log(0.25)) / 0.002
    )
    assert by[1.5]["ratio_delta"] > 1.0
    assert ch["best"] == min(by, key=lambda t: by[t]["ratio_delta"])


def test_chart_keeps_a_tau_variant_apart_from_plain_sampled() -> None:
    mean = {
        "online_kd": {"kl": 1.0},
        "offline_sampled@384": {"kl": 0.9, "bytes_per_position": 240.0},
        "offline_sampled@448~tau0.8": {"kl": 0.95, "bytes_per_position": 245.0},
        "offline_topk_tail@128": {"kl": 0.92, "bytes_per_position": 239.0},
    }
    series, online = distill_series({"mean": mean})
    assert online == 1.0
    assert series == {
        "sampled": [(240.0, 0.9)],
        "sampled tau=0.8": [(245.0, 0.95)],
        "topk_tail": [(239.0, 0.92)],
    }


def test_tau_page_states_command_load_and_choice(tmp_path: Path) -> None:
    def cfg(tau: float, n: int, b: float, v: float) -> dict[str, Any]:
        return {"tau": tau, "draws": n, "bytes_per_position": b, "variance_delta": v,
                "variance_mc": v, "variance_delta_mc_rows": v, "mean_distinct": 9.0}  # fmt: skip

    configs = [
        cfg(1.0, 384, 250.0, 0.002),
        cfg(1.0, 256, 200.0, 0.003),
        cfg(0.9, 384, 260.0, 0.003),
    ]
    rep = {
        **shb.run_fields(["--taus", "0.9"], (1.0, 2.0, 3.0), 0.0),
        "teacher": {"vocab_size": 1024, "rows": 10},
        "sequences": 2,
        "mc_rows": 10,
        "reps": 2,
        "encoding": "float16",
        "configs": configs,
        "choice": shb.tau_choice(configs, 384),
    }
    text = shb.write_pages(tmp_path / "t.json", rep, shb.tau_markdown(rep))
    page = (tmp_path / "t.md").read_text()
    assert text is rep and page.startswith("# Proposal temperature")
    assert "--taus 0.9" in page and "load average 1.00, 2.00, 3.00 at the start" in page
    assert "| 0.9 | out of grid |" in page and "**tau = 1**" in page
