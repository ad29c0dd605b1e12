"""Sharded batch scoring without a scheduler of its own: plan, check, score a shard, commit.

The engine-and-store half of :mod:`logitcache.server.batch.distributed`, without Ray; the
result does not depend on how many workers ran or in which order shards finished:

1. **Plan**: the input's records are cut into shards of ``shard_size`` consecutive records.
2. **Check** (before anything is written): every shard is checked (:func:`scan_shard`);
   :func:`check_scans` merges the scans in shard order into one 422 listing the problems, and
   drops repeated content keys as :func:`~logitcache.server.inputs.records.sequences` does.
3. **Score**: a worker scores one shard (:func:`score_shard`) through the jobs' batch pipeline
   into its own lossless staging cache ``<staging>/shard-<index>``; a re-run skips committed
   batches.
4. **Commit**: :func:`commit` appends the staging caches to the final cache in shard order
   (keys already present skipped, so an interrupted commit resumes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from logitcache.cache_format import CacheReader, CacheWriter, Manifest
from logitcache.cache_format.errors import ManifestMismatchError, StoreNotFoundError

from ..errors import InvalidInputError
from ..inputs import records as inputs
from ..serving.targets import targets_of
from . import pipeline

if TYPE_CHECKING:
    from ..engine import TeacherEngine

#: Most problems listed in one error answer (as for jobs).
MAX_LISTED_ERRORS = inputs.MAX_LISTED_ERRORS
#: Sequences per append while committing staging caches into the final cache.
COMMIT_CHUNK = 256


@dataclass(frozen=True)
class Shard:
    """``records`` = input records ``[start, start + len(records))``; ``index`` orders shards."""

    index: int
    start: int
    records: tuple[inputs.RawRecord, ...]


@dataclass(frozen=True)
class ShardScan:
    """What checking one shard found: its keys (input order), which are explicit ids, its token
    count, and the problems."""

    index: int
    keys: tuple[str, ...]
    explicit: tuple[bool, ...]
    tokens: int
    errors: tuple[str, ...]


@dataclass(frozen=True)
class ShardTask:
    """One unit of work: score ``shard`` into ``staging_url``, leaving out ``skip`` keys (owned
    by an earlier shard)."""

    shard: Shard
    staging_url: str
    skip: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class ShardResult:
    """A scored shard: where it is staged, how many sequences it holds, what this run did."""

    index: int
    staging_url: str
    num_sequences: int
    keys: tuple[str, ...]
    """The keys the final cache takes from this shard, in input order."""
    scored_sequences: int
    scored_tokens: int
    seconds: float
    worker: str = ""


def plan_shards(raws: Iterable[inputs.RawRecord], shard_size: int) -> list[Shard]:
    """Cut ``raws`` (input order) into shards of ``shard_size`` consecutive records."""
    if shard_size < 1:
        raise InvalidInputError(f"shard size must be >= 1, got {shard_size}")
    shards: list[Shard] = []
    chunk: list[inputs.RawRecord] = []
    start = 0
    for raw in raws:
        chunk.append(raw)
        if len(chunk) == shard_size:
            shards.append(Shard(index=len(shards), start=start, records=tuple(chunk)))
            start += len(chunk)
            chunk = []
    if chunk:
        shards.append(Shard(index=len(shards), start=start, records=tuple(chunk)))
    if not shards:
        raise InvalidInputError("the input holds no sequence")
    return shards


def staging_url(root: str, index: int) -> str:
    """The staging cache of shard ``index`` under ``root``."""
    return f"{root.rstrip('/')}/shard-{index:06d}"


def scan_shard(shard: Shard, tokenize: inputs.Tokenize, limits: inputs.Limits) -> ShardScan:
    """Tokenise and check every record of ``shard`` (nothing is scored or written)."""
    keys: list[str] = []
    explicit: list[bool] = []
    errors: list[str] = []
    tokens = 0
    for raw, seq in inputs.valid_records(shard.records, tokenize, limits, errors):
        keys.append(seq.key)
        explicit.append(raw.id is not None)
        tokens += seq.length
    return ShardScan(shard.index, tuple(keys), tuple(explicit), tokens, tuple(errors))


def check_scans(
    scans: Sequence[ShardScan], committed: frozenset[str] = frozenset()
) -> list[frozenset[str]]:
    """Merge shard scans by index into, per shard, the keys to leave out (an earlier shard's, or
    ``committed``); :class:`InvalidInputError` listing the problems."""
    ordered = sorted(scans, key=lambda s: s.index)
    errors = [e for s in ordered for e in s.errors]
    owner: dict[str, int] = {}
    skips: list[frozenset[str]] = []
    for s in ordered:
        skip: set[str] = set()
        for key, is_id in zip(s.keys, s.explicit, strict=True):
            if key not in owner:
                owner[key] = s.index
            elif is_id:
                errors.append(f"id {key!r} appears more than once (shards {owner[key]}, {s.index})")
            else:
                skip.add(key)
        skips.append(frozenset(skip | (committed & set(s.keys))))
    if errors:
        raise InvalidInputError(
            f"the input has {len(errors)} invalid record(s); first: {errors[0]}",
            detail=errors[:MAX_LISTED_ERRORS],
        )
    if not owner:
        raise InvalidInputError("the input holds no sequence")
    return skips


def staging_manifest(final: Manifest, staging_of: str) -> Manifest:
    """The manifest of a staging cache: the final one with lossless float32 storage."""
    return final.model_copy(
        update={
            "logprob_dtype": "float32",
            "tail_mass_dtype": "float32",
            "extra": {**final.extra, "staging_of": staging_of},
        }
    )


async def score_shard(
    engine: TeacherEngine,
    task: ShardTask,
    *,
    manifest: Manifest,
    limits: inputs.Limits,
    batch_sequences: int,
    batch_tokens: int,
    inflight_batches: int = 1,
    storage_options: dict[str, Any] | None = None,
    worker: str = "",
    write_fill_s: float = 0.0,
) -> ShardResult:
    """Score ``task.shard`` with ``engine`` into its staging cache through the batch pipeline
    as a job does (rows of the kind ``manifest`` names); committed batches are skipped."""
    t0 = time.perf_counter()
    seqs = [
        s
        for s in inputs.sequences(task.shard.records, engine.tokenize, limits)
        if s.key not in task.skip
    ]
    sampled = targets_of(manifest)  # the kind the manifest says (None: top-k rows)
    writer = await asyncio.to_thread(CacheWriter.open, task.staging_url, manifest, storage_options)
    done = pipeline.Appended(writer.append, manifest)

    try:
        await pipeline.run(
            pipeline.plan(
                seqs,
                writer.missing,
                max_sequences=batch_sequences,
                max_tokens=batch_tokens,
            ),
            score=lambda b: pipeline.engine_batches(engine, b, manifest.k, targets=sampled),
            write=done,
            merge_rows=pipeline.merge_rows(manifest),
            linger=pipeline.WRITE_LINGER_S,
            fill=write_fill_s,
            depth=lambda: inflight_batches,
            name=f"shard-writer-{task.shard.index}",
        )
    finally:
        await asyncio.to_thread(writer.close)
    return ShardResult(
        index=task.shard.index,
        staging_url=task.staging_url,
        num_sequences=len(seqs),
        keys=tuple(s.key for s in seqs),
        scored_sequences=done.scored_sequences,
        scored_tokens=done.scored_tokens,
        seconds=time.perf_counter() - t0,
        worker=worker,
    )


def stored_manifest(url: str, storage_options: dict[str, Any] | None) -> Manifest | None:
    """The manifest of the cache at ``url``; ``None`` if there is no cache there."""
    try:
        return CacheReader(url, storage_options=storage_options).manifest
    except (StoreNotFoundError, FileNotFoundError):
        return None


def check_target(
    url: str, manifest: Manifest, storage_options: dict[str, Any] | None
) -> frozenset[str]:
    """The keys already committed to the cache at ``url`` (empty if there is none);
    ManifestMismatchError if it has another identity, kind or entropy setting."""
    try:
        reader = CacheReader(url, storage_options=storage_options)
    except (StoreNotFoundError, FileNotFoundError):
        return frozenset()
    reader.manifest.check_compatible(manifest)
    if reader.manifest.entropy != manifest.entropy:
        raise ManifestMismatchError({"entropy": (reader.manifest.entropy, manifest.entropy)})
    return frozenset(reader.keys)


def commit(
    results: Sequence[ShardResult],
    url: str,
    manifest: Manifest,
    storage_options: dict[str, Any] | None = None,
) -> int:
    """Append every staged shard to the final cache at ``url`` in shard order (keys already
    there skipped); returns the number newly committed. A staging cache missing one of its
    result's keys is an error."""
    added = 0
    with CacheWriter.open(url, manifest, storage_options) as writer:
        for result in sorted(results, key=lambda r: r.index):
            reader = CacheReader(result.staging_url, storage_options=storage_options)
            missing = [k for k in result.keys if k not in reader]
            if missing:
                raise RuntimeError(
                    f"staging cache {result.staging_url} lacks {len(missing)} sequence(s) of "
                    f"shard {result.index}, e.g. {missing[0]!r}"
                )
            wanted = set(result.keys)
            todo = [
                i for i, key in enumerate(reader.keys) if key in wanted and not writer.contains(key)
            ]
            for start in range(0, len(todo), COMMIT_CHUNK):
                recs = reader.sequences(todo[start : start + COMMIT_CHUNK])
                added += writer.append(pipeline.for_store(recs, writer.manifest))
    return added


def remove_staging(root: str, storage_options: dict[str, Any] | None = None) -> None:
    """Delete the staging root (all shard caches) through the format's store opener."""
    from logitcache.cache_format import delete_prefix, open_store

    delete_prefix(open_store(root, storage_options, read_only=False).zstore)
