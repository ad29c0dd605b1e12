"""benchmarks/writer_append_costs.py runs (tiny store) and reports both measurements."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "writer_append_costs.py"


def test_writer_append_costs_runs(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    args = ["--k", "8", "--length", "32", "--prefill", "400", "--writers", "2"]
    args += ["--seqs", "4", "--appends", "2", "--json", str(out)]
    proc = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert set(r["reopen_ms"]) == {"open", "first", "second"}
    s = r["steady"]
    assert s["rows_per_append"] == 4 * 31
    assert {"encode", "compress", "object writes", "directory fsyncs", "commit"} <= set(
        s["timer_ms"]
    )
    assert s["thread_ms"]["zarr_io"] > 0 and r["direct_io"] in (True, False)
