"""Every use of zarr-python's private API by the format, in one place (pinned ``zarr>=3.1,<3.2``;
``tests/format/test_format_zarr_adapter.py`` checks each name against the installed zarr).

zarr's public API (``zarr.open_array``, ``zarr.abc.store``, ``zarr.codecs``, ``zarr.storage``)
covers most of the format. What it does not, and why the format needs it:
"""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import zarr

# Buffers for store ``get``/``set`` calls: the store API takes a prototype and returns a
# ``Buffer``, both defined in ``zarr.core.buffer`` (no public alias in zarr 3.1).
from zarr.core.buffer import Buffer, default_buffer_prototype

# The metadata classes the direct shard reader and writer check an array's layout against
# (regular chunk grid, v3 metadata, root group document): public types only under these
# private modules.
from zarr.core.chunk_grids import RegularChunkGrid
from zarr.core.group import GroupMetadata
from zarr.core.metadata.v3 import ArrayV3Metadata

# The format's reads and writes run zarr's async store and array calls from synchronous code
# (the reader's refresh, the writer's appends) on zarr's own event loop thread, as zarr's sync
# API does internally; there is no public entry to that loop.
from zarr.core.sync import sync

__all__ = [
    "ArrayV3Metadata",
    "Buffer",
    "GroupMetadata",
    "RegularChunkGrid",
    "async_array",
    "blosc_codec",
    "default_buffer_prototype",
    "load_shard_index",
    "open_arrays",
    "sync",
    "zstd_codec",
]


def async_array(arr: zarr.Array) -> zarr.AsyncArray[Any]:
    """The ``AsyncArray`` behind a synchronous array (``Array._async_array``): reads of several
    arrays are issued concurrently in one call into zarr's event loop."""
    return arr._async_array


#: An opened array and its parsed metadata document (``zarr.json``).
Opened = tuple[zarr.Array, dict[str, Any]]


def _documents(store: Any, names: list[str]) -> list[dict[str, Any] | None]:
    """The parsed ``zarr.json`` of each array (``None``: absent or not a JSON object): a local
    store's read here, another's in one call into zarr's event loop."""
    if isinstance(store, zarr.storage.LocalStore):
        raws: list[bytes | None] = []
        for n in names:
            try:
                raws.append((Path(store.root) / n / "zarr.json").read_bytes())
            except (FileNotFoundError, NotADirectoryError):
                raws.append(None)
    else:

        async def gather() -> list[Buffer | None]:
            proto = default_buffer_prototype()
            keys = [f"{n}/zarr.json" for n in names]
            return await asyncio.gather(*(store.get(k, prototype=proto) for k in keys))

        raws = [None if b is None else b.to_bytes() for b in sync(gather())]
    docs: list[dict[str, Any] | None] = []
    for raw in raws:
        try:
            doc = None if raw is None else json.loads(raw)
        except ValueError:
            doc = None
        docs.append(doc if isinstance(doc, dict) else None)
    return docs


def open_arrays(
    store: Any, names: list[str], known: dict[str, Opened] | None = None
) -> dict[str, Opened]:
    """Arrays ``names`` at ``store``, opened read-only, with their metadata: an array whose document
    equals its ``known`` one but for the shape is reused at the new shape; the others are opened by
    zarr concurrently."""
    from zarr.api import asynchronous

    out: dict[str, Opened] = {}
    docs = dict(zip(names, _documents(store, names), strict=True))
    for n, doc in docs.items():
        prev = (known or {}).get(n)
        if doc is None or prev is None or {**doc, "shape": 0} != {**prev[1], "shape": 0}:
            continue
        shape = doc.get("shape")
        old = prev[0]
        if (
            isinstance(shape, list)
            and len(shape) == old.ndim
            and all(isinstance(x, int) and x >= 0 for x in shape)
        ):
            # the document is the one ``old`` was parsed from but for its shape: a copy with the
            # new shape (zarr's ``update_shape`` parses and checks the whole document again)
            meta = copy.copy(old.metadata)
            object.__setattr__(meta, "shape", tuple(shape))
            arr = zarr.AsyncArray(meta, old.store_path, old._async_array.config)
            out[n] = (zarr.Array(arr), doc)
    todo = [n for n in names if n not in out]

    async def gather() -> list[zarr.AsyncArray[Any]]:
        return await asyncio.gather(
            *(asynchronous.open_array(store=store, path=n, mode="r") for n in todo)
        )

    if todo:
        for n, a in zip(todo, sync(gather()), strict=True):
            out[n] = (zarr.Array(a), docs[n] or {})
    return {n: out[n] for n in names}


def blosc_codec(codec: Any) -> Any:
    """The numcodecs ``Blosc`` a ``BloscCodec`` encodes with (``BloscCodec._blosc_codec``): the
    direct shard writer compresses with exactly zarr's codec object, so the bytes are zarr's."""
    return codec._blosc_codec


def zstd_codec(codec: Any) -> Any:
    """The numcodecs ``Zstd`` of a ``ZstdCodec`` (``ZstdCodec._zstd_codec``), for the same
    reason as :func:`blosc_codec` (the ``vlen-utf8`` key arrays)."""
    return codec._zstd_codec


async def load_shard_index(sharding: Any, path: Any, chunks_per_shard: tuple[int, ...]) -> Any:
    """A shard's parsed index (``ShardingCodec._load_shard_index_maybe``; ``None`` for an absent
    object): the R9 presence check reads only the index of each shard, which zarr's public API
    does not expose (it reads absent chunks as fill value)."""
    return await sharding._load_shard_index_maybe(path, chunks_per_shard)
