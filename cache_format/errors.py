"""Typed errors of the cache format.

Every error a caller can provoke with bad input or a bad store is a :class:`FormatError`, which is
a :class:`ValueError`, so ``except ValueError`` keeps working for callers that do not care which.
"""

from __future__ import annotations


class FormatError(ValueError):
    """Base class of every error raised by ``logitcache.cache_format``."""


class RecordError(FormatError):
    """A sequence record is malformed (shape, dtype, range, NaN, order, k or vocab mismatch).

    Raised before anything is written: a batch with one bad record writes nothing.
    """

    def __init__(self, message: str, *, key: str | None = None, index: int | None = None):
        where = []
        if index is not None:
            where.append(f"record {index}")
        if key is not None:
            where.append(f"key {key!r}")
        prefix = f"{', '.join(where)}: " if where else ""
        super().__init__(prefix + message)
        self.key = key
        self.index = index


class ManifestError(FormatError):
    """A manifest is invalid (fails the pydantic model, or is missing from a store)."""


class ManifestMismatchError(FormatError):
    """A writer's manifest differs from the store's on an identity field (teacher, tokenizer, k).

    ``fields`` maps each differing field to ``(stored, requested)``.
    """

    def __init__(self, fields: dict[str, tuple[object, object]]):
        detail = "; ".join(
            f"{n}: store has {a!r}, writer has {b!r}" for n, (a, b) in fields.items()
        )
        super().__init__(f"manifest mismatch on identity fields: {detail}")
        self.fields = fields


class UnsupportedVersionError(FormatError):
    """The store (or wire frame) was written with a format version this library cannot read."""


class WriterLockedError(FormatError):
    """Another writer holds the store's writer lock and did not release it within the timeout."""


class StoreNotFoundError(FormatError):
    """No logitcache store exists at the URL."""


class CorruptStoreError(FormatError):
    """The store's committed data breaks an invariant a reader relies on (see FORMAT.md)."""


class ChecksumError(CorruptStoreError):
    """Stored bytes fail their CRC32C or framing (FORMAT.md R7): a damaged object, or a read that
    raced a writer's shard rewrite. Readers retry it on a fresh snapshot before raising it."""


class MissingDataError(CorruptStoreError):
    """An object (shard) or chunk that the committed counts need is absent from the store: a
    lost or deleted object, a failed or partial copy (FORMAT.md R9). Never read as fill value.
    The message names the array and the rows (entries) it would have held."""


class PlacementError(CorruptStoreError):
    """An intact shard object is not the one its place needs (FORMAT.md 4.8): its seal names
    another array or shard, or it holds fewer entries than the committed count (a misplaced or
    stale copy)."""


class StoreNeedsRepairError(CorruptStoreError):
    """The store's root ``zarr.json`` (the manifest, the commit point) is missing, unreadable or
    only the creation marker, yet its arrays hold data: writers refuse it (they would recreate the
    store over committed rows); ``logitcache repair`` rebuilds the root from the key index, where
    the store has one."""


class WireFormatError(FormatError):
    """Bytes given to the wire decoder are not a valid (or complete) logitcache frame."""


class TargetKindError(FormatError):
    """A cache asked for rows of a kind it does not hold: top-k rows of a ``targets="hidden"``
    store, or hidden rows or the teacher head of a top-k or sampled one (FORMAT.md 4.10)."""
