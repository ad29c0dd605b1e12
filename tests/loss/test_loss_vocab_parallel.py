"""Vocab-parallel and FSDP2-sharded lm-heads (gloo processes on CPU) match one process.

Tolerance: relative error 1e-10 in float64 for the loss and every gradient (the sharded run
differs only in the order of one log-sum-exp and of the ``grad_h`` sum over ranks).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parents[1]  # tests/: loss_support.py

# The ranks fork from a fresh interpreter that has imported only torch and the workers: forking
# the pytest process itself hangs once an earlier test file on the same xdist worker has started
# threads (the in-process vLLM engine, OpenMP pools), and would inherit any process group left
# initialised there. spawn would re-import torch in every rank (~10 s each on 2 cores).
_LAUNCH = """
import socket, sys
import torch.multiprocessing as mp
import loss_support

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
fn, world = getattr(loss_support, sys.argv[1]), int(sys.argv[2])
mp.start_processes(fn, args=(world, port), nprocs=world, start_method="fork", join=True)
"""


def _spawn(worker: str, world: int) -> None:
    run = subprocess.run(
        [sys.executable, "-c", _LAUNCH, worker, str(world)],
        cwd=_HERE,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_equals_single_process(world):
    """8 objectives/options (world 4: the 4 with CE, tail, sampled rows and recompute), the
    ColwiseParallel DTensor path, and different-rows rejection; world 4 splits V=41 unevenly
    (11, 11, 11, 8)."""
    _spawn("vocab_parallel_worker", world)


@pytest.mark.timeout(120)
def test_fsdp2_sharded_lm_head_grads_equal_unsharded_run():
    _spawn("fsdp_worker", 2)
