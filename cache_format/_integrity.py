"""Presence checks for reads through zarr's array API (FORMAT.md R9): zarr reads an absent chunk as
the fill value, but in a version-2 store every chunk of the committed range is stored.
:func:`missing_ranges` finds the absent ones (one suffix request per shard, no listing) and
:func:`checked_get` raises :class:`~.errors.MissingDataError` instead of returning fill values."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import zarr
from zarr.abc.store import SuffixByteRequest
from zarr.codecs import ShardingCodec

from ._seal import SEAL_SIZE, check_seal
from ._shardread import EMPTY, as_bytes, parse_index
from ._zarr_adapter import (
    ArrayV3Metadata,
    RegularChunkGrid,
    async_array,
    default_buffer_prototype,
    load_shard_index,
    sync,
)
from .errors import ChecksumError, CorruptStoreError, FormatError, MissingDataError


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


async def _sealed_index(
    arr: zarr.AsyncArray, path: Any, shard: int, n: int, need: int, shard_rows: int
) -> np.ndarray | None:
    """The index table ``[n, 2]`` of a sealed shard object (FORMAT.md 4.8), its seal checked;
    ``None`` if the object is absent."""
    where = f"array {arr.path} shard {shard}"
    size = SEAL_SIZE + 16 * n + 4
    buf = await path.get(prototype=default_buffer_prototype(), byte_range=SuffixByteRequest(size))
    if buf is None:
        return None
    tail = as_bytes(buf)
    if tail.size != size:
        raise ChecksumError(f"{where}: object shorter than its index")
    check_seal(tail, arr.path.rsplit("/", 1)[-1], shard, need, shard_rows, where)
    return parse_index(tail[SEAL_SIZE:], n, where)


async def missing_ranges(
    arr: zarr.AsyncArray, start: int, stop: int, *, sealed: bool = False
) -> list[tuple[int, int]]:
    """Entry ranges ``[a, b)`` (axis 0, clipped to ``[start, stop)``) of chunks that hold part of
    ``[start, stop)`` but are not stored (absent object or empty shard-index entry). ``sealed``
    (version >= 4): each shard's seal is checked too (:class:`PlacementError`)."""
    m = arr.metadata
    if stop <= start:
        return []
    if not isinstance(m, ArrayV3Metadata) or not isinstance(m.chunk_grid, RegularChunkGrid):
        raise CorruptStoreError(f"array {arr.path}: not a zarr v3 regular-grid array")
    shape, outer = tuple(m.shape), tuple(m.chunk_grid.chunk_shape)
    trailing = [range(math.ceil(s / c)) for s, c in zip(shape[1:], outer[1:], strict=True)]
    sharding = (
        m.codecs[0] if len(m.codecs) == 1 and isinstance(m.codecs[0], ShardingCodec) else None
    )
    inner0 = sharding.chunk_shape[0] if sharding is not None else outer[0]
    cps = (
        tuple(o // c for o, c in zip(outer, sharding.chunk_shape, strict=True)) if sharding else ()
    )
    missing: list[tuple[int, int]] = []
    for s in range(start // outer[0], (stop - 1) // outer[0] + 1):
        for t in itertools.product(*trailing):
            key = m.encode_chunk_key((s, *t))
            path = arr.store_path / key
            lo, hi = max(start, s * outer[0]), min(stop, (s + 1) * outer[0])
            if sharding is None:
                if not await path.exists():
                    missing.append((lo, hi))
                continue
            table: np.ndarray | None
            if sealed:
                n = math.prod(cps)
                table = await _sealed_index(arr, path, s, n, hi - s * outer[0], outer[0])
                if table is not None:
                    table = table.reshape(*cps, 2)
            else:
                try:
                    index = await load_shard_index(sharding, path, cps)
                except Exception as e:  # CRC32C of the index, truncated object
                    raise ChecksumError(
                        f"array {arr.path} shard {key}: index unreadable: {e}"
                    ) from e
                table = None if index is None else np.asarray(index.offsets_and_lengths)
            if table is None:
                missing.append((lo, hi))
                continue
            c0, c1 = (lo - s * outer[0]) // inner0, (hi - 1 - s * outer[0]) // inner0 + 1
            empty = (table[c0:c1, ..., 0] == EMPTY).reshape(c1 - c0, -1).any(axis=1)
            for c in np.flatnonzero(empty):
                r0 = s * outer[0] + (c0 + int(c)) * inner0
                missing.append((max(lo, r0), min(hi, r0 + inner0)))
    return _merge(missing)


def describe(name: str, ranges: list[tuple[int, int]], unit: str = "entries") -> str:
    spans = ", ".join(f"{a}:{b}" for a, b in ranges[:5]) + (" ..." if len(ranges) > 5 else "")
    return f"array {name}: {unit} {spans} not stored (object or chunk missing)"


async def checked_get(
    arr: zarr.AsyncArray, name: str, start: int, stop: int, strict: bool, sealed: bool = False
) -> np.ndarray:
    """``arr[start:stop]`` through zarr; with ``strict`` first :func:`missing_ranges` (and,
    ``sealed``, the seals); any failure of zarr's decoding becomes a :class:`ChecksumError` naming
    the range."""
    if strict or sealed:
        gaps = await missing_ranges(arr, start, stop, sealed=sealed)
        if gaps:
            raise MissingDataError(describe(name, gaps))
    try:
        return np.asarray(await arr.getitem(slice(start, stop)))
    except FormatError:
        raise
    except Exception as e:  # CRC32C mismatch, codec failure, truncated object
        raise ChecksumError(f"array {name}: entries {start}:{stop} unreadable: {e}") from e


def checked_read(
    arr: zarr.Array, name: str, start: int, stop: int, strict: bool, sealed: bool = False
) -> np.ndarray:
    """:func:`checked_get` of a synchronous array, run on zarr's event loop."""
    return np.asarray(sync(checked_get(async_array(arr), name, start, stop, strict, sealed)))
