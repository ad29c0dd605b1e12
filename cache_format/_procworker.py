"""The program of a reader process (:class:`._procread.ReadProcesses` starts it as
``python -c ... _main(fd)``): a :class:`~._reader.CacheReader` of the store, serving the point
reads it is sent into the shared-memory segments it is handed."""

from __future__ import annotations

import mmap
import os
from multiprocessing import reduction
from multiprocessing.connection import Connection

from ._procread import ReadProcessError, Regions, serve
from ._reader import CacheReader


def _main(fd: int) -> None:
    """Entry point of a reader process (:class:`ReadProcesses`): ``fd`` is its socket."""
    conn = Connection(fd)
    try:
        url, storage_options, decoder = conn.recv()
    except (EOFError, OSError):
        return
    _worker(conn, url, storage_options, decoder)


def _worker(conn: Connection, url: str, storage_options: dict | None, decoder: str) -> None:
    """A reader process: serve point reads into the segments it is sent until told to stop
    (segments stay mapped until the caller drops them: a reused segment costs no page faults)."""
    try:
        reader = CacheReader(url, storage_options, decoder=decoder)
    except BaseException as e:  # the caller raises it
        conn.send(("error", e))
        return
    conn.send(("ready", os.getpid()))
    maps: dict[int, mmap.mmap] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        seg, size, new, drop, need_rows, need_tokens, args, logprob_dtype, pieces = msg
        for d in drop:
            old = maps.pop(d, None)
            if old is not None:
                old.close()
        try:
            if new:
                fd = reduction.recv_handle(conn)
                try:
                    maps[seg] = mmap.mmap(fd, size)
                finally:
                    os.close(fd)
            reg = Regions(*args)
            serve(reader, maps[seg], reg, need_rows, need_tokens, logprob_dtype, pieces)
            conn.send(None)
        except BaseException as e:
            try:
                conn.send(e)
            except Exception:  # unpicklable error
                conn.send(ReadProcessError(repr(e)))
