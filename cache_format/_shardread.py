"""Direct reads of the format's sharded arrays (FORMAT.md §6, D2): the zarr v3 ``sharding_indexed``
codec (index at the end, FORMAT.md 4.7) read through the same zarr ``Store`` and decoded here, for
arrays whose layout :func:`direct_layout` understands (any other array is read through zarr).

Every CRC32C is verified; a mismatch, an index pointing outside the object or a blosc frame of
the wrong size is a :class:`~.errors.ChecksumError` (retried by the reader on a fresh snapshot,
R7). In a version-2 store (``strict``) an absent shard or empty entry in the committed range is
:class:`~.errors.MissingDataError` (R9), never fill value.

:func:`chunk_frames` fetches inner chunks by number: ``os.pread`` on a local store's shard files
(one read per run of consecutive chunks), concurrent range requests on other stores."""

from __future__ import annotations

import math
import os
import struct
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import google_crc32c
import numcodecs.blosc
import numpy as np
import zarr
from zarr.abc.store import RangeByteRequest, SuffixByteRequest
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ShardingCodec
from zarr.codecs.sharding import ShardingCodecIndexLocation
from zarr.storage import LocalStore, StorePath

from . import _outbuf as outbuf
from ._numba import EMPTY
from ._seal import SEAL_SIZE, check_seal, need_of
from ._zarr_adapter import (
    ArrayV3Metadata,
    Buffer,
    RegularChunkGrid,
    default_buffer_prototype,
    sync,
)
from .errors import ChecksumError, MissingDataError

_BLOSC_HEADER = 16  # version, versionlz, flags, typesize, nbytes, blocksize, cbytes (uint32 LE)
_HEADER = struct.Struct("<III")  # nbytes, blocksize, cbytes: bytes 4..16 of a blosc frame
_U32 = struct.Struct("<I")


FD_CACHE = 64
"""Shard files kept open per layout (:class:`OpenShards`); reads of other shards open and close
their file each time."""

FD_BUDGET = 256
"""Shard files kept open by all layouts of the process together (well below the usual limit of
1,024 open files, whatever the number of readers)."""

_kept = [0]  # files kept open now, all layouts
_kept_lock = threading.Lock()


class OpenShards:
    """Open read-only descriptors of a layout's shard files, up to :data:`FD_CACHE` (and
    :data:`FD_BUDGET` in the process), closed when the layout is dropped. Safe because stores are
    written by replacing whole objects (write, then rename): an open descriptor keeps the version it
    opened, which holds every row committed when the layout was made."""

    def __init__(self) -> None:
        self.fds: dict[int, int] = {}
        self.lock = threading.Lock()

    def get(self, shard: int) -> int | None:
        return self.fds.get(shard)

    def keep(self, shard: int, fd: int) -> bool:
        """Keep ``fd`` as shard ``shard``'s; ``False`` (the caller closes it) if the cache is
        full or another thread kept one first."""
        with self.lock, _kept_lock:
            if len(self.fds) >= FD_CACHE or shard in self.fds or _kept[0] >= FD_BUDGET:
                return False
            self.fds[shard] = fd
            _kept[0] += 1
            return True

    def close(self) -> None:
        with self.lock, _kept_lock:
            fds, self.fds = self.fds, {}
            _kept[0] -= len(fds)
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


