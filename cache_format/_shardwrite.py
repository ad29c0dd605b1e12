"""Direct writes of new rows into the format's sharded arrays (the write side of
:mod:`._shardread`).

The shard objects are encoded here, on the calling thread, byte for byte as zarr's codec
pipeline encodes them (FORMAT.md 4.7, 4.8), for arrays :func:`~._shardread.direct_layout`
understands and for ``seq_keys`` (:func:`keys_layout`); the writer writes them through the same
zarr ``Store`` (:func:`.store.put_objects`) and falls back to zarr for other arrays. Chunks below
the committed count ``start`` keep their stored bytes (W3); the chunk holding ``start`` is read
back and completed; chunks past the new rows stay empty. A lost shard below ``start`` in a
version-2 store is :class:`~.errors.MissingDataError` (R9), a corrupt index or chunk
:class:`~.errors.ChecksumError`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import google_crc32c
import numpy as np
from numcodecs.vlen import VLenUTF8
from zarr.codecs import BloscCodec, ShardingCodec, ZstdCodec

from . import _outbuf as outbuf
from ._seal import SEAL_SIZE, make_seal
from ._shardread import EMPTY, DirectLayout, as_bytes, crc_ok, read_index, sharding_of
from ._shardread import decode_chunk as shardread_decode_chunk
from ._zarr_adapter import (
    blosc_codec,
    default_buffer_prototype,
    sync,
    zstd_codec,
)
from .errors import ChecksumError, MissingDataError
from .store import DIRECT_IO_ALIGN

#: The ``vlen-utf8`` encoding zarr applies to string chunks (``zarr.codecs.vlen_utf8``).
_VLEN = VLenUTF8()

#: :func:`_codec` of an array without compressor (layout preset ``random_access_raw``).
RAW = "none"


def supported(lay: DirectLayout) -> bool:
    """Whether this zarr exposes the codec the array's chunks are encoded with (its numcodecs Blosc,
    or Zstd for ``vlen-utf8``) or the array has none (``raw``); if not, the writer uses zarr's
    ``setitem``."""
    try:
        return _codec(lay) is not None
    except Exception:
        return False


def _codec(lay: DirectLayout) -> Any:
    """The numcodecs codec zarr encodes this array's inner chunks with: ``Blosc`` (after the
    ``bytes`` codec), or ``Zstd`` (after ``vlen-utf8``: an object array of str); :data:`RAW`
    for an array without compressor (``bytes`` then ``crc32c``)."""
    if lay.raw:
        return RAW
    sharding = lay.metadata.codecs[0]
    assert isinstance(sharding, ShardingCodec)  # direct layouts are of sharded arrays only
    inner = sharding.codecs[1]
    if isinstance(inner, BloscCodec):
        return blosc_codec(inner)
    assert isinstance(inner, ZstdCodec) and lay.dtype == np.dtype(object)
    return zstd_codec(inner)


def keys_layout(arr: Any, name: str, *, strict: bool, sealed: bool = False) -> DirectLayout | None:
    """The :class:`~._shardread.DirectLayout` of a 1-D ``vlen-utf8`` array (``seq_keys``) sharded as
    the numeric arrays are, with inner codecs ``vlen-utf8`` -> ``zstd`` -> ``crc32c``; ``None`` for
    any other array."""
    from zarr.codecs import Crc32cCodec
    from zarr.codecs.vlen_utf8 import VLenUTF8Codec

    got = sharding_of(arr.metadata)
    if got is None:
        return None
    m, grid, sharding = got
    codecs = sharding.codecs
    if len(m.shape) != 1 or not isinstance(m.fill_value, str) or len(codecs) != 3:
        return None
    if not isinstance(codecs[0], VLenUTF8Codec) or not isinstance(codecs[1], ZstdCodec):
        return None
    if not isinstance(codecs[2], Crc32cCodec):
        return None
    shard, chunk = int(grid.chunk_shape[0]), int(sharding.chunk_shape[0])
    if shard % chunk:
        return None
    return DirectLayout(
        name=name,
        store_path=arr.store_path,
        metadata=m,
        length=int(m.shape[0]),
        inner=(),
        dtype=np.dtype(object),
        fill_value=m.fill_value,
        shard_rows=shard,
        chunk_rows=chunk,
        strict=strict,
        sealed=sealed,
    )


def encode_chunk(lay: DirectLayout, chunk: np.ndarray) -> tuple[bytes | np.ndarray, bytes]:
    """One inner chunk's stored bytes as their two parts, not concatenated: the blosc frame of
    its little-endian bytes (the array's own codec settings), or the zstd frame of its
    ``vlen-utf8`` bytes, and the frame's CRC32C."""
    codec = _codec(lay)
    if codec is RAW:  # the chunk's little-endian bytes are the frame
        le = np.ascontiguousarray(chunk, dtype=lay.dtype.newbyteorder("<"))
        frame = le.view(np.uint8).reshape(-1)
    elif lay.dtype == np.dtype(object):
        frame = codec.encode(_VLEN.encode(np.asarray(chunk, dtype=object)))
    else:
        frame = codec.encode(np.ascontiguousarray(chunk).view(np.uint8).reshape(-1))
    return frame, google_crc32c.value(frame).to_bytes(4, "little")


def _decode_chunk(lay: DirectLayout, frame: np.ndarray, where: str) -> np.ndarray:
    if lay.dtype != np.dtype(object):  # the read side's checks (CRC32C, size), then decode
        out = np.empty((lay.chunk_rows, *lay.inner), dtype=lay.dtype)
        shardread_decode_chunk(lay, frame, out, where)
        return out
    if not crc_ok(frame):
        raise ChecksumError(f"{where}: inner chunk fails its CRC32C")
    try:
        out = _VLEN.decode(_codec(lay).decode(frame[:-4].tobytes()))
    except Exception as e:  # a broken frame
        raise ChecksumError(f"{where}: inner chunk does not decode ({e})") from e
    if out.shape != (lay.chunk_rows,):
        raise ChecksumError(f"{where}: inner chunk holds {out.shape[0]} items")
    return out


def _aligned(size: int) -> np.ndarray:
    """``size`` uninitialised bytes starting on a page boundary (from :func:`._outbuf.empty`), so
    that an ``O_DIRECT`` store writes the object's pages straight from them."""
    raw = outbuf.empty(size + DIRECT_IO_ALIGN)
    start = -raw.ctypes.data % DIRECT_IO_ALIGN
    return raw[start : start + size]


def _existing(lay: DirectLayout, shard: int, below: int) -> tuple[list, np.ndarray | None]:
    """The stored bytes of the chunks wholly below row ``below`` of ``shard`` and the rows of
    the chunk holding ``below`` that precede it (None when ``below`` starts a chunk); read on
    the calling thread (never from zarr's event loop)."""
    n, c = lay.chunks_per_shard, lay.chunk_rows
    keep: list[np.ndarray | None] = [None] * n
    full, part = divmod(below, c)
    where = f"{lay.name} shard {shard}"
    buf = sync(lay.shard_path(shard).get(prototype=default_buffer_prototype()))
    if buf is None:
        if lay.strict:
            raise MissingDataError(f"{where}: shard object missing below the committed count")
        head = np.full((part, *lay.inner), lay.fill_value, dtype=lay.dtype) if part else None
        return keep, head
    data = as_bytes(buf)
    if data.size < lay.tail_size:
        raise ChecksumError(f"{where}: shard shorter than its index")
    table = read_index(lay, data[-lay.tail_size :], shard, where, need=below)
    body = data.size - lay.tail_size

    def frame(i: int) -> np.ndarray | None:
        off, nb = int(table[i, 0]), int(table[i, 1])
        if off == EMPTY:
            if lay.strict:
                raise MissingDataError(f"{where}: chunk {i} missing below the committed count")
            return None
        if off + nb > body:
            raise ChecksumError(f"{where}: chunk {i} points outside the shard")
        return data[off : off + nb]

    for i in range(full):
        keep[i] = frame(i)
    head = None
    if part:
        f = frame(full)
        if f is None:
            head = np.full((part, *lay.inner), lay.fill_value, dtype=lay.dtype)
        else:
            head = _decode_chunk(lay, f, f"{where} chunk {full}")[:part]
    return keep, head


@dataclass
class LastShard:
    """What this process last wrote to an array's last shard (its chunk frames and the rows of its
    last chunk, as of row ``end``): the next append starting there takes the committed chunks from
    here instead of reading the shard back (the same bytes). The caller drops it whenever the array
    may have changed under it."""

    shard: int = -1
    end: int = 0
    frames: list[Any] = field(default_factory=list)
    head: np.ndarray | None = None  # rows of the chunk holding ``end`` below it


def _shard_object(
    lay: DirectLayout,
    shard: int,
    off: int,
    rows: np.ndarray,
    reuse: LastShard | None = None,
    update: LastShard | None = None,
) -> tuple[str, np.ndarray, Callable[[], None]]:
    """The object of ``shard`` with ``rows`` at row ``off`` (rows below ``off`` are committed): its
    key, its bytes (assembled in one buffer) and what to call once it is written. The committed
    chunks come from ``reuse`` (this shard as last written, ending at ``off``) or are read back."""
    n, c = lay.chunks_per_shard, lay.chunk_rows
    keep: list[Any] = [None] * n
    head = None
    if off and reuse is not None:
        keep[: len(reuse.frames)] = reuse.frames
        head = reuse.head
    elif off:
        keep, head = _existing(lay, shard, off)
    first = off // c
    last = (off + rows.shape[0] - 1) // c
    lead = 0 if head is None else head.shape[0]  # committed rows of chunk ``first``

    def chunk_rows(i: int) -> np.ndarray:
        """Inner chunk ``i``'s rows (``first <= i <= last``), padded with the fill value."""
        lo = (i - first) * c - lead  # into ``rows``
        part = rows[max(lo, 0) : lo + c]
        if lo >= 0 and part.shape[0] == c:
            return part  # a view: no copy before blosc
        full = np.empty((c, *lay.inner), dtype=lay.dtype)
        at = -lo if lo < 0 else 0
        if lo < 0:
            assert head is not None
            full[:at] = head
        full[at : at + part.shape[0]] = part
        full[at + part.shape[0] :] = lay.fill_value  # only the rows past the data
        return full

    new = [encode_chunk(lay, chunk_rows(i)) for i in range(first, last + 1)]
    frames: list[Any] = [
        keep[i] if i < first else (new[i - first] if i <= last else None) for i in range(n)
    ]
    sizes = [
        0 if f is None else (len(f[0]) + len(f[1]) if isinstance(f, tuple) else len(f))
        for f in frames
    ]
    body = sum(sizes)
    seal = SEAL_SIZE if lay.sealed else 0
    payload = _aligned(body + seal + 16 * n + 4)
    table = np.full((n, 2), EMPTY, dtype="<u8")
    pos = 0
    views: list[np.ndarray | None] = [None] * n
    for i, f in enumerate(frames):
        if f is None:
            continue
        size = sizes[i]
        if isinstance(f, tuple):  # a new chunk: frame, then its CRC32C
            k = len(f[0])
            payload[pos : pos + k] = np.frombuffer(f[0], dtype=np.uint8)
            payload[pos + k : pos + size] = np.frombuffer(f[1], dtype=np.uint8)
        else:  # a committed chunk's stored bytes
            payload[pos : pos + size] = np.frombuffer(f, dtype=np.uint8)
        table[i] = (pos, size)
        views[i] = payload[pos : pos + size]
        pos += size
    index = table.tobytes()
    index += google_crc32c.value(index).to_bytes(4, "little")
    payload[body + seal :] = np.frombuffer(index, dtype=np.uint8)
    if seal:  # FORMAT.md 4.8: this object's array, place and fill, bound to its index
        sealed_by = make_seal(lay.name, shard, off + rows.shape[0], index)
        payload[body : body + seal] = np.frombuffer(sealed_by, dtype=np.uint8)

    def written() -> None:  # as this shard now stands (only once its write has returned)
        if update is None:
            return
        end = off + rows.shape[0]
        done, part = divmod(end, c)
        update.frames = views[:done]
        tail = None
        if part:  # the rows of chunk ``done`` below ``end``
            if done == first and head is not None:
                tail = np.concatenate([head, rows])
            else:
                tail = np.array(rows[(done - first) * c - lead :], copy=True)
        update.head = tail
        update.shard, update.end = shard, end

    return lay.shard_path(shard).path, payload, written


def rows_objects(
    lay: DirectLayout, start: int, data: np.ndarray, last: LastShard | None = None
) -> tuple[list[tuple[str, np.ndarray]], Callable[[], None]]:
    """The shard objects holding ``data`` (rows ``[start, start + len(data))``, the array already
    resized), encoded on the calling thread, and what to call once all are written (the caller
    writes them in one batch). ``last``: the array's :class:`LastShard`, used when the write
    starts where it ends and updated once written."""
    if data.shape[0] == 0:
        return [], lambda: None
    data = np.ascontiguousarray(data, dtype=lay.dtype)
    if data.shape[1:] != lay.inner:
        raise ValueError(f"{lay.name}: rows of shape {data.shape[1:]}, array has {lay.inner}")
    s = lay.shard_rows
    stop = start + data.shape[0]
    objects, done = [], []
    for shard in range(start // s, (stop - 1) // s + 1):
        lo, hi = max(start, shard * s), min(stop, (shard + 1) * s)
        off = lo - shard * s
        reuse = None
        if last is not None and last.shard == shard and last.end == off and off:
            reuse = LastShard(shard, off, list(last.frames), last.head)  # before any update
        update = last if shard == (stop - 1) // s else None
        key, payload, written = _shard_object(
            lay, shard, off, data[lo - start : hi - start], reuse, update
        )
        objects.append((key, payload))
        done.append(written)
    if last is not None:
        last.shard = -1  # stale until the last shard's write has returned

    def all_written() -> None:
        for written in done:
            written()

    return objects, all_written
