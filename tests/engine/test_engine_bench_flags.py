"""benchmarks/server_bench.py takes every documented flag value: ``--clients 0`` used to crash
(``IndexError`` in ``percentile`` on an empty latency list); impossible values are refused with
a usage error (exit 2) before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "server_bench.py"
sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.mark.fast
def test_percentile_of_nothing_is_none() -> None:
    import server_bench

    assert server_bench.percentile([], 99) is None
    assert server_bench.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert server_bench.percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0


@pytest.mark.fast
@pytest.mark.parametrize(
    "flags", [["--clients", "-1"], ["--repeats", "0"], ["--sequences", "0"], ["--length", "1"]]
)
def test_impossible_values_are_usage_errors(flags: list[str]) -> None:
    out = subprocess.run([sys.executable, str(BENCH), *flags], capture_output=True, text=True)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "need --sequences" in out.stderr


@pytest.mark.slow
def test_clients_zero_runs_end_to_end(tmp_path: Path, tiny: object) -> None:
    out_json = tmp_path / "server.json"
    argv = [sys.executable, str(BENCH), "--sequences", "8", "--length", "32", "--k", "4"]
    argv += ["--repeats", "1", "--clients", "0", "--json", str(out_json)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(out_json.read_text())
    assert result["concurrent"] is None
    assert result["job"][0]["tokens"] == 8 * 32