@dataclass(frozen=True)
class DirectLayout:
    """What the direct path needs of one array: shards of ``shard_rows`` rows along axis 0, made
    of inner chunks of ``chunk_rows`` rows, each spanning the full trailing dimensions ``inner``.
    """

    name: str
    store_path: StorePath
    metadata: ArrayV3Metadata
    length: int
    inner: tuple[int, ...]
    dtype: np.dtype
    fill_value: object
    shard_rows: int
    chunk_rows: int
    strict: bool = False
    """Version >= 2 (FORMAT.md R9): an absent shard or chunk is :class:`MissingDataError`, not
    fill value (``length`` is then the committed count: nothing past it is read)."""
    sealed: bool = False
    """Version >= 4 (FORMAT.md 4.8): every shard object carries a seal before its index, checked
    with it (:mod:`._seal`; ``name`` must then be the array's name)."""
    raw: bool = False
    """Inner chunks have no compressor (codecs ``bytes`` LE + ``crc32c``): a chunk's stored bytes
    are its little-endian bytes followed by their CRC32C (FORMAT.md 4.7, ``random_access_raw``)."""
    index_cache: dict[int, np.ndarray] = field(
        default_factory=dict, compare=False, hash=False, repr=False
    )
    """Parsed indexes of *complete* shards (every row below ``length``, so an append-only writer
    never rewrites them) read through this layout: a later partial read of such a shard skips
    its suffix request. The reader makes new layouts at every refresh and after a failed read,
    so a cached index never outlives the snapshot it was read in."""
    paths: dict[int, str] = field(default_factory=dict, compare=False, hash=False, repr=False)
    """Local file path of each shard object :func:`chunk_frames` has read (local stores)."""
    fds: OpenShards = field(
        default_factory=lambda: OpenShards(), compare=False, hash=False, repr=False
    )
    """Shard files :func:`chunk_frames` keeps open for this layout (local stores)."""
    fast: dict[Any, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)
    """:mod:`._fastdecode`'s tables for this layout (descriptors and indexes of kept shards)."""

    @property
    def chunks_per_shard(self) -> int:
        return self.shard_rows // self.chunk_rows

    @property
    def tail_size(self) -> int:
        """Bytes at the end of a shard object read to get its index: the index and its CRC32C,
        after the seal in a sealed store."""
        return 16 * self.chunks_per_shard + 4 + (SEAL_SIZE if self.sealed else 0)

    @property
    def row_items(self) -> int:
        return math.prod(self.inner)

    def empty(self, rows: int) -> np.ndarray:
        """An uninitialised output block of ``rows`` rows (:func:`._outbuf.empty`: no huge-page
        request for large blocks)."""
        return outbuf.empty((rows, *self.inner), self.dtype)

    def shard_path(self, shard: int) -> StorePath:
        key = self.metadata.encode_chunk_key((shard,) + (0,) * len(self.inner))
        return self.store_path / key


def _little_endian_bytes(codec: object, dtype: np.dtype) -> bool:
    if not isinstance(codec, BytesCodec):
        return False
    endian = codec.endian.value if codec.endian is not None else None
    return endian == "little" or (endian is None and dtype.itemsize == 1)


def sharding_of(m: object) -> tuple[ArrayV3Metadata, RegularChunkGrid, ShardingCodec] | None:
    """Array metadata ``m`` with its chunk grid and sharding codec if it is a zarr v3 array of one
    ``sharding_indexed`` codec on a regular grid, index at the end (``bytes`` LE + ``crc32c``);
    else ``None``."""
    if not isinstance(m, ArrayV3Metadata) or m.storage_transformers or len(m.codecs) != 1:
        return None
    grid, sharding = m.chunk_grid, m.codecs[0]
    if not isinstance(grid, RegularChunkGrid) or not isinstance(sharding, ShardingCodec):
        return None
    idx = sharding.index_codecs
    if sharding.index_location != ShardingCodecIndexLocation.end or len(idx) != 2:
        return None
    ok = _little_endian_bytes(idx[0], np.dtype("<u8")) and isinstance(idx[1], Crc32cCodec)
    return (m, grid, sharding) if ok else None


def direct_layout(
    arr: zarr.Array | zarr.AsyncArray[Any],
    name: str = "",
    *,
    committed: int | None = None,
    strict: bool = False,
    sealed: bool = False,
) -> DirectLayout | None:
    """The array's :class:`DirectLayout`, or ``None`` if the direct path does not support it: zarr
    v3 shards along axis 0 (:func:`sharding_of`), inner chunks spanning the trailing dimensions with
    codecs ``bytes`` LE (+ ``blosc``) + ``crc32c``, a numeric dtype, a little-endian host.
    ``committed``: the entries readers may use (default: the array's length); ``strict``,
    ``sealed``: see :class:`DirectLayout`."""
    got = sharding_of(arr.metadata)
    if sys.byteorder != "little" or got is None:
        return None
    m, grid, sharding = got
    try:
        dtype = np.dtype(m.data_type.to_native_dtype())
    except Exception:
        return None
    if dtype.kind not in "iuf" or dtype.byteorder == ">":
        return None
    shape, shard_shape, chunk_shape = tuple(m.shape), tuple(grid.chunk_shape), sharding.chunk_shape
    inner = shape[1:]
    if len(shard_shape) != len(shape) or shard_shape[1:] != inner or chunk_shape[1:] != inner:
        return None
    if shard_shape[0] % chunk_shape[0]:
        return None
    codecs = sharding.codecs
    if len(codecs) not in (2, 3) or not _little_endian_bytes(codecs[0], dtype):
        return None
    if not isinstance(codecs[-1], Crc32cCodec):
        return None
    if len(codecs) == 3 and not isinstance(codecs[1], BloscCodec):
        return None
    return DirectLayout(
        name=name,
        store_path=arr.store_path,
        metadata=m,
        length=int(shape[0]) if committed is None else min(int(shape[0]), committed),
        inner=inner,
        dtype=dtype,
        fill_value=m.fill_value,
        shard_rows=int(shard_shape[0]),
        chunk_rows=int(chunk_shape[0]),
        strict=strict,
        sealed=sealed,
        raw=len(codecs) == 2,
    )


