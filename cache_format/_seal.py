"""Shard seals (FORMAT.md 4.8, which fixes their bytes): in a version-4 store every shard object
carries, before its index, a seal binding it to its array, its shard number and the entries
written, so that an intact shard copied over another fails (:class:`PlacementError`). Readers
read it with the index and check it there; other Zarr v3 readers ignore the bytes."""

from __future__ import annotations

import asyncio
import math
import struct
from typing import Any

import google_crc32c
import numpy as np
from zarr.codecs import ShardingCodec

from ._zarr_adapter import default_buffer_prototype
from .errors import ChecksumError, PlacementError

SEAL_VERSION = 4
"""First format version whose shard objects carry a seal."""

MAGIC = b"LCS1"
_HEAD = struct.Struct("<4sIQQ")
SEAL_SIZE = _HEAD.size + 4


def sealed(version: int) -> bool:
    """Whether a store of format ``version`` seals its shard objects."""
    return version >= SEAL_VERSION


def name_crc(name: str) -> int:
    return int(google_crc32c.value(name.encode("utf-8")))


def make_seal(name: str, shard: int, entries: int, index: bytes | np.ndarray) -> bytes:
    """The seal of shard ``shard`` of array ``name`` holding ``entries`` entries, whose index
    (``16 n`` bytes and their CRC32C) is ``index``."""
    head = _HEAD.pack(MAGIC, name_crc(name), shard, entries)
    crc = google_crc32c.extend(google_crc32c.value(head), bytes(index))
    return head + int(crc).to_bytes(4, "little")


def check_seal(
    tail: np.ndarray, name: str, shard: int, need: int, shard_rows: int, where: str
) -> None:
    """Check the seal in ``tail`` (the object's last ``SEAL_SIZE + 16 n + 4`` bytes, uint8) of
    shard ``shard`` of array ``name``, which must hold at least ``need`` entries."""
    raw = tail.tobytes()
    head, crc, index = raw[: _HEAD.size], raw[_HEAD.size : SEAL_SIZE], raw[SEAL_SIZE:]
    magic, ncrc, at, entries = _HEAD.unpack(head)
    if magic != MAGIC or google_crc32c.extend(google_crc32c.value(head), index) != int.from_bytes(
        crc, "little"
    ):
        raise ChecksumError(f"{where}: shard seal absent or fails its CRC32C")
    if ncrc != name_crc(name) or at != shard:
        raise PlacementError(f"{where}: object belongs to another array or shard (seal: {at})")
    if entries < need or entries > shard_rows:
        raise PlacementError(
            f"{where}: object holds {entries} entries, the committed count needs {need}"
        )


def need_of(length: int, shard: int, shard_rows: int) -> int:
    """Entries of shard ``shard`` below ``length``."""
    return max(0, min(length - shard * shard_rows, shard_rows))


async def seal_written(arr: Any, name: str, start: int, stop: int) -> None:
    """Seal the shard objects holding entries ``[start, stop)`` of ``arr`` (just written through
    zarr's ``setitem``, which writes no seal): each rewritten whole with its seal inserted before
    its index. Arrays without sharding have nothing to seal."""
    m = arr.metadata
    if stop <= start or len(m.codecs) != 1 or not isinstance(m.codecs[0], ShardingCodec):
        return
    outer = tuple(m.chunk_grid.chunk_shape)
    n = math.prod(o // c for o, c in zip(outer, m.codecs[0].chunk_shape, strict=True))
    proto = default_buffer_prototype()

    async def one(s: int) -> None:
        path = arr.store_path / m.encode_chunk_key((s,) + (0,) * (len(outer) - 1))
        buf = await path.get(prototype=proto)
        if buf is None:  # nothing stored: a reader reports it (R9)
            return
        data = buf.to_bytes()
        cut = len(data) - (16 * n + 4)
        seal = make_seal(name, s, need_of(stop, s, outer[0]), data[cut:])
        out = data[:cut] + seal + data[cut:]
        await path.set(proto.buffer.from_bytes(out))

    await asyncio.gather(*(one(s) for s in range(start // outer[0], (stop - 1) // outer[0] + 1)))
