"""Group commit of on-demand appends: the scored misses of concurrent requests into one cache
share one writer append (one commit).

An append costs ~20 ms of CPU whatever its size, so :class:`GroupCommitter` keeps one queue per
cache: a request takes a :class:`Ticket` before its lookup, its scored misses join the queue, and
a group goes once every ticket holder has queued (or left), after ``window_s``, or at
``max_rows``, as one :meth:`~.caches.WriterHandle.append_parts` in the committer's own threads.
A lone request is committed at once; a busy cache commits concurrent requests' misses together.
Records of one group share the first one's manifest.

:meth:`GroupCommitter.append` returns once the commit holding the records has returned (how many
it newly stored; its error for every request of a failed group). ``append_behind`` returns at
once (answers that claim nothing stored); until the commit returns ``pending`` finds the
records, and a failed commit is logged only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from logitcache.cache_format import Manifest, SequenceRecord

from ..errors import UnavailableError
from .caches import CacheRegistry

log = logging.getLogger(__name__)

#: Rows one group commit holds at most (a request over it is committed alone).
MAX_GROUP_ROWS = 1 << 16
#: Threads committing groups (each cache's groups are committed one at a time).
COMMIT_THREADS = 4


def _rows(records: Sequence[SequenceRecord]) -> int:
    return sum(len(r.input_ids) - 1 for r in records)


@dataclass
class _Item:
    records: list[SequenceRecord]
    manifest: Manifest
    done: asyncio.Future[int]
    rows: int
    ticket: Ticket
    answered: list[SequenceRecord] = field(default_factory=list)  # in the queue's ``pending``


@dataclass
class _Queue:
    items: deque[_Item] = field(default_factory=deque)
    rows: int = 0
    announced: int = 0  # tickets not yet left: requests that may still queue records
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    pending: dict[str, SequenceRecord] = field(default_factory=dict)  # answered, not committed

    def settle(self, item: _Item) -> None:
        """``item`` left the queue: its answered records are no longer pending."""
        item.ticket.leave()
        for rec in item.answered:
            key = rec.key
            if key is not None and self.pending.get(key) is rec:
                del self.pending[key]

    def settled(self, max_rows: int) -> bool:
        """Whether the group can go without waiting: full, or every announced request has
        queued its records."""
        return self.rows >= max_rows or self.announced <= len(self.items)


class Ticket:
    """One request's place in a cache's queue, from before its lookup until its records are
    queued or it leaves: a group waits (up to the window) for the ticket holders."""

    def __init__(self, committer: GroupCommitter, name: str, q: _Queue) -> None:
        self._committer, self.name, self._q = committer, name, q
        self._open = True
        q.announced += 1

    def leave(self) -> None:
        """No more records will come from this request (idempotent)."""
        if self._open:
            self._open = False
            self._q.announced -= 1
            self._q.changed.set()
            self._committer._forget_if_idle(self.name, self._q)


def _retrieve(fut: asyncio.Future[int]) -> None:
    """Mark a finished future's error as seen (its request may be gone)."""
    if not fut.cancelled():
        fut.exception()


