"""A store whose root ``zarr.json`` is lost: refused by writers, rebuilt by ``repair``
(FORMAT.md W6, 4.11).

A writer that finds the root missing or unreadable while the arrays hold data refuses the store
(:func:`refuse_if_holding_data`). :func:`repair` rebuilds the root from the newest commit record
in the key index runs, after checking the record's digest, the runs it lists and the arrays'
metadata; nothing is written unless a record passes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zarr

from . import _keyruns as keyruns
from . import spec
from ._manifest import Manifest
from ._zarr_adapter import sync
from .errors import FormatError, StoreNeedsRepairError
from .layout import array_defs, committed_lengths, parse_root, read_root_attrs, write_root_attrs
from .store import open_store

REPAIR_HINT = (
    "run `logitcache repair {url}` (rebuilds the root from the newest commit record of the "
    "store's key index), or restore the root zarr.json from a backup or copy of the store"
)


async def _first_data_key(store: zarr.abc.store.Store) -> str | None:
    """The first object of ``store`` that is neither a ``zarr.json`` (nor a local write's
    temporary ``zarr.<tag>.partial`` of one) nor the writer lock: a chunk, shard or key index
    run, which only an append writes (creation writes metadata only)."""
    async for key in store.list():
        name = key.rsplit("/", 1)[-1]
        metadata = name == "zarr.json" or (name.startswith("zarr.") and name.endswith(".partial"))
        if not metadata and name != spec.LOCK_NAME:
            return key
    return None


def refuse_if_holding_data(store: zarr.abc.store.Store, url: str | Path, root: str) -> None:
    """Raise :class:`StoreNeedsRepairError` when the store's root is ``root`` (missing,
    unreadable, the creation marker) but an array holds data: recreating it would delete rows
    that were committed under a manifest this writer cannot account for."""
    found = sync(_first_data_key(store))
    if found is not None:
        raise StoreNeedsRepairError(
            f"{url!s}: the root zarr.json (the manifest) is {root}, but the arrays hold data "
            f"(e.g. {found!r}); refusing to recreate the store over them: "
            + REPAIR_HINT.format(url=url)
        )


@dataclass(frozen=True)
class RepairResult:
    """What :func:`repair` did: ``repaired`` (the root was rewritten), the commit it restored
    (``generation``, ``num_sequences``) and a sentence saying so."""

    repaired: bool
    generation: int
    num_sequences: int
    message: str


def _run_of(store: Any, key: str) -> keyruns.RunRef | None:
    """The run stored at ``key`` as its own footer describes it (``None``: not a run)."""
    name = key[len(keyruns.PREFIX) :]
    try:
        first, end, gen = (int(x) for x in name.split("-"))
        return keyruns.ref_from_footer(store, key, first, end - first, gen)
    except (ValueError, FormatError):
        return None


def _usable(store: Any, ref: keyruns.RunRef) -> tuple[dict, Manifest] | None:
    """The root attributes recorded by run ``ref`` if they parse (digest included), list ``ref``
    with its runs intact, and every array's metadata is readable and long enough."""
    try:
        attrs = keyruns.read_record(store, ref)
        m = parse_root(attrs)
        runs = m.runs() or []
        if ref not in runs or m.generation != ref.generation:
            return None
        for r in runs:
            keyruns.read_fence(store, r)
        need = committed_lengths(m)
        for d in array_defs(m):
            arr = zarr.open_array(store, path=d.name, mode="r")
            if arr.shape[0] < need[d.name]:
                return None
    except Exception:  # any damage: this record cannot be the root
        return None
    return attrs, m


def repair(url: str | Path, storage_options: dict[str, Any] | None = None) -> RepairResult:
    """Rebuild the root ``zarr.json`` of the store at ``url`` when it is missing, unreadable or the
    creation marker (under the writer lock); a readable root is left as it is (``repaired=False``),
    and :class:`StoreNeedsRepairError` when no commit record passes (nothing written)."""
    from ._lock import make_lock

    handle = open_store(url, storage_options, read_only=False)
    store = handle.zstore
    lock = make_lock(handle)
    lock.acquire(60.0)
    try:
        try:
            attrs = read_root_attrs(store)
            if attrs is not None and spec.ROOT_ATTR in attrs:
                m = parse_root(attrs)
                return RepairResult(
                    False, m.generation, m.num_sequences, "the root is readable: nothing to repair"
                )
        except (ValueError, FormatError):
            pass  # unreadable, damaged or failing its digest: rebuilt below
        refs = [r for r in (_run_of(store, k) for k in keyruns.listed(store)) if r is not None]
        for ref in sorted(refs, key=lambda r: (r.generation, r.first + r.count), reverse=True):
            got = _usable(store, ref)
            if got is None:
                continue
            attrs, m = got
            write_root_attrs(store, attrs)
            handle.barrier()
            return RepairResult(
                True,
                m.generation,
                m.num_sequences,
                f"root rebuilt from the commit record of {ref.key}: generation {m.generation}, "
                f"{m.num_sequences} sequences",
            )
        raise StoreNeedsRepairError(
            f"{url!s}: no commit record in the store's key index passes its checks ("
            f"{len(refs)} run objects found; stores without a key index have none): restore the "
            "root zarr.json from a backup or copy of the store"
        )
    finally:
        lock.release()


def record_json(attrs: dict) -> bytes:
    """A commit record's bytes: the root attributes as canonical JSON."""
    return json.dumps(attrs, sort_keys=True).encode()


def add_key_index(url: str | Path, storage_options: dict[str, Any] | None = None) -> int | None:
    """Give a store created without a key index (version 3 or later) one (FORMAT.md 4.11): one
    run of every committed key, written with a commit of its own (generation + 1, the counts
    unchanged), under the writer lock. Returns the sequences indexed (``None``: it had one)."""
    import numpy as np

    from ._lock import make_lock
    from ._manifest import utcnow
    from ._reader import CacheReader
    from .errors import StoreNotFoundError
    from .layout import root_attrs_for

    handle = open_store(url, storage_options, read_only=False)
    lock = make_lock(handle)
    lock.acquire(60.0)
    try:
        attrs = read_root_attrs(handle.zstore)
        if attrs is None:
            raise StoreNotFoundError(f"no logitcache store at {url!s}")
        m = parse_root(attrs)
        if m.key_index is not None:
            return None
        if m.format_version < 3:
            raise FormatError(
                f"{url!s}: a version-{m.format_version} store has no root digest to cover a key "
                "index (FORMAT.md 2.2)"
            )
        with CacheReader(url, storage_options) as reader:
            table = reader.index.table
            table.grow(m.num_sequences)  # every key hashed, as a lookup without an index does
            h, at = table.sorted_hashes()
        order = np.lexsort((at, h))
        ent = np.empty(len(h), keyruns.ENTRY)
        ent["hash"], ent["seq"] = h[order], at[order]
        new = m.model_copy(update={"generation": m.generation + 1, "updated": utcnow()})
        out = [new]

        def record(ref: keyruns.RunRef) -> bytes:
            out[0] = new.model_copy(update={"key_index": [ref.to_attrs()]})
            return record_json(root_attrs_for(out[0]))

        if m.num_sequences:
            ref, obj = keyruns.encode_run(ent, 0, new.generation, record)
            keyruns.put(handle.zstore, ref.key, obj)
            handle.barrier()
        else:
            out[0] = new.model_copy(update={"key_index": []})
        write_root_attrs(handle.zstore, root_attrs_for(out[0]))
        handle.barrier()
        return m.num_sequences
    finally:
        lock.release()
