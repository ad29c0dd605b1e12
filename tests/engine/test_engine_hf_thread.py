"""The transformers backend runs every forward on one thread of its own, whichever thread or
event loop calls it, and keeps a core beside its OpenMP team for the server's other threads."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import pytest
from logitcache.server.engine import SampledTargets
from logitcache.server.engine.hf import intra_op_threads


def test_every_forward_runs_on_the_engines_one_thread(hf_engine: Any, tiny: Any) -> None:
    seqs = tiny.token_sequences("train", max_len=24, min_len=8, limit=3)
    ids = [[1, 2, 3]] * len(seqs)
    keys = [f"k{i}" for i in range(len(seqs))]
    seen: list[tuple[int, str]] = []

    def hook(*_: Any) -> None:
        seen.append((threading.get_ident(), threading.current_thread().name))

    calls = [
        lambda: hf_engine.score(seqs, 4),
        lambda: hf_engine.score_ids(seqs, ids),
        lambda: hf_engine.score_with_ids(seqs, 4, ids),
        lambda: hf_engine.score_hidden(seqs),
        lambda: hf_engine.score_sampled(seqs, keys, SampledTargets(draws=2)),
    ]
    handle = hf_engine.decoder.register_forward_hook(hook)
    try:
        for call in calls:  # each in a new event loop (its own default executor)
            asyncio.run(call())
        other = threading.Thread(target=lambda: asyncio.run(calls[0]()))
        other.start()
        other.join()
    finally:
        handle.remove()
    assert len(seen) >= len(calls) + 1
    assert len({ident for ident, _ in seen}) == 1, seen
    assert seen[0][1].startswith("logitcache-forward")
    hf_engine._teacher_head = None  # made again, on the forward thread
    assert hf_engine.teacher_head().weight.shape[0] == hf_engine.info.vocab_size


@pytest.mark.fast
@pytest.mark.parametrize(
    ("cores", "default", "want"), [(2, 2, 1), (1, 4, 1), (16, 8, 8), (16, 32, 15)]
)
def test_intra_op_threads_leave_a_core(
    monkeypatch: pytest.MonkeyPatch, cores: int, default: int, want: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(cores)), raising=False)
    assert intra_op_threads(default) == want
