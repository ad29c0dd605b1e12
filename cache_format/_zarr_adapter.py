"""Every use of zarr-python's private API by the format, in one place (pinned ``zarr>=3.1,<3.2``;
``tests/format/test_format_zarr_adapter.py`` checks each name against the installed zarr).

zarr's public API (``zarr.open_array``, ``zarr.abc.store``, ``zarr.codecs``, ``zarr.storage``)
covers most of the format. What it does not, and why the format needs it:
"""

from __future__ import annotations

import asyncio
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
    """The ``AsyncArray`` behind a synchronous array (``Array._async_array``): the reader issues
    the reads of several arrays concurrently in one call into zarr's event loop, which the
    synchronous ``Array`` cannot."""
    return arr._async_array


def open_arrays(store: Any, names: list[str]) -> dict[str, zarr.Array]:
    """Arrays ``names`` of the hierarchy at ``store``, opened read-only with their metadata
    read concurrently (one call into zarr's event loop, not one per array)."""
    from zarr.api import asynchronous

    async def gather() -> list[zarr.AsyncArray[Any]]:
        return await asyncio.gather(
            *(asynchronous.open_array(store=store, path=n, mode="r") for n in names)
        )

    return {n: zarr.Array(a) for n, a in zip(names, sync(gather()), strict=True)}


def blosc_codec(codec: Any) -> Any:
    """The numcodecs ``Blosc`` a ``BloscCodec`` encodes with (``BloscCodec._blosc_codec``): the
    direct shard writer compresses chunks with exactly zarr's codec object, so the bytes are
    zarr's."""
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
