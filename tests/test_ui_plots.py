"""benchmarks/plots.py: the PNG helper benchmark owners call (and its JSON command line)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_plot_from_json_is_a_deterministic_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    spec = {
        "series": {"dense": [[1024, 2.0], [4096, 8.0]], "fused": [[4096, 0.9], [1024, 0.4]]},
        "title": "peak memory",
        "xlabel": "positions",
        "ylabel": "GiB",
        "logx": True,
        "hline": 1.0,
        "hline_label": "goal",
        "note": "command: x; machine: y",
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    outs = []
    for i in range(2):
        out = tmp_path / f"p{i}.png"
        r = subprocess.run(
            [
                sys.executable,
                str(ROOT / "benchmarks" / "plots.py"),
                str(tmp_path / "spec.json"),
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        outs.append(out.read_bytes())
    assert outs[0][:8] == b"\x89PNG\r\n\x1a\n" and len(outs[0]) > 5000
    assert outs[0] == outs[1]


def test_plot_refuses_nothing(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from plots import line_plot
    finally:
        sys.path.pop(0)
    with pytest.raises(ValueError, match="nothing to plot"):
        line_plot(tmp_path / "x.png", {})
    assert not (tmp_path / "x.png").exists()
