"""Smoke test of ``python -m benchmarks.loader hidden --quick`` (the loader over a hidden cache,
FORMAT.md 4.10): it runs from the repository root and writes real rows to a CSV."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_loader_hidden_mode_quick(tmp_path: Path) -> None:
    csv_path = tmp_path / "rows.csv"
    cmd = ["-m", "benchmarks.loader", "hidden", "--quick", "--root", str(tmp_path / "c")]
    out = subprocess.run(
        [sys.executable, "-W", "ignore", *cmd, "--csv", str(csv_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    with csv_path.open(newline="") as f:
        rows = {(r["case"], r["metric"]): float(r["value"]) for r in csv.DictReader(f)}
    for case in ("1 process sequential", "1 process full_shuffle", "0 workers", "1 workers"):
        assert rows[(f"hidden d=256 {case}", "pos_per_s")] > 0
        mbs = rows[(f"hidden d=256 {case}", "hidden_MB_per_s")]
        assert mbs == rows[(f"hidden d=256 {case}", "pos_per_s")] * 512 / 1e6
    # standard-normal bfloat16 states: about 0.72 of 2 d = 512 bytes per row after compression
    assert 300 < rows[("hidden d=256 store", "bytes_per_position")] < 560
