"""``benchmarks/run_with_tree.py`` (A/B runs of two trees): the script it runs imports
``logitcache.cache_format`` from the folder given, not from this checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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


def test_a_tree_root_maps_each_package_it_holds(tmp_path):
    """A tree's root (as ``git archive | tar -x`` makes it, what ``job_cpu_ab.py`` passes):
    every package found there is taken from it, the others from this checkout."""
    tree = tmp_path / "tree"
    for package in ("cache_format", "client"):
        shutil.copytree(
            ROOT / package, tree / package, ignore=shutil.ignore_patterns("__pycache__")
        )
        (tree / package / "marker.py").write_text(f"WHERE = 'tree {package}'\n")
    script = tmp_path / "probe.py"
    script.write_text(
        "from logitcache.cache_format import marker as a\n"
        "from logitcache.client import marker as b\n"
        "from logitcache import server\n"
        "print(a.WHERE, '|', b.WHERE, '|', server.__path__[0])\n"
    )
    out = subprocess.run(
        [sys.executable, "benchmarks/run_with_tree.py", str(tree), str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert out == f"tree cache_format | tree client | {ROOT / 'server'}"


def test_loader_sys_time_runs_on_a_small_store(tmp_path):
    """``benchmarks/loader_sys_time.py`` (its usage line, on a small store): one line of figures."""
    from format_support import SMALL, write_small_cache

    write_small_cache(tmp_path / "c", SMALL)
    for mode in ("auto", "true", "false"):
        out = subprocess.run(
            [sys.executable, "-W", "ignore", "benchmarks/loader_sys_time.py", str(tmp_path / "c"),
             mode, "1", "--batches", "2"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert out.startswith(f"point_reads={mode} batches ") and " sys " in out
