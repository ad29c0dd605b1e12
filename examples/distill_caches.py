"""The caches a comparison trains from, derived from the service's cache, and their size on disk.

* :func:`derive_topk_cache`: a ``k' < k`` top-k cache holding the first ``k'`` columns of every
  row of a scored cache (exactly what the service writes at ``k'``: the rows are sorted, so the
  top ``k'`` are a prefix; the writer recomputes the tail mass from them);
* :func:`sampled_cache`: a ``targets = "sampled"`` cache of the same sequences (same keys, same
  order), drawn from the PyTorch teacher's full distribution with the estimator of
  :mod:`logitcache.cache_format.sampling` (FORMAT.md 4.4);
* :func:`bytes_per_position`: the store's bytes on disk (every file under it) per cached row.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

APPEND_SEQUENCES = 256


def store_bytes(url: str) -> int:
    """Bytes of every file under a local store directory (what ``du -b`` counts)."""
    total = 0
    for dirpath, _, files in os.walk(url):
        total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    return total


def bytes_per_position(url: str) -> float:
    """:func:`store_bytes` / committed rows (positions with a teacher target)."""
    from logitcache.cache_format import CacheReader

    return store_bytes(url) / max(1, CacheReader(url).num_rows)


def _batches(n: int, size: int) -> Iterator[range]:
    for s in range(0, n, size):
        yield range(s, min(n, s + size))


def derive_topk_cache(src: str, dst: str, k: int, limit: int | None = None) -> str:
    """Write the first ``k`` columns of ``src`` (its first ``limit`` sequences) into a new cache
    at ``dst`` (idempotent: known keys are skipped, so a finished cache is left as it is)."""
    from logitcache.cache_format import CacheReader, CacheWriter, SequenceRecord

    reader = CacheReader(src)
    m = reader.manifest
    if not 1 <= k <= m.k:
        raise ValueError(f"k={k} must be in [1, {m.k}] (the source cache's k)")
    manifest = m.model_copy(update={"k": k, "dataset": m.dataset, "extra": dict(m.extra)})
    n = reader.num_sequences if limit is None else min(limit, reader.num_sequences)
    with CacheWriter.open(dst, manifest) as w:
        for rng in _batches(n, APPEND_SEQUENCES):
            recs = []
            for i in rng:
                r = reader.sequence(i)
                if w.contains(r.key):
                    continue
                recs.append(
                    SequenceRecord(
                        r.key,
                        r.input_ids,
                        r.topk_ids[:, :k],
                        r.topk_logprobs[:, :k],
                        entropy=r.entropy,  # a source with per-row entropy keeps it
                        actual_logprob=r.actual_logprob,  # and its actual-token logprobs
                    )
                )
            if recs:
                w.append(recs)
    return dst


def sampled_caches(
    src: str,
    dsts: dict[int, str],
    teacher: Any,
    *,
    seed: int,
    proposal_temperature: float = 1.0,
    limit: int | None = None,
    head: int = 0,
) -> dict[int, str]:
    """Sampled caches of ``src``'s sequences (its first ``limit``), one per number of draws
    (``dsts = {draws: url}``), from one teacher pass: per row ``draws`` ids from
    ``q ∝ p^(1/tau)`` with ``p`` the teacher's distribution (``teacher`` already at the cache's
    temperature, e.g. :func:`distill.sharpen`), stored as ids and log importance weights (same
    keys, same order as ``src``; idempotent like :func:`derive_topk_cache`). ``head = m > 0``:
    the head + residual estimator (the teacher's top-``m`` exact, ``draws`` from the rest;
    ``k = m + draws`` slots, ``sampling.head = m`` in the manifest)."""
    from logitcache.cache_format import CacheReader, CacheWriter, SequenceRecord
    from logitcache.cache_format.sampling import sample_rows, sampling_manifest, uniforms

    reader = CacheReader(src)
    m = reader.manifest
    writers = {
        n: CacheWriter.open(
            url,
            m.model_copy(
                update={
                    "k": int(n) + int(head),
                    "targets": "sampled",
                    "actual_logprob": False,  # kept by top-k caches only (FORMAT.md 4.12)
                    "sampling": sampling_manifest(n, proposal_temperature, seed, head),
                    "extra": {**m.extra, "sampled_by": "examples/distill_caches.py (PyTorch)"},
                }
            ),
        )
        for n, url in dsts.items()
    }
    total = reader.num_sequences if limit is None else min(limit, reader.num_sequences)
    try:
        with torch.no_grad():
            for rng in _batches(total, APPEND_SEQUENCES):
                recs: dict[int, list] = {n: [] for n in writers}
                for i in rng:
                    r = reader.sequence(i)
                    todo = [n for n, w in writers.items() if not w.contains(r.key)]
                    if not todo:
                        continue
                    ids = torch.as_tensor(r.input_ids, dtype=torch.long)[None]
                    lp = torch.log_softmax(teacher(input_ids=ids).logits[0, :-1].float(), -1)
                    for n in todo:
                        u = uniforms(seed, r.key, lp.shape[0], n)
                        kw = {"head": head} if head else {}
                        s_ids, s_lw = sample_rows(lp, u, proposal_temperature, **kw)
                        recs[n].append(SequenceRecord(r.key, r.input_ids, s_ids, s_lw))
                for n, batch in recs.items():
                    if batch:
                        writers[n].append(batch)
    finally:
        for w in writers.values():
            w.close()
    return dsts


def selected_share(url: str, fraction: float) -> float:
    """Share of a cache's rows that ``StreamConfig(entropy_top_fraction=fraction)`` trains on
    (:func:`logitcache.client.selection.selected_rows` per sequence)."""
    from logitcache.cache_format import CacheReader
    from logitcache.client.selection import selected_rows

    reader = CacheReader(url)
    kept = sum(int(selected_rows(r.entropy, fraction, r.loss_mask).sum()) for r in reader)
    return kept / max(1, reader.num_rows)


def mean_distinct(url: str, rows: int = 50_000) -> float:
    """Mean number of distinct ids (weight > 0) per row of a sampled cache (first ``rows``)."""
    from logitcache.cache_format import CacheReader
    from logitcache.cache_format.sampling import PAD_LOGPROB

    reader = CacheReader(url)
    block = reader.rows(0, min(rows, reader.num_rows))
    return float((block.topk_logprobs > PAD_LOGPROB / 2).sum(-1).mean())


def pick_for_budget(candidates: dict[int, float], budget: float) -> int:
    """The candidate (k or draws) whose measured bytes/position is closest to ``budget``."""
    return min(candidates, key=lambda c: (abs(math.log(candidates[c] / budget)), c))


def cache_dir(root: Path, name: str) -> str:
    """Absolute path of cache ``name`` under ``root``."""
    return str((root / name).resolve())


__all__ = [
    "bytes_per_position",
    "cache_dir",
    "derive_topk_cache",
    "mean_distinct",
    "pick_for_budget",
    "sampled_caches",
    "selected_share",
    "store_bytes",
]
