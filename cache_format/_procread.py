"""Reader processes for point reads: ``CacheReader(read_processes=n)`` (FORMAT.md D4).

In one process, a point read is bound by the GIL: about half of its CPU is Python around each
chunk (numcodecs' wrappers, ``google_crc32c``, which holds the GIL, the reader's bookkeeping), so
decode threads stop scaling near 2x (benchmarks/results/format.md, random access). This module
spreads the rows of one :meth:`CacheReader.sequence` / :meth:`CacheReader.sequences` call over
the calling process and ``n`` reader processes (``read_processes=n``), each with its own
:class:`CacheReader` (its own GIL), which decode straight into one shared-memory segment
(``memfd``) that the calling process maps; the returned
arrays are views of that segment (it is freed when the last of them is).

How a call is cut: the requested sequences, in call order, are cut into ``n + 1`` runs (at most
one per ``topk_ids`` row chunk they touch) of about equal numbers of row chunks touched (what
decoding costs: a short sequence decodes whole chunks too), only at chunk edges inside a
sequence, so no process decodes a row chunk another one decodes too; a sequence's tokens go with
its first rows. The calling process decodes the first run itself while the workers decode the
others (one run each); a call that makes one run is read in the calling process alone (no
hand-off). The values are those of the in-process path, bit for bit (each process runs the same
point read, with every CRC32C checked); a worker's error (a :class:`~.errors.ChecksumError`
after its retries, say) is raised in the caller as is.

Cost (stated in benchmarks/results/format.md): start-up of ``n`` Python processes (each
imports the package and opens the store: about a second, in parallel, at the first point read),
each process's memory (the interpreter, numpy, zarr, torch when installed), and per call one
message and one descriptor passed to each worker used.
"""

from __future__ import annotations

import bisect
import mmap
import os
import socket
import subprocess
import sys
import threading
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any, Protocol

import numpy as np

ALIGN = 64
"""Byte alignment of each region of a segment."""

Piece = tuple[int, int, int, int, int, int]
"""``(row a, row b, token a, token b, region row, region token)``: rows ``[a, b)`` (and tokens
``[ta, tb)``, empty if ``ta == tb``) decode into the segment's row regions from row ``region
row`` (and its token region from ``region token``)."""


WORKER = __name__.rpartition(".")[0] + "._procworker"
"""The module a reader process runs (``_main(fd)``: a :class:`CacheReader` serving
:func:`serve` calls)."""


class ReadProcessError(RuntimeError):
    """A reader process died or could not start (the store's own errors are raised as is)."""


