"""Appending sequences to a cache, crash-safely (FORMAT.md §5, rules W1-W6).

:meth:`CacheWriter.append` encodes and checks the whole batch in memory (nothing is written on
bad input), takes the writer lock, re-reads the committed manifest, drops keys already committed,
writes the new rows past the committed counts (each object atomic and, on a local disk,
fsynced) and the key index run, then commits by rewriting the root ``zarr.json`` with the new
counts and ``generation + 1``. A writer killed before the commit leaves bytes past the counts,
which readers ignore and the next writer overwrites; committed bytes never change."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import zarr
import zarr.api.asynchronous
from zarr.storage import StorePath

from . import _idmap as idmap
from . import _keyruns as keyruns
from . import _shardread as shardread
from . import _shardwrite as shardwrite
from . import _templates as templates
from . import fastencode, spec
from ._arraywrites import ArrayWrites
from ._decode import OpenArrays, stored_values
from ._encode import Batch, encode_batch
from ._integrity import checked_read
from ._keyindex import KeyTable, follow_runs, stored_key_bytes
from ._lock import make_lock
from ._manifest import Manifest, utcnow
from ._repair import record_json, refuse_if_holding_data
from ._seal import sealed
from ._seqbatch import SequenceBatch
from ._shardread import DirectLayout
from ._zarr_adapter import default_buffer_prototype, sync
from .errors import FormatError, ManifestError
from .hidden import check_head, head_columns
from .layout import (
    INCOMPLETE_ATTR,
    ArrayDef,
    array_defs,
    committed_lengths,
    create_array,
    parse_root,
    read_root_attrs,
    root_attrs_for,
    strict,
    write_root_attrs,
)
from .records import SequenceRecord
from .store import StoreHandle, open_store


class CacheWriter(ArrayWrites):
    """Appends :class:`SequenceRecord` batches to a store; see the module docstring. Use
    :meth:`open`. Appends from several writers (threads or processes) are serialised by the writer
    lock; each re-reads the committed state under it."""

    def __init__(
        self,
        handle: StoreHandle,
        manifest: Manifest,
        *,
        layout: spec.Layout,
        lock_timeout: float,
        lock_ttl: float,
    ):
        self._handle = handle
        self._store = handle.zstore
        self._manifest = manifest
        self._layout = layout
        self._lock = make_lock(handle, ttl=lock_ttl)
        self._lock_timeout = lock_timeout
        self._keys = KeyTable(self._read_keys, self._read_key_bytes)  # hashed at the first lookup
        self._rank: np.ndarray | None = None  # id -> stored id (frequency-rank remap)
        self._pending_rank: np.ndarray | None = None
        self._head: Any = None  # the TeacherHead of a hidden store (FORMAT.md 4.10)
        self._closed = False
        self._opened: dict[str, Any] = {}  # arrays as this writer's last append left them
        self._direct: dict[str, templates.DirectArray] = {}  # the same, for arrays written directly

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(
        cls,
        url: str | Path,
        manifest: Manifest,
        storage_options: dict[str, Any] | None = None,
        *,
        layout: spec.Layout | None = None,
        lock_timeout: float = 60.0,
        lock_ttl: float = 60.0,
        fsync: bool = True,
        direct_io: bool | None = None,
        head: Any = None,
    ) -> CacheWriter:
        """Create the cache at ``url`` or resume it.

        Resuming checks ``manifest``'s identity fields (:data:`~._manifest.IDENTITY_FIELDS`) against
        the store's (:class:`~.errors.ManifestMismatchError`); ``layout`` applies only when
        creating. ``lock_timeout``: seconds to wait for another writer; ``lock_ttl``: object-store
        lease length. ``fsync`` (local stores): each append durable against power loss before
        :meth:`append` returns (FORMAT.md W5); ``direct_io``: see :class:`.store.DurableLocalStore`.
        ``head``: the :class:`~.hidden.TeacherHead` of a ``targets="hidden"`` store, written by the
        first commit."""
        if not isinstance(manifest, Manifest):
            raise ManifestError(f"expected Manifest, got {type(manifest).__name__}")
        if head is not None and manifest.hidden is not None:
            check_head(head, manifest.hidden, manifest.vocab_size)
        handle = open_store(url, storage_options, read_only=False, fsync=fsync, direct_io=direct_io)
        self = cls(
            handle,
            manifest.model_copy(deep=True),
            layout=layout or spec.DEFAULT_LAYOUT,
            lock_timeout=lock_timeout,
            lock_ttl=lock_ttl,
        )
        self._head = head
        self._lock.acquire(lock_timeout)
        try:
            handle.remove_partials()
            try:
                attrs = read_root_attrs(self._store)
            except ValueError as e:  # a root zarr.json that is not JSON (or not a zarr document)
                attrs, unreadable = None, f"unreadable ({type(e).__name__}: {e})"
            else:
                unreadable = "missing" if attrs is None else "only the creation marker"
            if attrs is None or (spec.ROOT_ATTR not in attrs and INCOMPLETE_ATTR in attrs):
                refuse_if_holding_data(self._store, url, unreadable)
                self._create()
            elif spec.ROOT_ATTR not in attrs:
                raise FormatError(f"{url!s} holds a zarr group that is not a logitcache store")
            else:
                stored = parse_root(attrs)
                stored.check_compatible(manifest)
                self._adopt(stored)
                runs = stored.runs()
                if runs is not None:  # a killed writer's runs, or runs merged away: no commit's
                    live = {r.key for r in runs}
                    keyruns.drop(
                        self._store, [k for k in keyruns.listed(self._store) if k not in live]
                    )
        finally:
            self._lock.release()
        return self

    def _create(self) -> None:
        """Create root (marked incomplete), all arrays, then commit an empty manifest."""
        now = utcnow()
        m = self._manifest.model_copy(
            update=dict(
                created=now,
                updated=now,
                num_sequences=0,
                num_rows=0,
                num_tokens=0,
                num_key_bytes=0,
                generation=0,
                key_index=[] if self._manifest.format_version >= spec.FORMAT_VERSION else None,
            )
        )
        if m.format_version not in spec.SUPPORTED_VERSIONS:
            raise ManifestError(
                f"cannot create a store of format_version {m.format_version} "
                f"(supported: {sorted(spec.SUPPORTED_VERSIONS)})"
            )
        write_root_attrs(self._store, {"format_version": m.format_version, INCOMPLETE_ATTR: True})
        self._create_arrays(m)
        self._handle.barrier()
        write_root_attrs(self._store, root_attrs_for(m))
        self._handle.barrier()
        self._adopt(m)

    def _create_arrays(self, m: Manifest) -> None:
        """Create every array of ``m`` empty (overwriting whatever lies at its path), each kept as
        this writer's :class:`templates.DirectArray` of length 0 for :mod:`._shardwrite`. The first
        store of a layout goes through zarr's ``create_array`` and its ``zarr.json`` become
        templates (:data:`._templates.CREATED`) once read back equal to them; later stores get those
        bytes written directly."""
        made: list[tuple[ArrayDef, tuple[DirectLayout, bytes, bytes]]] = []
        for d in array_defs(m, self._layout):
            key = (m.format_version, m.k, d)
            tpl = templates.CREATED.get(key) if m.format_version >= 2 else None
            if tpl is not None:
                made.append((d, tpl))
                continue
            arr = create_array(self._store, d, m.k, m.format_version)
            direct = templates.direct_of(arr, d.name, 0, m.format_version)
            if direct is None:
                continue
            if sync(direct.meta_path.get(prototype=default_buffer_prototype())).to_bytes() == (
                direct.head + b"0" + direct.tail
            ):
                with templates.TEMPLATES_LOCK:
                    templates.CREATED[key] = (direct.lay, direct.head, direct.tail)
                self._keep_direct(d.name, direct)

        async def write_all() -> None:
            await asyncio.gather(*(self._from_created(d, *tpl) for d, tpl in made))

        if made:
            sync(write_all())

    async def _from_created(self, d: ArrayDef, lay: DirectLayout, head: bytes, tail: bytes) -> None:
        """Array ``d`` made empty from a creation template, as zarr's ``create_array(...,
        overwrite=True)`` makes it: what lies at its path removed, then its ``zarr.json``."""
        path = StorePath(self._store, d.name)
        if self._store.supports_deletes:
            await path.delete_dir()
        await (path / "zarr.json").set(
            default_buffer_prototype().buffer.from_bytes(head + b"0" + tail)
        )
        direct = templates.DirectArray(
            templates.rebased(lay, path, 0),
            path / "zarr.json",
            head,
            tail,
            0,
            shardwrite.LastShard(),
        )
        self._keep_direct(d.name, direct)

    def _keep_direct(self, name: str, direct: templates.DirectArray) -> None:
        """Keep ``direct`` for this writer's next append to ``name``, and as the template a later
        writer of this store starts from (:meth:`_from_template`)."""
        self._direct[name] = direct
        key = (self._handle.url, name)
        with templates.TEMPLATES_LOCK:
            templates.TEMPLATES[key] = (direct.lay, direct.head, direct.tail)
            templates.TEMPLATES.move_to_end(key)
            while len(templates.TEMPLATES) > templates.KEEP_TEMPLATES:
                templates.TEMPLATES.popitem(last=False)

    # ------------------------------------------------------------------ state
    def _refresh_manifest(self) -> Manifest:
        attrs = read_root_attrs(self._store)
        if attrs is None:
            raise FormatError("store root disappeared while writing")
        m = parse_root(attrs)
        self._adopt(m)
        return m

    def _adopt(self, m: Manifest) -> None:
        """Take ``m`` as the store's commit (its key index runs for lookups)."""
        self._manifest = m
        follow_runs(self._keys, self._store, m)

    def _read_keys(self, a: int, b: int) -> np.ndarray:
        """Committed keys ``[a, b)`` (a lost keys shard is :class:`MissingDataError`, not ``""``
        keys that would let duplicates in)."""
        m = self._manifest
        arr = zarr.open_array(self._store, path=spec.SEQ_KEYS, mode="r")
        seal = sealed(m.format_version)
        return checked_read(arr, spec.SEQ_KEYS, a, b, strict(m), seal)

    def _read_key_bytes(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray] | None:
        """UTF-8 bytes of committed keys ``[a, b)`` and their ends (``None``: a version-1
        store has none)."""
        m = self._manifest
        if m.format_version < 2:
            return None
        st, seal, need = strict(m), sealed(m.format_version), committed_lengths(m)
        arrays, direct = {}, {}
        for n in (spec.SEQ_KEY_END, spec.SEQ_KEY_BYTES):  # read as a reader reads them
            arrays[n] = arr = zarr.open_array(self._store, path=n, mode="r")
            lay = shardread.direct_layout(arr, n, committed=need[n], strict=st, sealed=seal)
            if lay is not None:
                direct[n] = lay
        opened = OpenArrays(m, arrays, direct, need, st, None, None)
        return stored_key_bytes(partial(stored_values, opened), a, b, m.num_key_bytes)

    def refresh(self) -> bool:
        """Re-read the committed manifest to catch up with other writers' commits (for a writer kept
        open between jobs); takes no lock. ``False``, changing nothing, when the store is no longer
        the one this writer appended to (root gone or made again, fewer sequences, an older
        generation, other identity fields): the caller then opens a new writer."""
        if self._closed:
            raise FormatError("writer is closed")
        attrs = read_root_attrs(self._store)
        if attrs is None or spec.ROOT_ATTR not in attrs:
            return False
        m = parse_root(attrs)
        old = self._manifest
        if (
            m.created != old.created
            or m.num_sequences < old.num_sequences
            or m.generation < old.generation
            or m.identity() != old.identity()
        ):
            return False
        self._adopt(m)
        return True

    @property
    def manifest(self) -> Manifest:
        """The manifest as of this writer's last commit or refresh."""
        return self._manifest

    @property
    def num_sequences(self) -> int:
        return self._manifest.num_sequences

    @property
    def url(self) -> str:
        return self._handle.url

    def contains(self, key: str) -> bool:
        """Whether ``key`` is committed (as of this writer's last transaction or refresh)."""
        return self._keys.find(key, self._manifest.num_sequences) is not None

    def missing(self, keys: Sequence[str]) -> list[str]:
        """The keys of ``keys`` not committed, in order (one key index lookup for all)."""
        got = self._keys.find_many(keys, self._manifest.num_sequences).tolist()
        return [k for k, stored in zip(keys, got, strict=True) if not stored]

    # ------------------------------------------------------------------ appending
    def append(
        self, records: Iterable[SequenceRecord] | Iterable[SequenceBatch] | SequenceBatch
    ) -> int:
        """Append records, a :class:`~._seqbatch.SequenceBatch` or a list of them (their sequences
        in order); returns how many were newly committed (committed keys, and a key's repeats, are
        skipped). The whole batch is checked first: a bad record raises
        :class:`~.errors.RecordError` and nothing is written; :class:`~.errors.WriterLockedError` if
        the lock is not obtained within ``lock_timeout``."""
        if self._closed:
            raise FormatError("writer is closed")
        batch = records if isinstance(records, SequenceBatch) else list(records)
        with fastencode.outputs() as out:  # its arrays are written before this returns
            return self._append(batch, out)

    def _append(self, records: list[Any] | SequenceBatch, out: Any) -> int:
        encoded = encode_batch(records, self._manifest, out)
        if encoded is None:
            return 0
        self._lock.acquire(self._lock_timeout)
        try:
            m = self._refresh_manifest()
            self._load_id_map(m)
            stored = self._keys.find_many(
                encoded.keys, m.num_sequences, encoded.hashes, encoded.order
            )
            fresh = encoded.fresh(stored)
            if fresh is None:
                return 0
            self._write(m, fresh)
            self._handle.barrier()  # data durable before the commit that points at it
            self._lock.check()
            added, tokens = len(fresh.keys), int(fresh.lengths.sum())
            new = m.model_copy(
                update=dict(
                    num_sequences=m.num_sequences + added,
                    num_rows=m.num_rows + tokens - added,
                    num_tokens=m.num_tokens + tokens,
                    num_key_bytes=m.num_key_bytes + fresh.key_bytes.size
                    if m.format_version >= 2
                    else 0,
                    generation=m.generation + 1,
                    updated=utcnow(),
                )
            )
            new, merged, run = self._write_run(m, new, fresh.hashes, fresh.order)
            write_root_attrs(self._store, root_attrs_for(new))
            self._handle.barrier()
            self._adopt(new)
            self._keys.wrote(run)  # lookups and the next merge read none of it back
            keyruns.drop(self._store, [r.key for r in merged])  # now no commit's
            if self._pending_rank is not None:
                self._rank, self._pending_rank = self._pending_rank, None
            self._keys.add(fresh.keys, m.num_sequences)
            return added
        finally:
            self._lock.release()

    def _write_run(
        self, m: Manifest, new: Manifest, hashes: np.ndarray, order: np.ndarray
    ) -> tuple[Manifest, list[keyruns.RunRef], tuple[keyruns.RunRef, bytes] | None]:
        """Write the key index run (FORMAT.md 4.11) of the commit ``new`` of keys ``hashes`` (sorted
        by ``order``) before it; returns ``new`` listing the run, the runs merged into it and the
        run with its object (a store without a key index: ``new``, ``[]``, ``None``)."""
        runs = m.runs()
        if runs is None:
            return new, [], None
        out = [new]

        def record(listed: list[keyruns.RunRef]) -> bytes:
            out[0] = new.model_copy(update={"key_index": [r.to_attrs() for r in listed]})
            return record_json(root_attrs_for(out[0]))

        table = self._keys.runs
        read = partial(keyruns.read_run, self._store) if table is None else table.entries
        _, ref, obj, merged = keyruns.next_runs(
            read, runs, hashes, m.num_sequences, new.generation, record, order
        )
        keyruns.put(self._store, ref.key, obj)
        self._handle.barrier()  # the run durable before the commit that lists it
        return out[0], merged, (ref, obj)

    def _load_id_map(self, m: Manifest) -> None:
        """Load the committed ``id_order`` (once) if the store remaps ids."""
        self._pending_rank = None
        if m.id_remap and m.num_rows > 0 and self._rank is None:
            order = np.asarray(zarr.open_array(self._store, path=spec.ID_ORDER, mode="r")[:])
            self._rank = idmap.inverse(order)

    def _remap_ids(self, m: Manifest, cols: dict[str, np.ndarray]) -> None:
        """Replace ids by their frequency rank; the first commit also writes ``id_order``."""
        if not m.id_remap:
            return
        ids = cols[spec.TOPK_IDS]
        rank = self._rank
        if m.num_rows == 0:
            order = idmap.build_id_order(ids, m.vocab_size)
            cols[spec.ID_ORDER] = order
            rank = self._pending_rank = idmap.inverse(order)
        assert rank is not None  # loaded by _load_id_map once the store has rows
        cols[spec.TOPK_IDS] = rank[ids]

    def _columns(self, m: Manifest, fresh: Batch) -> dict[str, np.ndarray]:
        """One block per array (the batch's, plus the sequence index with global offsets)."""
        lengths = fresh.lengths
        tok_start = m.num_tokens + np.concatenate([[0], np.cumsum(lengths)[:-1]])
        row_start = m.num_rows + np.concatenate([[0], np.cumsum(lengths - 1)[:-1]])
        cols = dict(fresh.arrays)
        cols[spec.INPUT_IDS] = fresh.input_ids
        cols[spec.SEQ_KEYS] = np.array(fresh.keys, dtype=object)
        cols[spec.SEQ_LENGTHS] = lengths.astype(np.int32)
        cols[spec.SEQ_TOKEN_START] = tok_start.astype(np.int64)
        cols[spec.SEQ_ROW_START] = row_start.astype(np.int64)
        if m.format_version >= 2:
            cols[spec.SEQ_KEY_BYTES] = fresh.key_bytes
            cols[spec.SEQ_KEY_END] = m.num_key_bytes + np.cumsum(fresh.key_lens)
        self._remap_ids(m, cols)
        if m.hidden is not None and m.num_rows == 0:  # the head, once (FORMAT.md 4.10)
            cols.update(head_columns(check_head(self._head, m.hidden, m.vocab_size)))
        return cols

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Release resources; idempotent. Everything appended is already committed."""
        if not self._closed:
            kept = {n: (d.last, d.sig) for n, d in self._direct.items() if d.sig is not None}
            with templates.LAST_LOCK:
                if kept:
                    templates.LAST[self._handle.url] = kept
                    templates.LAST.move_to_end(self._handle.url)
                while len(templates.LAST) > templates.KEEP_LAST_STORES:
                    templates.LAST.popitem(last=False)
        self._closed = True
        self._lock.release()

    def __enter__(self) -> CacheWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