# --------------------------------------------------------------------------- fetching (I/O)
@dataclass
class _Shard:
    """The fetched bytes of one shard: its index and a window ``data`` of the object starting at
    byte ``base`` (``index is None``: the object does not exist, all fill value)."""

    shard: int
    c0: int  # first needed chunk (within the shard)
    c1: int  # one past the last needed chunk
    index: np.ndarray | None = None  # [chunks_per_shard, 2] uint64 (offset, nbytes)
    data: np.ndarray | None = None  # uint8
    base: int = 0


def _buffer(a: np.ndarray) -> Any:
    """``a`` for ``struct`` (a numpy array is a buffer; numpy's stubs do not say so)."""
    return cast(Any, a)


def crc_ok(frame: np.ndarray) -> bool:
    """Whether the last 4 bytes of ``frame`` (uint8) are the CRC32C (uint32 LE) of the bytes
    before."""
    size = len(frame)
    if size < 4:
        return False
    stored: int = _U32.unpack_from(_buffer(frame), size - 4)[0]
    return bool(google_crc32c.value(frame[:-4]) == stored)


def parse_index(raw: np.ndarray, n: int, where: str) -> np.ndarray:
    """The ``[n, 2]`` (offset, nbytes) table of a shard index, checked (ChecksumError)."""
    if raw.size != 16 * n + 4 or not crc_ok(raw):
        raise ChecksumError(f"{where}: shard index fails its CRC32C (or is truncated)")
    table = raw[:-4].view("<u8").reshape(n, 2).astype(np.uint64)
    empty = table == EMPTY
    if np.any(empty[:, 0] != empty[:, 1]):
        raise ChecksumError(f"{where}: shard index has a half-empty entry")
    return table


def read_index(
    lay: DirectLayout, tail: np.ndarray, shard: int, where: str, need: int | None = None
) -> np.ndarray:
    """The checked index table of shard ``shard`` from ``tail`` (the object's last
    :attr:`DirectLayout.tail_size` bytes); in a sealed store its seal first (the shard must hold
    ``need`` entries, by default those below ``lay.length``)."""
    n = lay.chunks_per_shard
    if tail.size != lay.tail_size:
        raise ChecksumError(f"{where}: object shorter than its index")
    if lay.sealed:
        if need is None:
            need = need_of(lay.length, shard, lay.shard_rows)
        check_seal(tail, lay.name, shard, need, lay.shard_rows, where)
    return parse_index(tail[-(16 * n + 4) :], n, where)


def as_bytes(buf: Buffer) -> np.ndarray:
    return np.ascontiguousarray(buf.as_numpy_array()).view(np.uint8).reshape(-1)


async def _fetch_shard(lay: DirectLayout, shard: int, c0: int, c1: int) -> _Shard:
    """Read the bytes of chunks ``[c0, c1)`` of shard ``shard`` (see the module docstring)."""
    n = lay.chunks_per_shard
    path = lay.shard_path(shard)
    where = f"{lay.name or path} shard {shard}"
    proto = default_buffer_prototype()
    got = _Shard(shard, c0, c1)
    complete = (shard + 1) * lay.shard_rows <= lay.length
    if 2 * (c1 - c0) >= n:
        buf = await path.get(prototype=proto)
        if buf is None:
            return got
        data = as_bytes(buf)
        if data.size < lay.tail_size:
            raise ChecksumError(f"{where}: object shorter than its index")
        got.index = read_index(lay, data[-lay.tail_size :], shard, where)
        got.data = data
        if complete:
            lay.index_cache[shard] = got.index
        return got
    index = lay.index_cache.get(shard) if complete else None
    if index is None:
        buf = await path.get(prototype=proto, byte_range=SuffixByteRequest(lay.tail_size))
        if buf is None:
            return got
        index = read_index(lay, as_bytes(buf), shard, where)
        if complete:
            lay.index_cache[shard] = index
    got.index = index
    want = got.index[c0:c1]
    want = want[want[:, 0] != EMPTY]
    if want.size:
        lo, hi = int(want[:, 0].min()), int((want[:, 0] + want[:, 1]).max())
        buf = await path.get(prototype=proto, byte_range=RangeByteRequest(lo, hi))
        got.data = as_bytes(buf) if buf is not None else np.zeros(0, np.uint8)
        got.base = lo
    return got


