"""benchmarks/point_read_levels.py times one ``sequence(i)`` by layer of the compiled point read
(issue #14): a smoke run on a small ``random_access_raw`` store."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from format_support import make_manifest, make_records
from logitcache.cache_format import CacheWriter, fastdecode, spec

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "point_read_levels.py"

pytestmark = pytest.mark.skipif(not fastdecode.ready(), reason="numba or C symbols missing")


def test_every_layer_is_timed_inside_the_whole_call(tmp_path: Path) -> None:
    recs = make_records(20, k=40, vocab=300, seed=2, min_len=2, max_len=90)
    url = tmp_path / "raw"
    with CacheWriter.open(url, make_manifest(k=40, vocab_size=300), layout=spec.LAYOUTS[
        "random_access_raw"
    ]) as w:  # fmt: skip
        w.append(recs)
    cmd = [sys.executable, str(BENCH), str(url), "--reads", "16", "--passes", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2
    for line in lines:
        got = ast.literal_eval(line)
        layers = ["kernel", "_run", "read_arrays", "_fetch_fast", "_fetch", "_records", "sequence"]
        assert list(got) == layers
        assert all(got[a] <= got[b] for a, b in zip(layers, layers[1:], strict=False))
        assert got["kernel"] > 0
