"""Vocab-parallel and FSDP2-sharded lm-heads (gloo processes on CPU) match one process.

Tolerance: relative error 1e-10 in float64 for the loss and every gradient (the sharded run
differs only in the order of one log-sum-exp and of the ``grad_h`` sum over ranks).
"""

from __future__ import annotations

import pytest
from loss_support import spawn_workers as _spawn


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