# --------------------------------------------------------------------------- decoding (CPU)
def _frame_error(frame: np.ndarray, nbytes: int) -> str | None:
    """Why ``frame`` (blosc frame + CRC32C, uint8) cannot decode to ``nbytes`` bytes, or
    ``None``."""
    if not crc_ok(frame):
        return "chunk fails its CRC32C"
    size = len(frame)
    if size < _BLOSC_HEADER + 4:
        return "chunk shorter than a blosc header"
    got, _blocksize, cbytes = _HEADER.unpack_from(_buffer(frame), 4)
    if got != nbytes or cbytes != size - 4:
        return f"blosc frame of {got} bytes, expected {nbytes}"
    return None


def check_decode(frame: np.ndarray, dest: np.ndarray, raw: bool = False) -> str | None:
    """Verify the CRC32C and blosc header of one inner chunk's stored bytes and decompress it into
    ``dest`` (a full chunk; ``raw``: check and copy); returns why it cannot, else ``None``."""
    if raw:
        if not crc_ok(frame):
            return "chunk fails its CRC32C"
        if frame.size - 4 != dest.nbytes:
            return f"raw chunk of {frame.size - 4} bytes, expected {dest.nbytes}"
        dest.reshape(-1).view(np.uint8)[...] = frame[:-4]
        return None
    err = _frame_error(frame, dest.nbytes)
    if err is None:
        numcodecs.blosc.decompress(frame[:-4], dest)
    return err


def decode_chunk(lay: DirectLayout, frame: np.ndarray, dest: np.ndarray, where: str) -> None:
    """Verify the CRC32C of one inner chunk and blosc-decode it into ``dest`` (a full chunk)."""
    err = check_decode(frame, dest, lay.raw)
    if err is not None:
        raise ChecksumError(f"{where}: {err}")


# --------------------------------------------------------------------------- point reads
Frame = np.ndarray
"""The stored bytes of one inner chunk (uint8): its blosc frame followed by its CRC32C (uint32
LE). (numpy views, not memoryviews: ``google_crc32c`` refuses memoryviews.)"""


def local_root(lay: DirectLayout) -> str | None:
    """The directory of the array's store if it is a local directory store (else ``None``)."""
    store = lay.store_path.store
    return str(store.root) if isinstance(store, LocalStore) else None


def _runs(chunks: Iterable[int], per_shard: int) -> dict[int, list[tuple[int, int]]]:
    """Sorted global chunk numbers -> ``{shard: [(c0, c1), ...]}`` runs of consecutive chunks."""
    out: dict[int, list[tuple[int, int]]] = {}
    for g in sorted(set(chunks)):
        s, c = divmod(g, per_shard)
        runs = out.setdefault(s, [])
        if runs and runs[-1][1] == c:
            runs[-1] = (runs[-1][0], c + 1)
        else:
            runs.append((c, c + 1))
    return out


def _frames_of(lay: DirectLayout, sh: _Shard, out: list[Frame | None]) -> None:
    """Append the frames of chunks ``[sh.c0, sh.c1)`` of a fetched shard to ``out``
    (bounds-checked; ``None`` for an absent shard or empty entry)."""
    if sh.index is None:
        out += [None] * (sh.c1 - sh.c0)
        return
    size = 0 if sh.data is None else sh.data.size
    for c, (off, nb) in enumerate(sh.index[sh.c0 : sh.c1].tolist(), start=sh.c0):
        if off == EMPTY:
            out.append(None)
            continue
        off -= sh.base
        if sh.data is None or off < 0 or off + nb > size:
            raise ChecksumError(f"{lay.name} shard {sh.shard}: chunk {c} outside the object")
        out.append(sh.data[off : off + nb])


def local_index(lay: DirectLayout, fd: int, shard: int) -> np.ndarray:
    """The parsed index of shard ``shard`` open as ``fd`` (:func:`open_shard`; cached for
    complete shards)."""
    complete = (shard + 1) * lay.shard_rows <= lay.length
    index = lay.index_cache.get(shard) if complete else None
    if index is None:
        where = f"{lay.name or lay.paths.get(shard)} shard {shard}"
        size, want = os.fstat(fd).st_size, lay.tail_size
        if size < want:
            raise ChecksumError(f"{where}: object shorter than its index")
        raw = np.frombuffer(os.pread(fd, want, size - want), dtype=np.uint8)
        index = read_index(lay, raw, shard, where)
        if complete:
            lay.index_cache[shard] = index
    return index


