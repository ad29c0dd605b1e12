"""Shared helpers of the cache-format tests: synthetic records and manifests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from logitcache.cache_format import CacheWriter, Layout, Manifest, SequenceRecord


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


def write_store(
    url, recs: list, *, k: int, vocab: int, layout=None, split: int | None = None, **manifest_kw
) -> None:
    """Write ``recs`` to a new local store (manifest from :func:`make_manifest` with
    ``manifest_kw``): in one append, or in two (``recs[:split]``, then the rest), each of which
    must store all its records."""
    parts = [recs] if split is None else [recs[:split], recs[split:]]
    with CacheWriter.open(
        url, make_manifest(k=k, vocab_size=vocab, **manifest_kw), layout=layout
    ) as w:
        for part in parts:
            assert w.append(part) == len(part)


# --------------------------------------------------------------------------- S3 (moto server)


def s3_client(endpoint_url: str):
    """A boto3 S3 client of the moto server at ``endpoint_url`` (the tests' credentials)."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id="test",
        aws_secret_access_key="test",
        region_name="us-east-1",
    )


# --------------------------------------------------------------------------- child processes
# Run as `python tests/format_support.py append URL OPTIONS_JSON N BATCH SEED [CRASH_APPEND
# CRASH_AFTER_ARRAYS LOCK_TTL PREFIX]`: appends make_records(N, seed=SEED) in batches, printing
# "COMMITTED <num_sequences>" after each append. With CRASH_APPEND = j >= 0, the j-th append
# SIGKILLs its own process after writing the first CRASH_AFTER_ARRAYS objects of its array writes
# (``zarr.json`` and shards, one batch: before the commit), or, with
# CRASH_AFTER_ARRAYS = KILL_AFTER_RUN, after its key index run is written (before the commit).

CHILD_K = 8
CHILD_VOCAB = 1000
KILL_AFTER_RUN = 99


def child_append(argv: list[str]) -> None:
    import json
    import os
    import signal
    import sys

    from logitcache.cache_format import CacheWriter

    url, options, n, batch, seed = argv[0], json.loads(argv[1]), *map(int, argv[2:5])
    crash_append = int(argv[5]) if len(argv) > 5 else -1
    crash_after = int(argv[6]) if len(argv) > 6 else 0
    ttl = float(argv[7]) if len(argv) > 7 else 60.0
    prefix = argv[8] if len(argv) > 8 else "s"
    state = {"append": 0}

    class CrashingWriter(CacheWriter):
        def _put(self, objects):
            if state["append"] == crash_append and crash_after != KILL_AFTER_RUN:
                if crash_after:  # the first CRASH_AFTER_ARRAYS objects of the batch only
                    super()._put(objects[:crash_after])
                os.kill(os.getpid(), signal.SIGKILL)
            super()._put(objects)

        def _write_run(self, m, new, *hashes):
            got = super()._write_run(m, new, *hashes)
            if state["append"] == crash_append and crash_after == KILL_AFTER_RUN:
                os.kill(os.getpid(), signal.SIGKILL)
            return got

    recs = make_records(n, k=CHILD_K, vocab=CHILD_VOCAB, seed=seed, prefix=prefix)
    w = CrashingWriter.open(
        url,
        make_manifest(k=CHILD_K, vocab_size=CHILD_VOCAB),
        options,
        lock_ttl=ttl,
        lock_timeout=120,
    )
    for i in range(0, n, batch):
        w.append(recs[i : i + batch])
        state["append"] += 1
        print(f"COMMITTED {w.num_sequences}", flush=True)
    w.close()
    sys.exit(0)


