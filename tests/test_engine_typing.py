"""mypy on the engine package (``logitcache.server.engine``): clean, and kept clean.

The folders map to ``logitcache.*`` only through setuptools ``package-dir``, so the check runs
on a temporary tree of symlinks ``logitcache/<room> -> <room>/``. ``cache_format/`` and
``client/`` are not gated yet: mypy reports errors in code other helpers own (see
benchmarks/results/server.md, "Type checking")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("logitcache.server.engine",)


def mypy(tmp_path: Path, packages: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    tree = tmp_path / "tree" / "logitcache"
    tree.mkdir(parents=True)
    for room in ("cache_format", "client", "server", "fixtures"):
        (tree / room).symlink_to(ROOT / room)
    argv = [sys.executable, "-m", "mypy", "--python-executable", sys.executable]
    argv += ["--namespace-packages", "--explicit-package-bases", "--ignore-missing-imports"]
    # a persistent cache: the first run reads torch/transformers stubs (minutes on 2 busy cores)
    cache = Path.home() / ".cache" / "logitcache" / "mypy"
    argv += ["--follow-imports=silent", "--cache-dir", str(cache)]
    argv += ["--disallow-untyped-defs", "--warn-unused-ignores"]
    for p in packages:
        argv += ["-p", p]
    return subprocess.run(argv, cwd=tree.parent, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_engine_package_is_mypy_clean(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    out = mypy(tmp_path, CHECKED)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "Success" in out.stdout