def open_shard(lay: DirectLayout, root: str, shard: int) -> tuple[int, bool] | None:
    """``(fd, owned)`` of shard ``shard``'s file (a local store under ``root``), or ``None`` if
    it does not exist; ``owned``: opened for this read only (the caller closes it), else kept
    open in ``lay.fds``."""
    fd = lay.fds.get(shard)
    if fd is not None:
        return fd, False
    path = lay.paths.get(shard)
    if path is None:
        path = lay.paths[shard] = os.path.join(root, lay.shard_path(shard).path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    return fd, not lay.fds.keep(shard, fd)


def _frames_local(lay: DirectLayout, root: str, chunks: list[int]) -> list[Frame | None]:
    """:func:`chunk_frames` of one local array: ``os.pread`` on the shard files, one read per
    run of consecutive chunks, frames as views of the bytes read."""
    out: list[Frame | None] = []
    for shard, runs in _runs(chunks, lay.chunks_per_shard).items():
        got = open_shard(lay, root, shard)
        if got is None:
            out += [None] * sum(c1 - c0 for c0, c1 in runs)
            continue
        fd, owned = got
        where = f"{lay.name or lay.paths[shard]} shard {shard}"
        try:
            index = local_index(lay, fd, shard)
            for c0, c1 in runs:  # one pread per run of consecutive chunks
                entries = index[c0:c1].tolist()
                used = [(o, nb) for o, nb in entries if o != EMPTY]
                if not used:
                    out += [None] * len(entries)
                    continue
                lo = min(o for o, _ in used)
                hi = max(o + nb for o, nb in used)
                buf = np.frombuffer(os.pread(fd, hi - lo, lo), dtype=np.uint8)
                if buf.size != hi - lo:
                    raise ChecksumError(f"{where}: chunks past the end of the object")
                for off, nb in entries:
                    out.append(None if off == EMPTY else buf[off - lo : off - lo + nb])
        finally:
            if owned:
                os.close(fd)
    return out


def chunk_frames(wanted: list[tuple[DirectLayout, list[int]]]) -> list[list[Frame | None]]:
    """The stored frames (not yet checked: :func:`decode_frame` does) of the given inner chunks of
    each layout (sorted, distinct global chunk numbers below its ``length``): one frame, or
    ``None`` for an absent shard or empty entry, per chunk. Local stores are read with
    ``os.pread``, others through the store in one call into zarr's event loop."""
    out: list[list[Frame | None]] = [[] for _ in wanted]
    remote: list[tuple[int, DirectLayout, int, int, int]] = []
    for i, (lay, chunks) in enumerate(wanted):
        root = local_root(lay)
        if root is not None:
            out[i] = _frames_local(lay, root, chunks)
            continue
        for shard, runs in _runs(chunks, lay.chunks_per_shard).items():
            remote += [(i, lay, shard, c0, c1) for c0, c1 in runs]
    if remote:
        import asyncio

        async def gather() -> list[_Shard]:
            return await asyncio.gather(*(_fetch_shard(lay, s, a, b) for _, lay, s, a, b in remote))

        for (i, lay, *_), sh in zip(remote, sync(gather()), strict=True):
            _frames_of(lay, sh, out[i])
    return out


def decode_frame(
    lay: DirectLayout, frame: Frame | None, chunk: int, dest: np.ndarray, rows: tuple[int, int]
) -> None:
    """Decode the frame of global chunk ``chunk`` into ``dest`` (a full chunk, C-contiguous);
    an absent frame is :class:`MissingDataError` in a strict store, else the fill value.
    ``rows``: the entries asked for ``(lo, hi)``, for the error message."""
    if frame is not None:
        err = check_decode(frame, dest, lay.raw)
        if err is None:
            return
        s, c = divmod(chunk, lay.chunks_per_shard)
        raise ChecksumError(f"{lay.name} shard {s} chunk {c}: {err}")
    if lay.strict:
        s, c = divmod(chunk, lay.chunks_per_shard)
        raise MissingDataError(
            f"array {lay.name}: entries {rows[0]}:{rows[1]} not stored "
            f"(chunk {c} of shard {s} missing)"
        )
    dest.fill(lay.fill_value)
