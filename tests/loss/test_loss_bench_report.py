"""``benchmarks/loss_floor_report.py``: the plot and tables of the committed H200 result."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_report_command_renders_png_and_tables(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location(
        "loss_floor_report", ROOT / "benchmarks" / "loss_floor_report.py"
    )
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    js = tmp_path / "loss_floor.json"  # a copy: the PNG is written next to the JSON
    shutil.copy(ROOT / "benchmarks" / "results" / "loss_floor.json", js)
    # the docstring's command: python benchmarks/loss_floor_report.py <json>
    monkeypatch.setattr(sys, "argv", ["loss_floor_report.py", str(js)])
    report.main()
    out = capsys.readouterr().out
    png = tmp_path / "loss_floor.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    # the 256K floor row of the committed run, as written in results/loss.md
    assert "| floor | 2048 | 262144 | 1309.8 | 631 | 88.5% | 6.810 | 6.312 | +0.498 |" in out
    for vocab, d in [(128256, 4096), (201088, 4096), (128256, 8192)]:
        assert f"**V = {vocab}, d = {d}**" in out
