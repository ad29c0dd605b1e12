"""benchmarks/plots.py: the PNG helper benchmark owners call (and its JSON command line)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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


def _docstring_commands() -> list[list[str]]:
    """The ``plots.py distill|loss`` commands exactly as benchmarks/plots.py's docstring prints
    them (line continuations joined)."""
    text = (ROOT / "benchmarks" / "plots.py").read_text().replace("\\\\\n", " ")
    cmds = []
    for line in text.splitlines():
        words = line.split()
        if words[:3] in (
            [".venv/bin/python", "benchmarks/plots.py", "distill"],
            [".venv/bin/python", "benchmarks/plots.py", "loss"],
        ):
            cmds.append(words)
    return cmds


def test_committed_result_pngs_are_made_by_the_printed_commands(tmp_path: Path) -> None:
    """The distillation and loss PNGs that RESULTS.md embeds are what the printed commands make
    from the committed result JSONs (run with the outputs redirected to tmp_path, the PNGs must
    equal the committed ones byte for byte: the plot is deterministic)."""
    pytest.importorskip("matplotlib")
    cmds = _docstring_commands()
    assert [c[2] for c in cmds] == ["distill", "loss"]
    made: list[str] = []
    for cmd in cmds:
        args = cmd[2:]
        out = args[-1]
        target = tmp_path / Path(out).name if out.endswith(".png") else tmp_path
        args = [*args[:-1], str(target)]
        r = subprocess.run(
            [sys.executable, str(ROOT / cmd[1]), *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert r.returncode == 0, r.stderr
        made += r.stdout.split()
    names = sorted(Path(p).name for p in made)
    assert names == ["distill_kl_bytes.png", "loss_memory.png", "loss_time.png"]
    for name in names:
        committed = ROOT / "benchmarks" / "results" / name
        assert (tmp_path / name).read_bytes() == committed.read_bytes(), name
