"""``benchmarks/run_with_tree.py`` (A/B runs of two trees): the script it runs imports
``logitcache.cache_format`` from the folder given, not from this checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_script_runs_on_the_other_tree(tmp_path):
    other = tmp_path / "base" / "cache_format"
    shutil.copytree(ROOT / "cache_format", other, ignore=shutil.ignore_patterns("__pycache__"))
    (other / "marker.py").write_text("WHERE = 'other tree'\n")
    script = tmp_path / "probe.py"
    script.write_text(
        "import sys\n"
        "from logitcache.cache_format import marker, spec\n"
        "print(marker.WHERE, spec.__file__, sys.argv[1:])\n"
    )
    out = subprocess.run(
        [sys.executable, "benchmarks/run_with_tree.py", str(other), str(script), "--x", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith("other tree ") and str(other / "spec.py") in out
    assert out.rstrip().endswith("['--x', '1']")
