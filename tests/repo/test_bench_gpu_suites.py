"""Smoke tests of the GPU suites at tiny shapes on the CPU, so their code runs between device
runs: ``python -m benchmarks.service gpu`` (a teacher job through the real service against the
bare engine) and ``python -m benchmarks.train_step`` (online vs offline distillation steps)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-W", "ignore", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _metrics(path: Path) -> dict[tuple[str, str], float]:
    with path.open(newline="") as f:
        return {(r["case"], r["metric"]): float(r["value"]) for r in csv.DictReader(f)}


@pytest.mark.slow
def test_service_gpu_mode_scores_a_job_that_matches_the_bare_engine(tmp_path: Path) -> None:
    out, rows = tmp_path / "tj.json", tmp_path / "rows.csv"
    _run(
        "-m", "benchmarks.service", "gpu", "--shapes", "tiny", "--sequences", "6",
        "--seq-len", "40", "--k", "8", "--bare-sequences", "2", "--tail-sequences", "3",
        "--inproc-sequences", "4",
        "--json", str(out), "--csv", str(rows), "--work", str(tmp_path / "work"),
    )  # fmt: skip
    whole = json.loads(out.read_text())
    # whether the compiled encode and JSONL reader were there, as this process finds them
    from logitcache.cache_format import fastencode
    from logitcache.server.inputs import jsonids

    want = {"encode_numba": fastencode.ready(), "jsonl_ids_msgspec": jsonids.ready()}
    assert whole["fast_paths"] == want
    r = whole["shapes"]["tiny"]
    # the in-process job, measured as the cpu mode measures it: the engine's device work apart
    ip = r["bare"]["inproc"]
    assert ip["positions"] == 4 * 39 and ip["device_us_per_position"] > 0
    assert sum(ip["stage_us_per_position"].values()) == pytest.approx(ip["us_per_position"])
    assert r["job_path_cpu_us_per_position"] == ip["outside_engine_us_per_position"]
    engine_host = ip["stage_us_per_position"]["engine"]
    assert ip["us_per_position"] - engine_host == pytest.approx(r["job_path_cpu_us_per_position"])
    assert r["job"]["positions"] == 6 * 39 and r["cache"]["rows"] == 6 * 39
    # one HTTP job per --job-inflight-batches value (default: the server's 2)
    assert r["jobs_by_inflight_batches"]["2"]["tokens_per_s"] == r["job"]["tokens_per_s"]
    # the service's rows are the bare engine's (same engine code, same weights)
    assert r["cache"]["top10_ids_equal_to_bare"] == 1.0
    assert r["cache"]["top1_logprob_max_abs_diff_vs_bare"] < 1e-2  # float16 in the cache
    assert r["cache"]["tail_mass"]["rows_read"] == 3 * 39
    assert 0.0 < r["cache"]["tail_mass"]["mean"] < 1.0
    assert r["job"]["server_cpu_s"] > 0 and r["bare"]["engine"]["host_cpu_s"] > 0
    assert r["cache"]["bytes_per_position"] > 8 * 2  # at least ids and logprobs, compressed
    m = _metrics(rows)
    assert m[("tiny", "job_tokens_per_s")] == pytest.approx(r["job"]["tokens_per_s"])
    assert m[("tiny", "job_vs_bare_device")] == pytest.approx(r["ratio_job_vs_bare_device"])
    assert r["bare"]["device"]["positions_per_s"] > 0
    assert m[("tiny", "job_path_cpu_per_position")] == pytest.approx(
        ip["outside_engine_us_per_position"]
    )
    assert not (tmp_path / "work" / "model-tiny").exists()  # the weights are removed


def test_train_step_runs_online_and_offline_and_plots(tmp_path: Path) -> None:
    out, rows = tmp_path / "ts.json", tmp_path / "rows.csv"
    _run(
        "-m", "benchmarks.train_step", "run", "--student", "tiny", "--teacher", "tiny",
        "--seq-len", "32", "--tokens", "32", "64", "--k", "8", "--steps", "1",
        "--variants", "online_dense", "offline_local", "--json", str(out),
        "--csv", str(rows), "--work", str(tmp_path / "work"),
    )  # fmt: skip
    r = json.loads(out.read_text())
    for variant in ("online_dense", "offline_local"):
        for tokens in ("32", "64"):
            cell = r["variants"][variant][tokens]
            assert cell["step_s"] > 0 and cell["tokens_per_s"] == pytest.approx(
                int(tokens) / cell["step_s"]
            )
    assert r["largest_fit"] == {"online_dense": 64, "offline_local": 64}
    # the cache was written by the teacher: (warmup + steps) x the largest batch, 31 rows each
    assert r["cache"]["rows"] == (1 + 1) * 2 * 31
    ratios = r["speedup_online_over_offline_step_time"]["online_dense/offline_local"]
    assert set(ratios) == {"32", "64"} and all(v > 0 for v in ratios.values())
    m = _metrics(rows)
    assert m[("offline_local/64", "step_time")] == pytest.approx(
        r["variants"]["offline_local"]["64"]["step_s"]
    )
    png = Path(_run("-m", "benchmarks.train_step", "plot", str(out), str(tmp_path)).strip())
    assert png == tmp_path / "train_step.png" and png.read_bytes()[:4] == b"\x89PNG"
