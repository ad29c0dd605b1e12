"""The harness's PNG helper (``benchmarks.harness.line_plot``) and the committed charts: the loss
and distillation PNGs that RESULTS.md and the README show are what the printed commands make
from the committed result JSONs, byte for byte."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_line_plot_is_a_deterministic_png_and_refuses_nothing(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from benchmarks.harness import line_plot

    series = {"dense": [(1024, 2.0), (4096, 8.0)], "fused": [(4096, 0.9), (1024, 0.4)]}
    kw = dict(
        title="peak memory",
        xlabel="positions",
        ylabel="GiB",
        logx=True,
        hline=1.0,
        hline_label="goal",
        note="command: x; machine: y",
    )
    outs = [line_plot(tmp_path / f"p{i}.png", series, **kw).read_bytes() for i in range(2)]
    assert outs[0][:8] == b"\x89PNG\r\n\x1a\n" and len(outs[0]) > 5000
    assert outs[0] == outs[1]
    with pytest.raises(ValueError, match="nothing to plot"):
        line_plot(tmp_path / "x.png", {})
    assert not (tmp_path / "x.png").exists()


def _docstring_commands() -> list[list[str]]:
    """The ``plot`` commands exactly as the loss suite's and the distillation study's
    docstrings print them (line continuations joined)."""
    cmds = []
    for path in (ROOT / "benchmarks" / "loss.py", ROOT / "experiments" / "distill.py"):
        text = path.read_text().replace("\\\\\n", " ").replace("\\\n", " ")
        for line in text.splitlines():
            words = line.split("#")[0].split()
            if words[:2] == ["python", "-m"] and words[3:4] == ["plot"]:
                cmds.append(words)
    return cmds


@pytest.mark.subprocess
def test_committed_result_pngs_are_made_by_the_printed_commands(tmp_path: Path) -> None:
    """Run with the outputs redirected to tmp_path, the PNGs must equal the committed ones byte
    for byte (the plot is deterministic)."""
    pytest.importorskip("matplotlib")
    cmds = _docstring_commands()
    assert [c[2] for c in cmds] == ["benchmarks.loss", "experiments.distill"]
    made: dict[str, Path] = {}
    for cmd in cmds:
        *args, out = cmd[3:]
        committed_dir = ROOT / (out if not out.endswith(".png") else str(Path(out).parent))
        target = tmp_path / Path(out).name if out.endswith(".png") else tmp_path
        r = subprocess.run(
            [sys.executable, "-m", cmd[2], *args, str(target)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert r.returncode == 0, r.stderr
        for p in r.stdout.split():
            made[Path(p).name] = committed_dir / Path(p).name
    assert sorted(made) == ["distill_kl_bytes.png", "loss_memory.png", "loss_time.png"]
    for name, committed in made.items():
        assert (tmp_path / name).read_bytes() == committed.read_bytes(), name
