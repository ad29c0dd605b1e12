"""The benchmarks' synthetic teachers: realistic top-k rows without a model.

:class:`Teacher`: each row's k ids are the first-appearance order of i.i.d. Zipf(s) draws, mapped
frequency rank -> id "bpe-like" (ids sorted by ``log(rank) + N(0, 1.5)``); logprobs
``-s log(j+1) + noise`` sorted, ``s ~ LogNormal(log 1.2, 0.35)``, tail mass ``~ Beta(0.6, 6)``.
The ``ddp`` suite's teacher is a random "bigram" teacher (:class:`CacheSpec`) whose sequences
start with their own index written as tokens.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Data:
    """Rows of a synthetic teacher (``ids``, ``logprobs``: (rows, k); ``tail``: (rows,)), tokens,
    and each sequence's ``(row_start, token_start, length)`` (``length - 1`` rows)."""

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
            rows = slice(r0, r0 + n - 1)
            tokens = self.tokens[t0 : t0 + n]
            out.append(
                SequenceRecord(
                    f"s{i}", tokens, self.ids[rows], self.logprobs[rows], self.tail[rows]
                )
            )
        return out

    def batches(self, sequences: int = 0, positions: int = 0) -> Iterator[list[Any]]:
        """The records in lists of ``sequences`` sequences, or of at least ``positions`` rows."""
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
    """A synthetic teacher over ``vocab`` tokens returning its top ``k`` (``id_map``: ``bpe``,
    ``random`` permutation or ``identity``); ``seed`` fixes every draw."""

    vocab: int = 131072
    k: int = 100
    zipf_s: float = 1.05
    id_map: str = "bpe"
    seed: int = 0

    def cdf(self) -> np.ndarray:
        w = 1.0 / np.arange(1, self.vocab + 1, dtype=np.float64) ** self.zipf_s
        return np.cumsum(w) / w.sum()

    def rank_to_id(self, rng: np.random.Generator) -> np.ndarray:
        """frequency rank -> token id."""
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
        ``pool_rows`` rows, until ``positions`` rows (``round_f16``: logprobs as stored)."""
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

        fields |= {
            "teacher_model": f"synthetic-{name}",
            "tokenizer_fingerprint": f"synthetic-{name}",
        }
        dataset = f"synthetic (benchmarks/synthetic.py, seed {self.seed})"
        return Manifest(vocab_size=self.vocab, k=self.k, dataset=dataset, **fields)


def write_cache(
    url: str | Path,
    data: Data,
    manifest: Any,
    *,
    layout: Any = None,
    append_positions: int = 500_000,
) -> None:
    """Write ``data`` to a new cache at ``url`` (no fsync), in appends of ``append_positions``
    rows."""
    from logitcache.cache_format import CacheWriter

    kw = {"layout": layout} if layout is not None else {}
    with CacheWriter.open(url, manifest, fsync=False, **kw) as w:
        for batch in data.batches(positions=append_positions):
            w.append(batch)


def store_bytes(root: str | Path) -> int:
    """Bytes of every file under ``root``."""
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())


# --------------------------------------------------------------------------- bigram teacher
@dataclass(frozen=True)
class CacheSpec:
    """Shape of a synthetic cache (every field is a CLI flag of ``make-cache``)."""

    num_sequences: int = 96
    min_len: int = 17
    max_len: int = 64
    vocab: int = 512
    k: int = 8
    seed: int = 0
    logprob_dtype: str = "float16"


def header_digits(num_sequences: int, vocab: int) -> int:
    """Tokens needed to write any index ``< num_sequences`` in base ``vocab`` (at least 1)."""
    return max(1, math.ceil(math.log(max(num_sequences, 2), vocab)))


def encode_index(index: np.ndarray, digits: int, vocab: int) -> np.ndarray:
    """``[n, digits]`` base-``vocab`` digits of ``index``, most significant first."""
    out = np.empty((len(index), digits), dtype=np.int64)
    rest = np.asarray(index, dtype=np.int64).copy()
    for d in range(digits - 1, -1, -1):
        out[:, d] = rest % vocab
        rest //= vocab
    return out


def decode_index(tokens: np.ndarray, vocab: int) -> int:
    """Inverse of :func:`encode_index` for one header."""
    value = 0
    for t in np.asarray(tokens).tolist():
        value = value * vocab + int(t)
    return value


def bigram_teacher(vocab: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A random "bigram" teacher: for each previous token ``v``, ``k`` distinct next-token ids
    ``ids[v]`` (``start + cumsum(gaps) mod vocab``, gaps in ``[1, vocab // k]``, shuffled) with
    descending logprobs ``lp[v]``: ``log_softmax`` of sorted ``N(0, 2^2)`` scores plus ``log M_v``,
    ``M_v ~ U(0.85, 0.95)``."""
    if vocab // k < 1:
        raise ValueError(f"need vocab >= k, got vocab={vocab}, k={k}")
    rng = np.random.default_rng([seed, 1])
    gaps = rng.integers(1, vocab // k + 1, size=(vocab, k))
    start = rng.integers(0, vocab, size=(vocab, 1))
    ids = ((start + np.cumsum(gaps, axis=1) - gaps[:, :1]) % vocab).astype(np.int32)
    perm = rng.permuted(np.tile(np.arange(k), (vocab, 1)), axis=1)
    ids = np.take_along_axis(ids, perm, axis=1)  # the order of ids inside a row is random
    scores = -np.sort(-rng.normal(0.0, 2.0, size=(vocab, k)), axis=1)
    scores -= scores.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(scores).sum(axis=1, keepdims=True))
    mass = rng.uniform(0.85, 0.95, size=(vocab, 1))
    lp = (scores - log_z + np.log(mass)).astype(np.float32)
    return ids, lp


def synthetic_records(
    spec: CacheSpec, first: int, count: int, teacher: tuple[np.ndarray, np.ndarray]
) -> list[Any]:
    """Sequences ``first .. first+count-1`` as ``SequenceRecord``s: ``U[min_len, max_len]``
    tokens, a header (``i`` in base ``vocab``), then a walk of the bigram teacher (a uniform token
    with the tail mass); row ``j`` is the teacher's distribution given token ``j``."""
    from logitcache.cache_format import SequenceRecord

    ids_t, lp_t = teacher
    cdf = np.cumsum(np.exp(lp_t.astype(np.float64)), axis=1)
    rng = np.random.default_rng([spec.seed, 2, first])
    digits = header_digits(spec.num_sequences, spec.vocab)
    lengths = rng.integers(spec.min_len, spec.max_len + 1, size=count)
    L = int(lengths.max())
    x = np.empty((count, L), dtype=np.int64)
    x[:, :digits] = encode_index(np.arange(first, first + count), digits, spec.vocab)
    for j in range(digits - 1, L - 1):
        prev = x[:, j]
        u = rng.random(count)
        pick = (cdf[prev] < u[:, None]).sum(axis=1)
        inside = pick < spec.k
        nxt = rng.integers(0, spec.vocab, size=count)
        nxt[inside] = ids_t[prev[inside], pick[inside]]
        x[:, j + 1] = nxt
    records = []
    for i in range(count):
        n = int(lengths[i])
        prev = x[i, : n - 1]
        key = f"seq-{first + i:09d}"
        records.append(SequenceRecord(key, x[i, :n], ids_t[prev], lp_t[prev], tail_mass=None))
    return records