class GroupCommitter:
    """One group-commit queue per cache (see the module doc); used from one event loop."""

    def __init__(
        self, caches: CacheRegistry, *, window_s: float, max_rows: int = MAX_GROUP_ROWS
    ) -> None:
        self.caches = caches
        self.window_s = window_s
        self.max_rows = max_rows
        self._queues: dict[str, _Queue] = {}
        self._closed = False
        self._pool = ThreadPoolExecutor(COMMIT_THREADS, thread_name_prefix="logitcache-commit")

    @contextlib.contextmanager
    def ticket(self, name: str) -> Iterator[Ticket]:
        """A :class:`Ticket` for cache ``name``, left when the block ends at the latest."""
        q = self._queues.get(name)
        if q is None:
            q = self._queues[name] = _Queue()
        t = Ticket(self, name, q)
        try:
            yield t
        finally:
            t.leave()

    async def append(
        self, ticket: Ticket, manifest: Manifest, records: Sequence[SequenceRecord]
    ) -> int:
        """Commit ``records`` (checked, at ``manifest``) into the ticket's cache with whatever
        else is queued for it; returns how many of them were newly stored, once committed."""
        if not records:
            ticket.leave()
            return 0
        if self._closed:
            raise UnavailableError("the server is stopping; the records were not stored")
        return await asyncio.shield(self._queue(ticket, manifest, records).done)

    def append_behind(
        self,
        ticket: Ticket,
        manifest: Manifest,
        records: Sequence[SequenceRecord],
        answered: Sequence[SequenceRecord],
    ) -> None:
        """Queue ``records`` for the next group commit and return at once; ``answered`` (the
        records as answered) are :meth:`pending` until it returns. Nothing is queued while the
        server stops."""
        if not records or self._closed:
            ticket.leave()
            return
        item = self._queue(ticket, manifest, records)
        item.answered = [rec for rec in answered if rec.key is not None]
        for rec in item.answered:
            ticket._q.pending[str(rec.key)] = rec

    def pending(self, name: str, key: str) -> SequenceRecord | None:
        """The record of ``key`` answered into cache ``name`` and not yet committed, if any."""
        q = self._queues.get(name)
        return None if q is None else q.pending.get(key)

    def _queue(
        self, ticket: Ticket, manifest: Manifest, records: Sequence[SequenceRecord]
    ) -> _Item:
        loop = asyncio.get_running_loop()
        q = ticket._q
        item = _Item(list(records), manifest, loop.create_future(), _rows(records), ticket)
        item.done.add_done_callback(_retrieve)
        q.items.append(item)
        q.rows += item.rows
        q.changed.set()
        if q.task is None:
            q.task = loop.create_task(self._run(ticket.name, q), name=f"commit-{ticket.name}")
        return item

    async def _wait(self, q: _Queue) -> None:
        """Wait up to the window for the group to settle (:meth:`_Queue.settled`)."""
        deadline = asyncio.get_running_loop().time() + self.window_s
        while not q.settled(self.max_rows) and not self._closed:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return
            q.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(q.changed.wait(), left)

    async def _run(self, name: str, q: _Queue) -> None:
        """Commit ``q``'s groups until it is empty."""
        try:
            while q.items:
                await self._wait(q)
                group = self._take(q)
                try:
                    loop = asyncio.get_running_loop()
                    counts = await loop.run_in_executor(self._pool, self._commit, name, group)
                except Exception as e:  # noqa: BLE001 - every request of the group gets it
                    if any(item.answered for item in group):
                        log.warning("cache %r: answered records were not stored: %s", name, e)
                    for item in group:
                        q.settle(item)
                        if not item.done.done():
                            item.done.set_exception(e)
                except BaseException:  # cancelled: whether it committed is unknown
                    for item in group:
                        q.settle(item)
                        item.done.cancel()
                    raise
                else:
                    for item, n in zip(group, counts, strict=True):
                        q.settle(item)
                        if not item.done.done():
                            item.done.set_result(n)
        finally:
            q.task = None
            for item in q.items:  # only when cancelled: never committed
                q.settle(item)
                if not item.done.done():
                    item.done.set_exception(UnavailableError("the records were not stored"))
            q.items.clear()
            self._forget_if_idle(name, q)

    def _forget_if_idle(self, name: str, q: _Queue) -> None:
        if q.task is None and not q.items and q.announced == 0 and self._queues.get(name) is q:
            del self._queues[name]

    def _take(self, q: _Queue) -> list[_Item]:
        """The next group: queued items with the first one's manifest, up to ``max_rows`` rows."""
        first = q.items[0].manifest.identity()
        group: list[_Item] = []
        rest: deque[_Item] = deque()
        rows = 0
        while q.items:
            item = q.items.popleft()
            fits = not group or rows + item.rows <= self.max_rows
            if fits and item.manifest.identity() == first:
                group.append(item)
                rows += item.rows
            else:
                rest.append(item)
        q.items = rest
        q.rows -= rows
        return group

    def _commit(self, name: str, group: list[_Item]) -> list[int]:
        """One append of the group's records (worker thread); new records per item."""
        with self.caches.writer(name, group[0].manifest) as w:
            return w.append_parts([item.records for item in group])

    async def aclose(self) -> None:
        """Refuse new appends, commit the queued ones and wait for every queue's task."""
        self._closed = True
        for q in self._queues.values():
            q.changed.set()
        tasks = [q.task for q in self._queues.values() if q.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._pool.shutdown(wait=False)
