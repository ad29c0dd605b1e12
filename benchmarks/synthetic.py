"""The benchmarks' one synthetic teacher: realistic top-k rows without a model.

- ids: each row's k ids are successive draws without replacement from a Zipf(s) law over the
  vocabulary (the first-appearance order of i.i.d. Zipf draws), so rank 0 tends to be a frequent
  token. The map frequency-rank -> token id is "bpe-like": ids sorted by ``log(rank) + N(0, 1.5)``
  (frequent tokens have small ids on average, as BPE gives early merges small ids); ``"random"``
  is a uniform permutation (worst case for compression), ``"identity"`` the rank itself.
- logprobs: ``lp_j = -s log(j+1) + noise`` sorted descending, per-row sharpness
  ``s ~ LogNormal(log 1.2, 0.35)``, normalised so that the top-k mass is ``1 - tail`` with
  ``tail ~ Beta(0.6, 6)``.

Two shapes of data: :meth:`Teacher.fixed` (sequences of ``seq_len`` tokens, every row drawn; the
``format`` suite) and :meth:`Teacher.pooled` (sequences of log-normal length around 490 tokens,
sliced out of one pool of drawn rows, so hundreds of millions of positions cost no more to make
than the pool; the ``loader`` and ``format random`` modes). :func:`write_cache` writes either
through :class:`~logitcache.cache_format.CacheWriter`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Teacher", "Data", "write_cache", "store_bytes"]


@dataclass(frozen=True)
class Data:
    """Rows of a synthetic teacher: ``tokens`` (int32), ``ids`` (rows, k) int32, ``logprobs``
    (rows, k) float32, ``tail`` (rows,) float32, and ``bounds``: each sequence's
    ``(row_start, token_start, length)`` in them (a sequence of ``length`` tokens has
    ``length - 1`` rows)."""

    tokens: np.ndarray
    ids: np.ndarray
    logprobs: np.ndarray
    tail: np.ndarray
    bounds: list[tuple[int, int, int]] = field(repr=False)

    @property
    def sequences(self) -> int:
        return len(self.bounds)

    @property
    def positions(self) -> int:
        return sum(n - 1 for _, _, n in self.bounds)

    def records(self, lo: int = 0, hi: int | None = None) -> list[Any]:
        """Sequences ``lo..hi`` as :class:`~logitcache.cache_format.SequenceRecord` (views)."""
        from logitcache.cache_format import SequenceRecord

        out = []
        for i in range(lo, self.sequences if hi is None else hi):
            r0, t0, n = self.bounds[i]
            out.append(
                SequenceRecord(
                    f"s{i}",
                    self.tokens[t0 : t0 + n],
                    self.ids[r0 : r0 + n - 1],
                    self.logprobs[r0 : r0 + n - 1],
                    self.tail[r0 : r0 + n - 1],
                )
            )
        return out

    def batches(self, sequences: int = 0, positions: int = 0) -> Iterator[list[Any]]:
        """The records in appends of ``sequences`` sequences, or of at least ``positions``
        rows."""
        batch: list[Any] = []
        rows = 0
        for rec in self.records():
            batch.append(rec)
            rows += rec.topk_ids.shape[0]
            if (sequences and len(batch) >= sequences) or (positions and rows >= positions):
                yield batch
                batch, rows = [], 0
        if batch:
            yield batch


@dataclass(frozen=True)
class Teacher:
    """A synthetic teacher over ``vocab`` tokens returning its top ``k``; ``seed`` fixes every
    draw."""

    vocab: int = 131072
    k: int = 100
    zipf_s: float = 1.05
    id_map: str = "bpe"
    seed: int = 0

    def cdf(self) -> np.ndarray:
        w = 1.0 / np.arange(1, self.vocab + 1, dtype=np.float64) ** self.zipf_s
        return np.cumsum(w) / w.sum()

    def rank_to_id(self, rng: np.random.Generator) -> np.ndarray:
        """frequency rank -> token id (see the module docstring)."""
        if self.id_map == "random":
            return rng.permutation(self.vocab).astype(np.int32)
        if self.id_map == "identity":
            return np.arange(self.vocab, dtype=np.int32)
        if self.id_map != "bpe":
            raise ValueError(f"id_map must be bpe, random or identity, not {self.id_map!r}")
        key = np.log1p(np.arange(self.vocab)) + rng.normal(0, 1.5, self.vocab)
        order = np.argsort(key, kind="stable")  # order[i] = rank placed at id i
        out = np.empty(self.vocab, dtype=np.int32)
        out[order] = np.arange(self.vocab, dtype=np.int32)
        return out

    def topk_ids(
        self, rows: int, rng: np.random.Generator, cdf: np.ndarray, rmap: np.ndarray
    ) -> np.ndarray:
        """Distinct ids per row in first-appearance order of i.i.d. Zipf draws."""
        k = self.k
        out = np.empty((rows, k), dtype=np.int32)
        for b0 in range(0, rows, 4096):
            n = min(4096, rows - b0)
            d = np.minimum(np.searchsorted(cdf, rng.random((n, 6 * k))), len(cdf) - 1)
            d = d.astype(np.int64)
            srt = np.sort(d, axis=1)
            order = np.argsort(d, axis=1, kind="stable")
            first = np.ones_like(srt, dtype=bool)
            first[:, 1:] = srt[:, 1:] != srt[:, :-1]
            keep = np.zeros_like(first)
            np.put_along_axis(keep, order, first, axis=1)  # True at a value's first appearance
            take = keep & (np.cumsum(keep, axis=1) <= k)
            full = take.sum(axis=1) == k
            block = np.zeros((n, k), dtype=np.int64)
            block[full] = d[full][take[full]].reshape(-1, k)
            for i in np.flatnonzero(~full):  # rare: top up with unused ranks
                u = d[i][take[i]]
                extra = np.setdiff1d(np.arange(4 * k), u)[: k - u.size]
                block[i] = np.concatenate([u, extra])
            out[b0 : b0 + n] = rmap[block]
        return out

    def logprobs(self, rows: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``(logprobs (rows, k) float32, tail (rows,) float32)``."""
        s = np.exp(rng.normal(np.log(1.2), 0.35, size=(rows, 1)))
        base = -s * np.log(np.arange(1, self.k + 1))[None, :]
        base = -np.sort(-(base + rng.normal(0, 0.3, size=(rows, self.k))), axis=1)
        tail = rng.beta(0.6, 6.0, size=rows).clip(1e-6, 0.999)
        lse = np.log(np.exp(base).sum(axis=1, keepdims=True))
        lp = base - lse + np.log1p(-tail)[:, None]
        return lp.astype(np.float32), tail.astype(np.float32)

    def _tokens(self, n: int, rng: np.random.Generator, cdf: np.ndarray, rmap: np.ndarray):
        return rmap[np.minimum(np.searchsorted(cdf, rng.random(n)), self.vocab - 1)].astype(
            np.int32
        )

    def fixed(self, positions: int, seq_len: int = 1024) -> Data:
        """Sequences of ``seq_len`` tokens, every row drawn, about ``positions`` rows in all."""
        rng = np.random.default_rng(self.seed)
        n_seq = max(1, positions // (seq_len - 1))
        rows = n_seq * (seq_len - 1)
        cdf = self.cdf()
        rmap = self.rank_to_id(rng)
        ids = self.topk_ids(rows, rng, cdf, rmap)
        lp, tail = self.logprobs(rows, rng)
        tokens = self._tokens(n_seq * seq_len, rng, cdf, rmap)
        bounds = [(i * (seq_len - 1), i * seq_len, seq_len) for i in range(n_seq)]
        return Data(tokens, ids, lp, tail, bounds)

    def pooled(self, positions: int, pool_rows: int = 65536, round_f16: bool = False) -> Data:
        """Sequences of LogNormal(log 490, 0.9) tokens (16..8192), each a slice of one pool of
        ``pool_rows`` drawn rows, until ``positions`` rows. ``round_f16``: logprobs rounded
        through float16 (the stored values, for comparisons with uncompressed copies)."""
        rng = np.random.default_rng(self.seed)
        cdf = self.cdf()
        rmap = self.rank_to_id(rng)
        ids = self.topk_ids(pool_rows, rng, cdf, rmap)
        lp, tail = self.logprobs(pool_rows, rng)
        if round_f16:
            lp = lp.astype(np.float16).astype(np.float32)
        tokens = self._tokens(pool_rows, rng, cdf, rmap)
        bounds: list[tuple[int, int, int]] = []
        rows = 0
        while rows < positions:
            n = min(int(np.clip(rng.lognormal(np.log(490), 0.9), 16, 8192)), pool_rows)
            o = int(rng.integers(0, pool_rows - n + 1))
            t = int(rng.integers(0, pool_rows - n + 1))
            bounds.append((o, t, n))
            rows += n - 1
        return Data(tokens, ids, lp, tail, bounds)

    def manifest(self, name: str, **fields: Any) -> Any:
        """A :class:`~logitcache.cache_format.Manifest` for a cache of this teacher."""
        from logitcache.cache_format import Manifest

        return Manifest(
            teacher_model=f"synthetic-{name}",
            tokenizer_fingerprint=f"synthetic-{name}",
            vocab_size=self.vocab,
            k=self.k,
            dataset=f"synthetic (benchmarks/synthetic.py, seed {self.seed})",
            **fields,
        )


def write_cache(
    url: str | Path,
    data: Data,
    manifest: Any,
    *,
    layout: Any = None,
    fsync: bool = False,
    append_sequences: int = 0,
    append_positions: int = 500_000,
) -> None:
    """Write ``data`` to a new cache at ``url`` (appends of ``append_sequences`` sequences if
    given, else of ``append_positions`` rows)."""
    from logitcache.cache_format import CacheWriter

    kw = {"layout": layout} if layout is not None else {}
    with CacheWriter.open(url, manifest, fsync=fsync, **kw) as w:
        for batch in data.batches(append_sequences, 0 if append_sequences else append_positions):
            w.append(batch)


def store_bytes(root: str | Path) -> int:
    """Bytes of every file under ``root``."""
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())
