"""benchmarks/loss_small_vocab_cpu.py runs as its docstring prints it and times every impl."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MS = r"([\d.]+) ms \(CPU ([\d.]+) ms\)"


def _bench(*args: str) -> str:
    r = subprocess.run(
        [sys.executable, "benchmarks/loss_small_vocab_cpu.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert re.search(r"^1 torch thread; 1-minute load average [\d.]+ at the start$", r.stdout, re.M)
    return r.stdout


def test_small_vocab_loss_bench_prints_every_impl_and_the_dense_loss() -> None:
    out = _bench("--repeats", "3")
    got = re.findall(rf"^(\w+) k=(\d+) topk_distill_loss impl=(\w+): {MS}$", out, re.M)
    impls = ["auto", "dense", "forward_chunked", "fused_chunked", "small_vocab"]
    cases = [("topk_tail", "48"), ("topk_tail", "128"), ("sampled", "64"), ("sampled", "174")]
    assert [(c, k, i) for c, k, i, _, _ in got] == [(c, k, i) for c, k in cases for i in impls]
    assert all(float(ms) > 0 and float(cpu) > 0 for *_, ms, cpu in got)
    assert len(re.findall(rf"^\w+ k=\d+ dense full-vocabulary loss: {MS}$", out, re.M)) == 4
    assert len(re.findall(rf"^topk_tail k=(48|128) gather-based sketch: {MS}$", out, re.M)) == 2


def test_sweep_prints_the_ratio_per_shape() -> None:
    out = _bench("--sweep", "--repeats", "1")
    got = re.findall(
        r"^sweep N=(\d+) V=(\d+): small_vocab [\d.]+ ms CPU, .* ratio ([\d.]+)", out, re.M
    )
    assert len(got) == 8 and ("512", "1024") == got[0][:2]
    assert all(float(r) > 0 for *_, r in got)
