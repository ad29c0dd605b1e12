"""mypy on the typed packages: ``logitcache.protocol``, ``cache_format``, ``client`` (its loss
too) and ``server.engine``: clean, and kept clean, every function typed (the configuration is
``[tool.mypy]`` in pyproject.toml).

One mypy run checks them all, so the suite pays one interpreter start and one read of the
torch/numpy/zarr stubs. The folders map to ``logitcache.*`` only through setuptools
``package-dir``, so the check runs on a temporary tree of symlinks ``logitcache/<room> ->
<room>/``. Its cache lives in the system temp directory (kept between runs: a cold cache takes
minutes on 2 busy cores, a warm one seconds)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ("cache_format", "client", "server", "fixtures", "protocol")
CHECKED = (
    "logitcache.protocol",
    "logitcache.cache_format",
    "logitcache.client",
    "logitcache.server.engine",
)


def mypy(tmp_path: Path, packages: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    tree = tmp_path / "tree" / "logitcache"
    tree.mkdir(parents=True)
    for room in ROOMS:
        (tree / room).symlink_to(ROOT / room)
    cache = Path(tempfile.gettempdir()) / "logitcache-mypy-cache"
    argv = [sys.executable, "-m", "mypy", "--python-executable", sys.executable]
    argv += ["--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(cache)]
    for p in packages:
        argv += ["-p", p]
    return subprocess.run(argv, cwd=tree.parent, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_typed_packages_are_mypy_clean(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    out = mypy(tmp_path, CHECKED)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "Success" in out.stdout