class SpanReader(Protocol):
    """What :func:`serve` needs of a reader (:class:`~._reader.CacheReader`)."""

    @property
    def num_rows(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    def refresh(self) -> bool: ...

    def read_spans(
        self,
        spans: list[tuple[slice, slice | None]],
        logprob_dtype: str = "float32",
        into: list[dict[str, np.ndarray]] | None = None,
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]]: ...


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def cut(spans: list[tuple[int, int, int, int]], n: int, chunk_rows: int) -> list[list[Piece]]:
    """The pieces of each of at most ``n`` processes for ``spans`` (``(row a, row b, token a,
    token b)`` per requested sequence, in call order; see the module docstring).

    Balanced by the row chunks each sequence touches (what decoding costs: a sequence of 10
    rows decodes whole chunks too), cut only at chunk edges inside a sequence."""
    cr = max(1, chunk_rows)
    units = [0]  # chunk units: sequence j touches units [units[j], units[j + 1])
    rows = [0]  # its rows go to region rows [rows[j], rows[j + 1])
    toks = [0]
    for a, b, ta, tb in spans:
        units.append(units[-1] + (b - 1) // cr - a // cr + 1)
        rows.append(rows[-1] + (b - a))
        toks.append(toks[-1] + (tb - ta))
    total = units[-1]
    n = max(1, min(n, total))
    edges = sorted({0, total, *(round(total * w / n) for w in range(1, n))})

    def row_at(j: int, u: int) -> int:
        """The row where unit ``u`` (within ``[units[j], units[j + 1]]``) starts in span j."""
        a, b = spans[j][0], spans[j][1]
        if u == units[j + 1]:
            return b
        return a if u == units[j] else (a // cr + u - units[j]) * cr

    out: list[list[Piece]] = []
    for u, v in zip(edges[:-1], edges[1:], strict=True):
        pieces: list[Piece] = []
        j = bisect.bisect_right(units, u) - 1
        while j < len(spans) and units[j] < v:
            x, y = max(u, units[j]), min(v, units[j + 1])
            r0, r1 = row_at(j, x), row_at(j, y)
            first = x == units[j]
            _, _, ta, tb = spans[j]
            ro = rows[j] + r0 - spans[j][0]
            pieces.append((r0, r1, ta if first else 0, tb if first else 0, ro, toks[j]))
            j += 1
        if pieces:
            out.append(pieces)
    return out


class Regions:
    """Where each output array of a call lies in its segment: ``rows`` rows of ``k`` ids
    (int32), logprobs (``lp_dtype``), tail (float32) and optionally loss mask (uint8), and
    ``tokens`` tokens (int32)."""

    def __init__(self, rows: int, tokens: int, k: int, lp_dtype: str, mask: bool):
        self.rows, self.tokens, self.k, self.lp_dtype, self.mask = rows, tokens, k, lp_dtype, mask
        lpi = np.dtype(lp_dtype).itemsize
        self.ids = 0
        self.lp = _align(rows * k * 4)
        self.tail = self.lp + _align(rows * k * lpi)
        self.maskoff = self.tail + _align(rows * 4)
        self.tok = self.maskoff + (_align(rows) if mask else 0)
        self.size = max(1, self.tok + tokens * 4)

    def args(self) -> tuple[int, int, int, str, bool]:
        return self.rows, self.tokens, self.k, self.lp_dtype, self.mask

    def views(
        self, buf: Any
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
        """``(ids [R, k], lp [R, k], tail [R], mask [R] or None, tokens [T])`` over ``buf``."""
        r, k = self.rows, self.k
        ids = np.frombuffer(buf, np.int32, r * k, self.ids).reshape(r, k)
        lp = np.frombuffer(buf, self.lp_dtype, r * k, self.lp).reshape(r, k)
        tail = np.frombuffer(buf, np.float32, r, self.tail)
        mask = np.frombuffer(buf, np.uint8, r, self.maskoff) if self.mask else None
        tok = np.frombuffer(buf, np.int32, self.tokens, self.tok)
        return ids, lp, tail, mask, tok


def serve(
    reader: SpanReader,
    mm: mmap.mmap,
    reg: Regions,
    need_rows: int,
    need_tokens: int,
    logprob_dtype: str,
    pieces: list[Piece],
) -> None:
    """Point-read ``pieces`` with ``reader`` into the segment ``mm``."""
    if reader.num_rows < need_rows or reader.num_tokens < need_tokens:
        reader.refresh()  # the caller's snapshot is newer: every row it asks for is committed
    spans = [(slice(a, b), slice(ta, tb) if tb > ta else None) for a, b, ta, tb, _, _ in pieces]
    ids, lp, tail, mask, tok = reg.views(mm)
    into: list[dict[str, np.ndarray]] = []
    for a, b, ta, tb, ro, to in pieces:
        n = b - a
        d = {"ids": ids[ro : ro + n], "lp": lp[ro : ro + n], "tail": tail[ro : ro + n]}
        if mask is not None:
            d["mask"] = mask[ro : ro + n]
        if tb > ta:
            d["tokens"] = tok[to : to + tb - ta]
        into.append(d)
    got = reader.read_spans(spans, logprob_dtype, into)
    for d, (i, p, t, k, m) in zip(into, got, strict=True):  # what did not decode in place
        for key, x in (("ids", i), ("lp", p), ("tail", t), ("mask", m), ("tokens", k)):
            y = d.get(key)
            if y is not None and x is not None and not np.shares_memory(x, y):
                y[...] = x


MAX_FREE = 4
"""Free segments kept for reuse (a reused segment's pages are already mapped in every process: a
fresh one costs a page fault per 4 KiB in the workers and the caller, more than the decoding)."""

SEGMENT_MIN = 1 << 20
"""Smallest segment (bytes); sizes are powers of two, so segments are reused across calls."""


def _shared_fd() -> int:
    """A descriptor of new, empty shared memory: a ``memfd``, else an unlinked file in
    ``/dev/shm`` (or the temporary directory)."""
    try:
        return os.memfd_create("logitcache-read", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        import tempfile

        where = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.TemporaryFile(dir=where) as f:
            return os.dup(f.fileno())


class _Segment:
    """One shared-memory segment: a ``memfd`` of ``size`` bytes, mapped here as ``mm``."""

    def __init__(self, seg_id: int, size: int):
        self.id, self.size = seg_id, size
        self.fd = _shared_fd()
        try:
            os.ftruncate(self.fd, size)
            self.mm = mmap.mmap(self.fd, size)
            self.refs = sys.getrefcount(self.mm)  # no array of it yet: free at this count
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        """Close the descriptor and the mapping (once no array uses it)."""
        os.close(self.fd)
        try:
            self.mm.close()
        except BufferError:  # still exported: freed with its last array
            pass


class ReadProcesses:
    """``n`` reader processes of one store (see the module docstring); :meth:`read` is called by
    one thread at a time (a lock serialises callers).

    The processes are started with ``subprocess`` (``python -c``, this package imported by
    name, ``sys.path`` passed on), not ``multiprocessing``: spawn would re-run the caller's main
    module, and fork is unsafe in a process that may hold threads (torch, zarr's event loop)."""

    def __init__(self, url: str, storage_options: dict | None, n: int, decoder: str | None = None):
        if n < 1:
            raise ValueError(f"read_processes must be >= 1, got {n}")
        self.n = n
        self.pid = os.getpid()  # a forked child must not use (or stop) its parent's processes
        self.lock = threading.Lock()
        self.conns: list[Connection] = []
        self.procs: list[subprocess.Popen] = []
        self.mapped: list[set[int]] = []  # segment ids each worker has mapped
        self.segments: list[_Segment] = []
        self.dropped: list[int] = []  # segment ids some worker still maps
        self.next_id = 0
        env = dict(os.environ)
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        code = "import importlib, sys; importlib.import_module(sys.argv[1])._main(int(sys.argv[2]))"
        try:
            for _ in range(n):
                parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    fd = child.fileno()
                    p = subprocess.Popen(
                        [sys.executable, "-c", code, WORKER, str(fd)],
                        pass_fds=(fd,),
                        env=env,
                        stdin=subprocess.DEVNULL,
                    )
                finally:
                    child.close()
                self.procs.append(p)
                conn = Connection(parent.detach())
                self.conns.append(conn)
                self.mapped.append(set())
                conn.send((url, storage_options, decoder))
            for c in self.conns:
                kind, what = self._recv(c)
                if kind != "ready":
                    raise what
        except BaseException:
            self.close()
            raise

    def _recv(self, conn: Connection) -> Any:
        try:
            return conn.recv()
        except (EOFError, OSError) as e:
            self.close()
            raise ReadProcessError(f"a reader process died: {e!r}") from e

    def _segment(self, size: int) -> _Segment:
        """A free segment of at least ``size`` bytes (one no returned array uses any more: the
        caller holds the only references), else a new one; at most :data:`MAX_FREE` free
        segments are kept."""
        free = [g for g in self.segments if sys.getrefcount(g.mm) <= g.refs]
        fits = [g for g in free if size <= g.size]
        if fits:
            return min(fits, key=lambda g: g.size)
        for g in sorted(free, key=lambda g: g.size)[: max(0, len(free) + 1 - MAX_FREE)]:
            self.segments.remove(g)
            self.dropped.append(g.id)
            g.close()
        self.next_id += 1
        g = _Segment(self.next_id, max(SEGMENT_MIN, 1 << (size - 1).bit_length()))
        self.segments.append(g)
        return g

    def read(
        self,
        spans: list[tuple[int, int, int, int]],
        k: int,
        stored_rows: int,
        stored_tokens: int,
        lp_dtype: str,
        mask: bool,
        groups: list[list[Piece]],
        local: Any = None,
    ) -> tuple[Any, Regions]:
        """Decode ``groups`` (from :func:`cut`) into a segment no earlier result uses: with
        ``local`` (a reader of the same store), the calling process decodes ``groups[0]`` while
        the workers decode the others (one each); without, the workers decode them all.
        Returns the segment (an ``mmap``) and its :class:`Regions`."""
        rows = sum(b - a for a, b, _, _ in spans)
        tokens = sum(tb - ta for _, _, ta, tb in spans)
        reg = Regions(rows, tokens, k, lp_dtype, mask)
        mine = groups[0] if local is not None else None
        theirs = groups[1:] if local is not None else groups
        if len(theirs) > len(self.conns):
            raise ValueError(f"{len(theirs)} groups for {len(self.conns)} reader processes")
        with self.lock:
            if not self.conns:
                raise ReadProcessError("reader processes are closed")
            seg = self._segment(reg.size)
            used = list(range(len(theirs)))
            for w in used:
                conn, new = self.conns[w], seg.id not in self.mapped[w]
                drop = [d for d in self.dropped if d in self.mapped[w]]
                self.mapped[w].difference_update(drop)
                msg = (seg.id, seg.size, new, drop, stored_rows, stored_tokens, reg.args())
                conn.send((*msg, lp_dtype, theirs[w]))
                if new:
                    reduction.send_handle(conn, seg.fd, 0)
                    self.mapped[w].add(seg.id)
            self.dropped = [d for d in self.dropped if any(d in m for m in self.mapped)]
            err: BaseException | None = None
            if mine:
                try:  # the calling process's share, while the workers decode theirs
                    serve(local, seg.mm, reg, 0, 0, lp_dtype, mine)
                except BaseException as e:
                    err = e
            for w in used:
                got = self._recv(self.conns[w])
                err = err or got
        if err is not None:
            raise err
        return seg.mm, reg

    def close(self) -> None:
        """Stop the processes (idempotent)."""
        conns, self.conns = self.conns, []
        for c in conns:
            try:
                c.send(None)
                c.close()
            except Exception:
                pass
        segments, self.segments = self.segments, []
        for g in segments:
            g.close()
        for p in self.procs:
            try:
                p.wait(timeout=2)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=2)
        self.procs = []

    def __del__(self) -> None:
        if self.__dict__.get("pid") != os.getpid():
            return  # a forked copy: the processes are the parent's
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass
