"""The compiled decoder: the whole decode of a read call in one compiled call per thread
(FORMAT.md D4).

One ``nogil`` numba function (:mod:`._fastkernels`) takes the call's items (array, rows, output
row) with the layouts' tables of open shard descriptors and parsed indexes, reads each run of
needed chunks with ``pread`` (``preadv`` straight into the output for whole ``raw`` chunks),
checks every chunk's CRC32C and blosc header, decompresses it (``blosc_decompress_ctx``, found by
:mod:`._cdecode`) into the call's arena or a scratch chunk, then undoes the logprob row delta
and widens float16 to float32. Anything it cannot do (a missing shard, a bad frame) is handed
back to the NumPy decoder, which raises the typed error. The records of a call are views of one
arena.

:data:`AVAILABLE` is ``False`` without numba or the C symbols, or once :func:`ready`'s
self-check fails; the kernels compile at the first read of a process (numba caches them on disk)."""

from __future__ import annotations

import ctypes
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import numpy as np

from . import _cdecode as cdecode
from . import _numba
from . import _outbuf as outbuf
from . import _shardread as shardread
from ._numba import NEED_BUFFER, NEED_SHARDS, OK
from ._plan import run_groups, split
from ._shardread import DirectLayout

AVAILABLE = _numba.AVAILABLE and cdecode.FOUND
"""Whether the compiled decoder may run here (numba importable and the C functions found;
decided at import); set ``False`` by :func:`ready` if compiling or the self-check fails."""

_kernels: dict[str, Any] | None = None
_lock = threading.Lock()


def _address(fn: Any) -> int:
    """The integer address of a ctypes function (or function pointer)."""
    address = ctypes.cast(fn, ctypes.c_void_p).value
    assert address is not None
    return address


def _cfuncs() -> np.ndarray:
    """The addresses of ``(crc32c_value, blosc_decompress_ctx, pread, memcpy, preadv)``
    (int64; the kernels call them through :mod:`._fastkernels`' intrinsics with their C
    signatures). The libraries stay loaded: :mod:`._cdecode` holds the first two, libc the rest."""
    assert cdecode.FUNCS is not None
    crc, dec = cdecode.FUNCS
    libc = ctypes.CDLL(None)
    fns = (crc, dec, libc.pread, libc.memcpy, libc.preadv)
    return np.array([_address(f) for f in fns], np.int64)


def _compile() -> dict[str, Any]:
    """The compiled kernels (numba; raises ImportError without it)."""
    from . import _fastkernels as fk

    return {"read_items": fk.read_items, "undelta": fk.undelta, "fns": _cfuncs()}


