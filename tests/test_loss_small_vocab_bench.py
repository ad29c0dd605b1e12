"""benchmarks/loss_small_vocab_cpu.py runs as its docstring prints it and times every impl."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_small_vocab_loss_bench_prints_every_impl_and_the_dense_loss() -> None:
    r = subprocess.run(
        [sys.executable, "benchmarks/loss_small_vocab_cpu.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    got = re.findall(r"^k=(\d+) topk_distill_loss impl=(\w+): ([\d.]+) ms$", r.stdout, re.M)
    impls = ["auto", "dense", "forward_chunked", "fused_chunked"]
    assert [(k, i) for k, i, _ in got] == [(k, i) for k in ("128", "174") for i in impls]
    assert all(float(ms) > 0 for _, _, ms in got)
    assert len(re.findall(r"^k=(128|174) gather-based sketch: [\d.]+ ms$", r.stdout, re.M)) == 2
    assert re.search(r"^full-vocabulary dense loss: [\d.]+ ms$", r.stdout, re.M)
