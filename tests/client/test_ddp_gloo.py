"""Two CPU ranks (gloo) train from one cache: disjoint coverage, loss agreement, exact resume.

The ``ddp`` suite's smoke test: runs ``benchmarks/ddp.py``'s report on a small synthetic cache
written through the format library: the one-process reference (reading both rank partitions)
in this process, then a real 2-process DDP run that checkpoints half way, then 2 fresh processes
resuming from that checkpoint. The assertions below re-derive every claim from the raw per-step
logs of the runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import benchmarks.ddp as ddp

    work = tmp_path_factory.mktemp("ddp")
    spec = ddp.CacheSpec(num_sequences=80, min_len=12, max_len=48, vocab=384, k=8, seed=3)
    cfg = ddp.TrainConfig(
        nproc=2, backend="gloo", tokens_per_item=48, batch_items=2, hidden=32, heads=2, lr=3e-3
    )
    report = ddp.report(cfg, spec, work, warmup=1)
    loaded = {name: json.loads(Path(p).read_text()) for name, p in report["runs"].items()}
    return {"module": ddp, "report": report, "spec": spec, **loaded}


def _steps(run: dict[str, Any], rank: int) -> list[dict[str, Any]]:
    return run["ranks"][rank]["log"]


def _seen(run: dict[str, Any], rank: int, key: str = "headers") -> list[int]:
    r = run["ranks"][rank]
    trained = [s for e in r["log"] for part in e[key] for s in part]
    drained = [s for part in r[f"drained_{key}"] for s in part]
    return trained + drained


def test_cache_is_valid_and_synthetic(runs: dict[str, Any]) -> None:
    from logitcache.cache_format import CacheReader, validate

    url = runs["report"]["cache"]["url"]
    assert validate(url).ok
    reader = CacheReader(url)
    assert reader.num_sequences == runs["spec"].num_sequences
    rec = reader.sequence(7)
    # row j is the bigram teacher's row for x_j: the same previous token gives the same row
    teacher_ids, _ = runs["module"].bigram_teacher(runs["spec"].vocab, runs["spec"].k, 3)
    np.testing.assert_array_equal(rec.topk_ids, teacher_ids[rec.input_ids[:-1]])


def test_ranks_cover_the_cache_exactly_once(runs: dict[str, Any]) -> None:
    ddp, n = runs["ddp"], runs["spec"].num_sequences
    seen = [_seen(ddp, r) for r in (0, 1)]
    assert all(len(s) == len(set(s)) for s in seen), "a rank saw a sequence twice"
    assert not set(seen[0]) & set(seen[1]), "two ranks saw the same sequence"
    assert sorted(seen[0] + seen[1]) == list(range(n))
    # the dataset's own bookkeeping names the same sequences as the delivered tokens
    for r in (0, 1):
        assert sorted(_seen(ddp, r, "planned")) == sorted(seen[r])
    # most of the epoch was trained on, not just drained
    trained = sum(len(p) for r in (0, 1) for e in _steps(ddp, r) for p in e["headers"])
    assert trained >= 0.8 * n


def test_loss_matches_one_process_with_same_global_batch(runs: dict[str, Any]) -> None:
    one, ddp = runs["one_process"], runs["ddp"]
    a, b = _steps(one, 0), _steps(ddp, 0)
    assert len(a) == len(b) >= 8
    for x, i in zip(a, range(len(a)), strict=True):
        union = sorted(s for r in (0, 1) for p in _steps(ddp, r)[i]["planned"] for s in p)
        assert sorted(s for p in x["planned"] for s in p) == union
        assert x["rows"] == b[i]["rows"]
    la = np.array([e["loss"] for e in a])
    lb = np.array([e["loss"] for e in b])
    np.testing.assert_allclose(lb, la, rtol=1e-4, atol=1e-5)
    assert la[-3:].mean() < la[:3].mean() - 0.05, "the student did not learn"
    # both ranks report the same global loss
    np.testing.assert_array_equal(lb, [e["loss"] for e in _steps(ddp, 1)])


def test_resume_replays_the_same_remaining_order(runs: dict[str, Any]) -> None:
    ddp, resumed = runs["ddp"], runs["resumed"]
    at = runs["report"]["resume"]["checkpoint_step"]
    assert 0 < at < len(_steps(ddp, 0))
    for r in (0, 1):
        after = [e for e in _steps(ddp, r) if e["step"] > at]
        again = _steps(resumed, r)
        assert [e["step"] for e in again] == [e["step"] for e in after]
        assert [e["headers"] for e in again] == [e["headers"] for e in after]
        assert resumed["ranks"][r]["drained_headers"] == ddp["ranks"][r]["drained_headers"]
        np.testing.assert_allclose(
            [e["loss"] for e in again], [e["loss"] for e in after], rtol=1e-6, atol=1e-7
        )


def test_report_figures_are_consistent(runs: dict[str, Any]) -> None:
    rep = runs["report"]
    assert rep["coverage"]["exactly_once"] and rep["coverage_planned"]["exactly_once"]
    tp = rep["throughput"]
    assert tp["one_process"]["rows_per_s"] > 0 and tp["ddp"]["rows_per_s"] > 0
    assert all(0.0 <= s < 1.0 for s in tp["ddp"]["data_wait_share_per_rank"])
    assert all(m["peak_rss_mib"] > 0 for m in rep["memory"]["ddp"])
    text = runs["module"].markdown(rep, "cmd")
    assert "exactly once = **True**" in text