def child_read(argv: list[str]) -> None:
    """`read URL OPTIONS_JSON SECONDS SOURCES [STOP_AT]`: refresh-read loop until the store has
    STOP_AT sequences (or SECONDS pass). Every snapshot must be a consistent committed prefix:
    unique keys, and sampled sequences equal (bit-exact after float16 storage) to the expected
    records, SOURCES = "prefix:seed:n,..." naming the make_records(...) calls that produced them.
    """
    import json
    import sys
    import time

    import numpy as np
    from logitcache.cache_format import CacheReader, StoreNotFoundError

    url, options, seconds, sources = argv[0], json.loads(argv[1]), float(argv[2]), argv[3]
    stop_at = int(argv[4]) if len(argv) > 4 else -1
    seen_counts: set[int] = set()
    expected = {}
    for item in sources.split(","):
        prefix, seed, n = item.split(":")
        for r in make_records(int(n), k=CHILD_K, vocab=CHILD_VOCAB, seed=int(seed), prefix=prefix):
            expected[r.key] = r
    deadline = time.monotonic() + seconds
    reader = None
    snapshots = checked = 0
    while time.monotonic() < deadline:
        try:
            if reader is None:
                reader = CacheReader(url, options)
                print("READY", flush=True)
        except StoreNotFoundError:
            time.sleep(0.05)
            continue
        reader.refresh()
        n = reader.num_sequences
        seen_counts.add(n)
        if n:
            idx = sorted({0, n - 1, n // 2})
            for rec in reader.sequences(idx):
                want = expected[rec.key]
                assert np.array_equal(rec.input_ids, want.input_ids), rec.key
                assert np.array_equal(rec.topk_ids, want.topk_ids), rec.key
                lp16 = want.topk_logprobs.astype(np.float16).astype(np.float32)
                assert np.array_equal(rec.topk_logprobs, lp16), rec.key
                checked += 1
            assert len(set(reader.keys)) == n
        snapshots += 1
        if n == stop_at:
            break
        time.sleep(0.02)  # leave CPU to the writers
    last = reader.num_sequences if reader else 0
    print(
        f"READER snapshots={snapshots} checked={checked} last={last} distinct={len(seen_counts)}",
        flush=True,
    )
    sys.exit(0)


if __name__ == "__main__":
    import sys

    {"append": child_append, "read": child_read}[sys.argv[1]](sys.argv[2:])


# --- a small multi-chunk cache (random access, point reads) -------------
# chunks of 8 rows / 16 tokens, shards of 32 rows / 64 tokens: sequences of 2..40 tokens cross
# chunk and shard edges everywhere
SMALL = Layout(row_chunk=8, row_shard=32, token_chunk=16, token_shard=64, seq_chunk=4, seq_shard=8)
K = 6


def write_small_cache(url, layout: Layout, options=None, **manifest_kw) -> list:
    recs = make_records(40, k=K, vocab=300, seed=11, min_len=2, max_len=40)
    if manifest_kw.get("loss_mask"):
        rng = np.random.default_rng(3)
        recs = [
            replace(r, loss_mask=rng.integers(0, 2, r.length - 1).astype(np.uint8)) for r in recs
        ]
    m = make_manifest(k=K, vocab_size=300, **manifest_kw)
    with CacheWriter.open(url, m, options, layout=layout) as w:
        w.append(recs[:17])
        w.append(recs[17:])
    return recs


def assert_same_record(a, b) -> None:
    assert a.equals(b), (a.key, b.key)
    assert a.topk_logprobs.dtype == b.topk_logprobs.dtype == np.float32


CASES = [
    {},
    {"logprob_dtype": "float32"},
    {"logprob_dtype": "uint8"},
    {"id_remap": True},
    {"loss_mask": True},
]


class ZarrReader:
    """The reference for the reader's decoders: the same store read through stock zarr-python's
    array API (``zarr.open_array(...)[a:b]``), decoded with the format's transforms (id order,
    logprob encodings). The subset of ``CacheReader``'s API the comparisons use."""

    def __init__(self, url, storage_options=None):
        import zarr
        from logitcache.cache_format.layout import parse_root, read_root_attrs
        from logitcache.cache_format.store import open_store

        self.store = open_store(url, storage_options, read_only=True).zstore
        self.manifest = parse_root(read_root_attrs(self.store))
        self._arrays: dict = {}
        self._zarr = zarr
        m = self.manifest
        self.num_rows, self.num_tokens = m.num_rows, m.num_tokens
        self.lengths = np.asarray(self._get("seq_lengths", 0, m.num_sequences), np.int64)
        self.keys = [str(x) for x in self._get("seq_keys", 0, m.num_sequences)]
        self.row_starts = np.concatenate([[0], np.cumsum(self.lengths - 1)[:-1]]).astype(int)
        self.id_order = self._get("id_order", 0, m.vocab_size) if m.id_remap else None

    def _get(self, name, a, b):
        if name not in self._arrays:
            self._arrays[name] = self._zarr.open_array(self.store, path=name, mode="r")
        return np.asarray(self._arrays[name][a:b])

    def __len__(self):
        return len(self.keys)

    def rows(self, a, b, *, logprob_dtype="float32"):
        from logitcache.cache_format import RowBlock
        from logitcache.cache_format.quant import QUANTISED_DTYPES, decode_logprobs

        m = self.manifest
        ids = self._get("topk_ids", a, b)
        if self.id_order is not None:
            ids = self.id_order[ids]
        q = m.logprob_dtype in QUANTISED_DTYPES
        lp = decode_logprobs(
            self._get("topk_logprobs", a, b),
            m.logprob_dtype,
            self._get("logprob_max", a, b) if q else None,
            self._get("logprob_step", a, b) if q else None,
            out_dtype=logprob_dtype,
        )
        tail = self._get("tail_mass", a, b).astype(np.float32)
        mask = self._get("loss_mask", a, b) if m.loss_mask else None
        return RowBlock(a, ids.astype(np.int32), lp, tail, mask)

    def tokens(self, a, b):
        return self._get("input_ids", a, b)

    def sequence(self, i, *, logprob_dtype="float32"):
        from logitcache.cache_format import SequenceRecord

        r0, n = int(self.row_starts[i]), int(self.lengths[i])
        t0 = r0 + i
        rows = self.rows(r0, r0 + n - 1, logprob_dtype=logprob_dtype)
        return SequenceRecord.trusted(
            self.keys[i],
            self.tokens(t0, t0 + n),
            rows.topk_ids,
            rows.topk_logprobs,
            rows.tail_mass,
            rows.loss_mask,
        )

    def sequences(self, idx, *, logprob_dtype="float32"):
        return [self.sequence(int(i), logprob_dtype=logprob_dtype) for i in idx]


def reseal(url, name: str) -> None:
    """Re-seal the shard objects of array ``name`` (one shard) after a test edited its values
    through stock zarr (which writes no seal, FORMAT.md 4.8): the damage a buggy writer would
    leave, values wrong but every object sealed in its place."""
    import zarr
    from logitcache.cache_format._seal import seal_written
    from logitcache.cache_format._zarr_adapter import async_array, sync

    arr = zarr.open_array(zarr.storage.LocalStore(str(url)), path=name, mode="r+")
    assert arr.shape[0] <= arr.metadata.chunk_grid.chunk_shape[0]  # one shard
    sync(seal_written(async_array(arr), name, 0, arr.shape[0]))


# --------------------------------------------------------------------------- hidden targets (4.10)


def make_head(vocab: int = 50, dim: int = 16, seed: int = 0, bias: bool = True, **kw):
    """A random float32 :class:`TeacherHead` ``[vocab, dim]`` (with a bias unless told)."""
    from logitcache.cache_format import TeacherHead

    rng = np.random.default_rng(seed)
    b = rng.standard_normal(vocab).astype(np.float32) if bias else None
    return TeacherHead(rng.standard_normal((vocab, dim)).astype(np.float32), b, **kw)


def hidden_manifest(head, dtype: str = "bfloat16", **kw) -> Manifest:
    """A ``targets="hidden"`` manifest for ``head``."""
    return make_manifest(
        k=1, vocab_size=head.vocab_size, targets="hidden", hidden=head.spec(dtype), **kw
    )


def make_hidden_records(n: int, vocab: int, dim: int, seed: int = 0, max_len: int = 40) -> list:
    """``n`` :class:`HiddenRecord` with keys ``h0..``, random lengths ``2..max_len``."""
    from logitcache.cache_format import HiddenRecord

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(2, max_len + 1))
        ids = rng.integers(0, vocab, size=length, dtype=np.int32)
        h = (rng.standard_normal((length - 1, dim)) * 3).astype(np.float32)
        out.append(HiddenRecord(f"h{i}", ids, h))
    return out


def store_objects(root: Path) -> dict[str, bytes]:
    """Every object of a store but the root ``zarr.json`` (it holds timestamps); of a key index
    run its entries only (its commit record is the root's attributes)."""
    out = {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p != root / "zarr.json" and not p.name.endswith(".lock")
    }
    for key, data in out.items():
        if key.startswith("seq_keys/index/"):
            first, end, _ = map(int, key.rsplit("/", 1)[1].split("-"))
            out[key] = data[: 16 * (end - first)]
    return out


@contextmanager
def zarr_writes() -> Iterator[None]:
    """Writers inside write every array through zarr's ``setitem``: the reference that the
    writer's direct shard writes (``_shardwrite``, ``_templates``) are compared with. No array
    has a direct layout and no template of this process is used or recorded."""
    from logitcache.cache_format import _templates as templates

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(templates, "direct_layout_of", lambda *a, **k: None)
        mp.setattr(templates, "CREATED", {})
        mp.setattr(templates, "TEMPLATES", templates.OrderedDict())
        mp.setattr(templates, "LAST", templates.OrderedDict())
        yield