def _self_check(k: dict[str, Any]) -> bool:
    """The kernels compute what numpy does on a probe (every float16 bit pattern but NaNs)."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(-1, 64)
    h = bits.view(np.float16)
    keep = ~np.isnan(h).any(axis=1)
    u = bits[keep]
    d = u.copy()
    d[:, 1:] = u[:, 1:] - u[:, :-1]
    out = np.empty(u.shape, np.float32)
    k["undelta"](d.copy(), out, True)
    if not np.array_equal(
        out.view(np.uint32), u.view(np.float16).astype(np.float32).view(np.uint32)
    ):
        return False
    d2 = d.copy()
    k["undelta"](d2, out, False)
    w = (u.astype(np.uint32) * 65599).reshape(-1, 32)
    d3 = w.copy()
    d3[:, 1:] = w[:, 1:] - w[:, :-1]
    k["undelta"](d3, out, False)
    return bool(np.array_equal(d2, u) and np.array_equal(d3, w))


def _probe_read(k: dict[str, Any]) -> bool:
    """``read_items`` (compiled here for the usual four arrays) reads a small shard file it
    writes: whole and partial chunks, every CRC32C, the values of numcodecs' decompression."""
    import tempfile

    import google_crc32c
    import numcodecs.blosc

    data = np.arange(8 * 3, dtype=np.int32).reshape(8, 3) * 7919
    frames = []
    for c in range(2):  # two chunks of 4 rows
        body = numcodecs.blosc.compress(data[4 * c : 4 * c + 4].copy(), b"lz4", 5, 1)
        frames.append(body + google_crc32c.value(body).to_bytes(4, "little"))
    index = np.array([[0, len(frames[0])], [len(frames[0]), len(frames[1])]], np.uint64)
    with tempfile.TemporaryFile() as f:
        f.write(b"".join(frames))
        f.flush()
        fd = np.array([f.fileno()], np.int64)
        n = 4
        meta = np.array([[2, 4, 12, 8, 128 * a, 0] for a in range(n)], np.int64)
        items = np.array([[a, 1, 7, 0] for a in range(n)], np.int64)
        arena = np.zeros(128 * n, np.uint8)
        status = np.zeros(2 + 2 * MAX_MISSING, np.int64)
        k["read_items"](
            k["fns"],
            (fd,) * n,
            (index.reshape(1, -1),) * n,
            meta,
            items,
            arena,
            np.array([-1, 0, 0], np.int64),
            np.zeros((0, 1), np.float32),
            np.empty(48, np.uint8),
            np.empty(1024, np.uint8),
            status,
        )
    got = [arena[128 * a : 128 * a + 72].view(np.int32).reshape(6, 3) for a in range(n)]
    return status[0] == OK and all(np.array_equal(g, data[1:7]) for g in got)


def ready() -> bool:
    """Compile the kernels (once per process) and check them; ``False`` (and
    :data:`AVAILABLE` off) if that fails."""
    global _kernels, AVAILABLE
    if _kernels is not None:
        return AVAILABLE
    if not AVAILABLE:
        return False
    with _lock:
        if _kernels is None:
            try:
                k = _compile()
                ok = _self_check(k) and _probe_read(k)
            except Exception:  # no numba, no F16C lowering, ...: the per-chunk path
                k, ok = {}, False
            if not ok:
                AVAILABLE = False
            _kernels = k
    return AVAILABLE


def _disable() -> None:
    global AVAILABLE
    AVAILABLE = False


_local = threading.local()


def _buffer(attr: str, size: int) -> np.ndarray:
    """This thread's uint8 buffer ``attr`` of at least ``size`` bytes (grown by doubling)."""
    buf = getattr(_local, attr, None)
    if buf is None or buf.size < size:
        buf = np.empty(max(size, 2 * (0 if buf is None else buf.size), 1 << 16), np.uint8)
        setattr(_local, attr, buf)
    return buf


