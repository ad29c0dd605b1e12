"""Shared helpers of the cache-format tests: synthetic records and manifests."""

from __future__ import annotations

import numpy as np
from logitcache.cache_format import Manifest, SequenceRecord


def make_manifest(k: int = 8, vocab_size: int = 1000, **kw) -> Manifest:
    base = dict(
        teacher_model="tiny-teacher",
        teacher_revision="r1",
        tokenizer_fingerprint="sha256:" + "ab" * 32,
        vocab_size=vocab_size,
        k=k,
        dataset="synthetic",
    )
    base.update(kw)
    return Manifest(**base)


def make_record(
    rng: np.random.Generator,
    length: int,
    k: int,
    vocab: int,
    key: str | None = None,
    tail: bool = True,
) -> SequenceRecord:
    """A valid record: distinct ids per row, descending finite logprobs, consistent tail mass."""
    ids = rng.integers(0, vocab, size=length, dtype=np.int32)
    rows = length - 1
    topk = np.stack([rng.choice(vocab, size=k, replace=False) for _ in range(rows)]).astype(
        np.int32
    )
    logits = rng.normal(size=(rows, k)).astype(np.float64) * 2
    lp = -np.sort(-logits, axis=1) - np.log(np.exp(logits).sum(axis=1, keepdims=True) * 1.25)
    lp = lp.astype(np.float32)
    t = np.clip(1 - np.exp(lp.astype(np.float64)).sum(axis=1), 0, 1).astype(np.float32)
    return SequenceRecord(key, ids, topk, lp, t if tail else None)


def make_records(
    n: int,
    k: int = 8,
    vocab: int = 1000,
    seed: int = 0,
    min_len: int = 2,
    max_len: int = 40,
    prefix: str = "s",
) -> list[SequenceRecord]:
    rng = np.random.default_rng(seed)
    return [
        make_record(rng, int(rng.integers(min_len, max_len + 1)), k, vocab, key=f"{prefix}{i}")
        for i in range(n)
    ]
