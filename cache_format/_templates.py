"""What a writer reuses instead of asking zarr again (FORMAT.md W6, 4.5): the ``zarr.json`` bytes of
each array around its length (a store created after another of the same layout gets its arrays'
metadata from these), and the last shard a closed writer of a store left."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from zarr.storage import StorePath

from . import _shardwrite as shardwrite
from . import spec
from ._seal import sealed
from ._shardread import DirectLayout, OpenShards, direct_layout
from ._zarr_adapter import ArrayV3Metadata, default_buffer_prototype
from .layout import ArrayDef

#: A first dimension no real array has: its digits mark where the length goes in a template.
_SENTINEL = 987_654_321_012_345

#: The :class:`DirectArray` templates this process has made, by (store URL, array name): the
#: layout and the ``zarr.json`` bytes around the length (:meth:`CacheWriter._from_template`).
TEMPLATES: OrderedDict[tuple[str, str], tuple[DirectLayout, bytes, bytes]] = OrderedDict()
#: Templates kept (arrays of the most recently written stores; a few KB each).
KEEP_TEMPLATES = 1024
#: The same templates by what fixes an empty array's metadata (format version, ``k``, its
#: :class:`~.layout.ArrayDef`): a store this process creates after one of the same layout gets
#: its arrays' ``zarr.json`` written from these bytes, not through zarr
#: (:meth:`CacheWriter._create_arrays`). One entry per layout preset and ``k`` in use.
CREATED: dict[tuple[int, int, ArrayDef], tuple[DirectLayout, bytes, bytes]] = {}
#: Guards the updates of :data:`TEMPLATES` and :data:`CREATED` (writers of several caches
#: run in as many threads).
TEMPLATES_LOCK = threading.Lock()
#: The last shards the most recently closed writers of :data:`KEEP_LAST_STORES` stores left, by
#: store URL and array name, each with its shard file's identity when written
#: (:func:`shard_sig`): a later writer of the store takes one instead of reading the shard back
#: when the file is still that one (:meth:`CacheWriter._from_template`).
LAST: OrderedDict[str, dict[str, tuple[shardwrite.LastShard, tuple[int, ...]]]] = OrderedDict()
LAST_LOCK = threading.Lock()
#: Stores whose last shards are kept after their writer closes (each holds up to about a shard
#: object per array: ~20 MB at k=100).
KEEP_LAST_STORES = 2


def shard_sig(lay: DirectLayout, last: shardwrite.LastShard) -> tuple[int, ...] | None:
    """The identity of the file holding ``last``'s shard as it stands now (device, inode,
    mtime in ns, size), on a local store; ``None`` elsewhere (no file to check) or if absent.
    Every object is replaced by a rename (a new inode), so an equal identity is the same file."""
    store = lay.store_path.store
    if last.shard < 0 or not isinstance(store, zarr.storage.LocalStore):
        return None
    try:
        st = os.stat(Path(store.root) / lay.shard_path(last.shard).path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


@dataclass
class DirectArray:
    """An array the writer grows and writes without zarr: its direct layout and its ``zarr.json`` as
    the bytes around the first dimension; the new ``zarr.json`` is those bytes with the new length
    in between, bit-identical to zarr's (tests/format/test_format_shardwrite.py compares them)."""

    lay: Any  # shardread.DirectLayout
    meta_path: Any  # zarr StorePath of the array's zarr.json
    head: bytes
    tail: bytes
    length: int  # the length this writer last gave the array
    last: shardwrite.LastShard  # its last shard as written (no read-back of committed chunks)
    sig: tuple[int, ...] | None = None  # its file's identity once written (shard_sig)

    @classmethod
    def of(cls, arr: Any, lay: Any, length: int, last: shardwrite.LastShard) -> DirectArray | None:
        """The template of ``arr`` (``None`` if its JSON does not hold the length once)."""
        md = arr.metadata
        if not isinstance(md, ArrayV3Metadata):
            return None
        probe = md.update_shape((_SENTINEL, *md.shape[1:]))
        raw = probe.to_buffer_dict(default_buffer_prototype())["zarr.json"].to_bytes()
        mark = str(_SENTINEL).encode()
        if raw.count(mark) != 1:
            return None
        head, tail = raw.split(mark)
        return cls(lay, arr.store_path / "zarr.json", head, tail, length, last)

    def objects(
        self, start: int, data: np.ndarray
    ) -> tuple[list[tuple[str, Any]], Callable[[], None]]:
        """The objects that set the length to ``start + len(data)`` and hold ``data`` at
        ``start`` (its ``zarr.json`` and shards), and what to call once all are written."""
        stop = start + data.shape[0]
        meta = self.head + str(stop).encode() + self.tail
        objects, rows_written = shardwrite.rows_objects(self.lay, start, data, self.last)

        def written() -> None:
            rows_written()
            self.length = stop
            self.sig = shard_sig(self.lay, self.last)

        return [(self.meta_path.path, meta), *objects], written


def direct_layout_of(arr: Any, name: str, version: int) -> DirectLayout | None:
    """The layout :mod:`._shardwrite` writes ``arr`` with, or ``None`` (written through zarr's
    ``setitem``: a layout it does not write, a version-1 store)."""
    if version < 2:
        return None
    seal = sealed(version)
    lay = direct_layout(arr, name, strict=True, sealed=seal)
    if lay is None and name == spec.SEQ_KEYS:  # vlen-utf8 strings
        lay = shardwrite.keys_layout(arr, name, strict=True, sealed=seal)
    return lay if lay is not None and shardwrite.supported(lay) else None


def direct_of(arr: Any, name: str, length: int, version: int) -> DirectArray | None:
    """``arr`` (of ``length`` rows, nothing written yet) as a :class:`DirectArray`, or ``None``."""
    lay = direct_layout_of(arr, name, version)
    return None if lay is None else DirectArray.of(arr, lay, length, shardwrite.LastShard())


def rebased(lay: DirectLayout, path: StorePath, length: int) -> DirectLayout:
    """A template's layout on another store path (and length), with no read caches."""
    return replace(
        lay, store_path=path, length=length, index_cache={}, paths={}, fds=OpenShards(), fast={}
    )
