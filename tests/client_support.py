"""Helpers for the client tests: hand-built caches written through the real ``CacheWriter``.

In every cache built here, row ``j`` of a sequence has the next token ``x_{j+1}`` as its top-1 id
(the alignment tests rely on it), then ``k - 1`` other distinct ids with smaller logprobs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from logitcache.cache_format import CacheWriter, Manifest, SequenceRecord

VOCAB = 97
K = 4
FINGERPRINT = "test-tokenizer-fingerprint"
# top-k probabilities of every row: descending; the rest (0.15) is the tail mass
PROBS = np.array([0.5, 0.2, 0.1, 0.05])


def make_sequences(num: int, *, seed: int = 0, min_len: int = 2, max_len: int = 40) -> list:
    """``num`` random token sequences (int32 arrays) of lengths in ``[min_len, max_len]``."""
    rng = np.random.default_rng(seed)
    return [
        rng.integers(0, VOCAB, size=int(rng.integers(min_len, max_len + 1))).astype(np.int32)
        for _ in range(num)
    ]


def record_for(input_ids: np.ndarray, key: str | None = None, k: int = K) -> SequenceRecord:
    """A record whose row ``j`` puts ``input_ids[j + 1]`` first, then ``k - 1`` other ids."""
    ids = np.asarray(input_ids, dtype=np.int32)
    rows = len(ids) - 1
    topk = np.zeros((rows, k), dtype=np.int32)
    for j in range(rows):
        target = int(ids[j + 1])
        others = [(target + 1 + 7 * m) % VOCAB for m in range(k - 1)]
        topk[j] = [target, *others]
    lp = np.tile(np.log(PROBS[:k]).astype(np.float32), (rows, 1))
    tail = np.full(rows, 1.0 - PROBS[:k].sum(), dtype=np.float32)
    return SequenceRecord(key, ids, topk, lp, tail)


def manifest(**over: Any) -> Manifest:
    """Manifest of the hand-built caches (fields overridable)."""
    fields = {
        "teacher_model": "hand-built",
        "tokenizer_fingerprint": FINGERPRINT,
        "vocab_size": VOCAB,
        "k": K,
        "logprob_dtype": "float32",
        "dataset": "client tests",
    }
    fields.update(over)
    return Manifest(**fields)


def build_cache(
    url: str | Path,
    sequences: list,
    *,
    storage_options: dict[str, Any] | None = None,
    **manifest_fields: Any,
) -> list[SequenceRecord]:
    """Write ``sequences`` (in order) to a new cache at ``url``; return the records written."""
    records = [record_for(s, key=f"seq-{i}") for i, s in enumerate(sequences)]
    with CacheWriter.open(str(url), manifest(**manifest_fields), storage_options) as writer:
        writer.append(records)
    return records


def collect(iterable: Any) -> list[dict[str, np.ndarray]]:
    """Materialise an iterator of tensor dicts as numpy dicts (copies; bfloat16 tensors as
    their int16 bit patterns, other values such as ``target_kind`` as they are)."""
    return [{name: _as_numpy(value) for name, value in unit.items()} for unit in iterable]


def _as_numpy(value: Any) -> Any:
    import torch

    if not isinstance(value, torch.Tensor):
        return value
    if value.dtype == torch.bfloat16:
        value = value.view(torch.int16)
    return value.numpy().copy()


def same_stream(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> bool:
    """Whether two streams of units are equal field by field."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x.keys() != y.keys():
            return False
        if not all(np.array_equal(x[f], y[f]) for f in x):
            return False
    return True


def segments(unit: dict[str, np.ndarray]) -> list[tuple[int, ...]]:
    """Token tuples of every segment (piece) in an item or a batch, in order."""
    ids, seg = unit["input_ids"], unit["segment_ids"]
    if ids.ndim == 1:
        ids, seg = ids[None], seg[None]
    out = []
    for row_ids, row_seg in zip(ids, seg, strict=True):
        for s in range(1, int(row_seg.max(initial=0)) + 1):
            out.append(tuple(int(t) for t in row_ids[row_seg == s]))
    return out


def tiny_llama() -> Any:
    """A one-layer Llama student for the Trainer tests (vocab 97, hidden 16), its weights drawn
    after ``torch.manual_seed(0)`` (so every call gives the same model)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
    )
    return LlamaForCausalLM(cfg)


def make_dataset(source: Any, **settings: Any) -> Any:
    """``CacheDataset`` of flat keyword settings, split the way the API takes them: the
    ``StreamConfig`` fields, the ``ReadOptions`` fields, the student guards, and the rest as
    ``open_source`` options (``cache=``, ``storage_options=``, HTTP settings). For tests that
    vary settings as one dict; the library itself has no flat form."""
    from dataclasses import fields

    from logitcache.client import CacheDataset, ReadOptions, StreamConfig, open_source

    def take(names: set[str]) -> dict[str, Any]:
        return {n: settings.pop(n) for n in list(settings) if n in names}

    stream = StreamConfig(**take({f.name for f in fields(StreamConfig)}))
    read = ReadOptions(**take({f.name for f in fields(ReadOptions)}))
    guards = take({"tokenizer", "vocab_size", "allow_mismatch"})
    if settings:
        source = open_source(source, **settings)
    return CacheDataset(source, stream, read, **guards)
