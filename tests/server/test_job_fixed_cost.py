"""benchmarks/job_fixed_cost.py runs small jobs one after another into one cache (or, with
``--new-caches``, each into a cache it makes) and reports each job's process CPU (issue #19): a
smoke run of two tiny jobs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "job_fixed_cost.py"


@pytest.mark.parametrize("new_caches", [False, True], ids=["one-cache", "new-caches"])
def test_two_tiny_jobs_are_timed(tmp_path: Path, new_caches: bool) -> None:
    out = tmp_path / "fixed.json"
    cmd = [sys.executable, str(BENCH), "--prefill", "6", "--prefill-length", "4", "--jobs", "2"]
    cmd += ["--job-sequences", "2", "--length", "8", "--k", "4", "--pause", "0", "--json", str(out)]
    proc = subprocess.run(
        cmd + (["--new-caches"] if new_caches else []), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert len(got["job_cpu_ms"]) == 2 and all(ms > 0 for ms in got["job_cpu_ms"])
    assert got["median_ms"] == got["job_cpu_ms"][1] == got["min_ms"]
    assert got["new_caches"] is new_caches
    where = "into new caches" if new_caches else "into a 6-sequence cache"
    assert where in proc.stdout and "process CPU per job" in proc.stdout
