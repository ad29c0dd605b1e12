"""Vocab-parallel and FSDP2-sharded lm-heads (gloo processes on CPU) match one process.

Tolerance: relative error 1e-10 in float64 for the loss and every gradient (the sharded run
differs only in the order of one log-sum-exp and of the ``grad_h`` sum over ranks).
"""

from __future__ import annotations

import socket

import pytest
import torch.multiprocessing as mp
from loss_support import fsdp_worker, vocab_parallel_worker


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, world: int) -> None:
    # fork: the children inherit the imported torch (spawn would re-import it: ~10 s per rank).
    # A process group left initialised in this pytest process by an earlier test would be
    # inherited too ("default process group twice"): then pay for spawn.
    import torch.distributed as dist

    method = "spawn" if dist.is_available() and dist.is_initialized() else "fork"
    mp.start_processes(fn, args=(world, _port()), nprocs=world, start_method=method, join=True)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_equals_single_process(world):
    """8 objectives/options (world 4: the 4 with CE, tail, sampled rows and recompute), the
    ColwiseParallel DTensor path, and different-rows rejection; world 4 splits V=41 unevenly
    (11, 11, 11, 8)."""
    _spawn(vocab_parallel_worker, world)


@pytest.mark.timeout(120)
def test_fsdp2_sharded_lm_head_grads_equal_unsharded_run():
    _spawn(fsdp_worker, 2)