class _Tables:
    """A layout's shards as the kernel sees them: ``fd[s]`` (``-1``: not ready) and the parsed
    index of shard ``s`` (``index[s]``: ``(offset, nbytes)`` pairs), for shards kept open in
    ``lay.fds`` (see :func:`_open`)."""

    def __init__(self, lay: DirectLayout):
        n = -(-lay.length // lay.shard_rows)
        self.fd = np.full(max(n, 1), -1, np.int64)
        self.index = np.empty((max(n, 1), 2 * lay.chunks_per_shard), np.uint64)
        self.meta = (lay.chunks_per_shard, lay.chunk_rows, lay.row_items * lay.dtype.itemsize)
        self.lock = threading.Lock()


def _tables(lay: DirectLayout) -> _Tables:
    t = lay.fast.get("tables")
    if t is None:
        t = lay.fast.setdefault("tables", _Tables(lay))
    return t


ALIGN = 64
"""Byte alignment of each array's block in a call's arena."""

MAX_MISSING = 64
"""Shards the kernel reports as not ready per round."""

PARALLEL_MIN_BYTES = 512 * 1024
"""The least work (bytes decoded) one thread is given: a call with less than twice this runs in
the calling thread alone (a thread hand-off costs tens of microseconds)."""


def _pieces(items: list[tuple[int, int, int, int]], meta: np.ndarray, n: int) -> list[np.ndarray]:
    """``items`` in at most ``n`` groups (:func:`._plan.split`, at least
    :data:`PARALLEL_MIN_BYTES` each), as the kernel takes them."""
    cr, rb = meta[:, 1].tolist(), meta[:, 2].tolist()
    groups = split(items, cr, rb, n, PARALLEL_MIN_BYTES)
    return [np.array(x, np.int64).reshape(-1, 4) for x in groups]


class _Plan:
    """What every call over one set of layouts reuses: their tables as the kernel takes them, the
    ``meta`` rows, the scratch size and the ``lp`` arguments."""

    def __init__(self, lays: list[DirectLayout]):
        self.tabs = [_tables(lay) for lay in lays]
        self.meta = np.array(
            [
                (*t.meta, lay.shard_rows, 0, int(lay.raw))
                for t, lay in zip(self.tabs, lays, strict=True)
            ],
            np.int64,
        )
        self.row_bytes = [int(x) for x in self.meta[:, 2]]
        self.fd_tabs = tuple(t.fd for t in self.tabs)
        self.idx_tabs = tuple(t.index for t in self.tabs)
        self.scratch = int((self.meta[:, 1] * self.meta[:, 2]).max())
        self.inner = [lay.inner for lay in lays]
        self.dtypes = [lay.dtype for lay in lays]
        self.lp: dict[tuple[int, bool], np.ndarray] = {}

    def lp_arg(self, a: int, widen: bool) -> np.ndarray:
        got = self.lp.get((a, widen))
        if got is None:
            size = self.dtypes[a].itemsize if a >= 0 else 0
            got = self.lp[(a, widen)] = np.array([a, int(widen), size], np.int64)
        return got


def _plan(lays: list[DirectLayout]) -> _Plan:
    key = tuple(map(id, lays))
    got = lays[0].fast.get(key)
    if got is None:
        got = lays[0].fast.setdefault(key, _Plan(lays))
    return got


def read_arrays(
    lays: list[DirectLayout],
    root: str,
    bounds: list[list[tuple[int, int]]],
    lp: tuple[int, bool] = (-1, False),
    pool: ThreadPoolExecutor | None = None,
    threads: int = 1,
) -> tuple[list[np.ndarray], np.ndarray | None] | None:
    """For each array ``a`` (``lays[a]``), rows ``[start, stop)`` of every job in ``bounds[a]``, one
    after the other in one block (stored dtype; the blocks share one allocation); or ``None``: read
    these with the NumPy decoder instead. Rows must lie below each layout's ``length`` (the caller
    checks R6). ``lp = (a, widen)``: array ``a`` holds row-delta logprob bits, decoded in place, or
    if ``widen`` (float16 bits) into the float32 array returned beside the blocks.

    With ``pool`` and ``threads > 1`` the work is split at chunk edges (:func:`._plan.split`), the
    calling thread taking one group. Shards the kernel needs that are not open yet are opened here
    and the call made again."""
    assert _kernels is not None
    plan = _plan(lays)
    a_lp, widen = lp
    items: list[tuple[int, int, int, int]] = []
    rows: list[int] = []
    offsets: list[int] = []
    at = 0
    for a, jobs in enumerate(bounds):
        out = 0
        for st, sp in jobs:
            if sp > st:
                items.append((a, st, sp, out))
            out += sp - st
        rows.append(out)
        offsets.append(at)
        if widen and a == a_lp:  # read_items sums these rows straight into lp_out
            continue
        at += (out * plan.row_bytes[a] + ALIGN - 1) // ALIGN * ALIGN
    meta = plan.meta.copy()
    meta[:, 4] = offsets
    arena = outbuf.empty(max(at, 1))  # no huge-page request for large calls (outbuf)
    lp_out = None
    if a_lp >= 0 and widen:  # a separate allocation (faster than a block of the arena)
        lp_out = outbuf.empty((rows[a_lp], *plan.inner[a_lp]), np.float32)
        rows[a_lp] = 0  # its block in the arena stays empty
    dummy = lp_out if lp_out is not None else _DUMMY
    run = partial(_run, lays, root, plan, meta, arena, plan.lp_arg(a_lp, widen), dummy)
    if pool is not None and threads > 1:
        groups = _pieces(items, meta, threads)
    else:
        groups = [np.array(items, np.int64).reshape(-1, 4)]
    if not all(run_groups(run, groups, pool)):
        return None
    out_blocks = [
        np.ndarray((rows[a], *plan.inner[a]), plan.dtypes[a], arena, o)
        for a, o in enumerate(offsets)
    ]
    return out_blocks, lp_out


_DUMMY = np.empty((0, 1), np.float32)


def _run(
    lays: list[DirectLayout],
    root: str,
    plan: _Plan,
    meta: np.ndarray,
    arena: np.ndarray,
    lp: np.ndarray,
    lp_out: np.ndarray,
    items: np.ndarray,
) -> bool:
    """One compiled call over ``items`` (in this thread); ``False``: hand the call back."""
    fd_tabs, idx_tabs = plan.fd_tabs, plan.idx_tabs
    n_status = 2 + 2 * MAX_MISSING
    status = _buffer("status", 8 * n_status).view(np.int64)[:n_status]
    scratch = _buffer("scratch", plan.scratch)
    kernel, fns = _kernels["read_items"], _kernels["fns"]  # type: ignore[index]
    close: list[int] = []
    try:
        buf = _buffer("buf", 1 << 20)
        for _ in range(64):
            try:
                kernel(fns, fd_tabs, idx_tabs, meta, items, arena, lp, lp_out, scratch, buf, status)
            except Exception:  # a specialisation that does not compile here: per-chunk path
                _disable()
                return False
            if status[0] == NEED_BUFFER:
                buf = _buffer("buf", int(status[1]))
            elif status[0] == NEED_SHARDS:
                pairs = status[2 : 2 + 2 * int(status[1])].reshape(-1, 2).tolist()
                fd_tabs, idx_tabs = _open(lays, root, plan.tabs, fd_tabs, idx_tabs, pairs, close)
                if not fd_tabs:
                    return False
            else:
                break
    finally:
        for fd in close:
            os.close(fd)
    return bool(status[0] == OK)


def _open(
    lays: list[DirectLayout],
    root: str,
    tabs: list[_Tables],
    fd_tabs: tuple[np.ndarray, ...],
    idx_tabs: tuple[np.ndarray, ...],
    pairs: list[list[int]],
    close: list[int],
) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """Open the shards ``pairs`` (``[array, shard]``) into the tables; returns the tables for the
    next round (private copies for a descriptor not kept, closed after the call; ``((), ())`` if
    a shard is missing: the NumPy decoder decides, fill value or R9). A kept descriptor's index
    stays valid for the layout's life: a writer replaces a shard file whole (rename), so the
    descriptor keeps the version it opened."""
    fds, idxs = list(fd_tabs), list(idx_tabs)
    for a, s in pairs:
        lay, tab = lays[a], tabs[a]
        with tab.lock:
            if fds[a] is tab.fd and tab.fd[s] >= 0:
                continue  # another thread opened it meanwhile
            got = shardread.open_shard(lay, root, s)
            if got is None:
                return (), ()
            fd, owned = got
            index = shardread.local_index(lay, fd, s).reshape(-1)
            if owned:  # this call only: private tables, the descriptor closed after it
                close.append(fd)
                if fds[a] is tab.fd:
                    fds[a], idxs[a] = tab.fd.copy(), tab.index.copy()
                fds[a][s], idxs[a][s] = fd, index
            else:
                tab.index[s] = index
                tab.fd[s] = fd
                if fds[a] is not tab.fd:
                    fds[a][s], idxs[a][s] = fd, index
    return tuple(fds), tuple(idxs)
