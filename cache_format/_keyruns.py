"""The on-disk key index (FORMAT.md 4.11, which fixes the run object's bytes): sorted runs of
``(hash, sequence)`` pairs.

Every commit writes one run of the keys it adds, merged with the newest runs while the newest is
no larger than what is merged into it (a binary counter: ``O(log S)`` runs). A lookup reads a
run's fence and footer (one suffix request, cached per run) and the blocks that can hold the
hash. A process keeps the hash column of the runs it wrote or read whole (at most
:data:`KEEP_HASHES` entries), so a writer's many-key lookup reads only the blocks it needs."""

from __future__ import annotations

import json
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import google_crc32c
import numpy as np
from zarr.abc.store import RangeByteRequest, SuffixByteRequest

from . import fastencode
from ._zarr_adapter import sync
from .errors import ChecksumError, CorruptStoreError, FormatError, MissingDataError
from .store import get_object, put_objects

BLOCK = 4096  # entries per block (64 KiB): the unit of a lookup's read
KEEP_BLOCKS = 64  # checked run blocks a process keeps (4 MiB): runs never change once written
KEEP_HASHES = 1 << 22  # run entries whose hashes a process keeps (32 MiB)
ENTRY = np.dtype([("hash", "<i8"), ("seq", "<i8")])
MAGIC = b"LCKI"
_FOOT = struct.Struct(
    "<4sQQQQII"
)  # magic, first, count, generation, record bytes, fence crc, record crc
FOOTER_SIZE = _FOOT.size + 4  # + CRC32C of the footer's other bytes
PREFIX = "seq_keys/index/"  # under an array's prefix: zarr never lists or addresses it


def _crc(data: bytes | memoryview | np.ndarray) -> int:
    return int(google_crc32c.value(bytes(data)))


@dataclass(frozen=True)
class RunRef:
    """A run as the manifest lists it: entries of sequences ``[first, first + count)``,
    written by commit ``generation``; ``crc``: its fence's CRC32C (8 hex digits)."""

    first: int
    count: int
    generation: int
    crc: str

    @property
    def key(self) -> str:
        return f"{PREFIX}{self.first}-{self.first + self.count}-{self.generation}"

    @property
    def blocks(self) -> int:
        return -(-self.count // BLOCK)

    def to_attrs(self) -> dict[str, Any]:
        return {
            "first": self.first,
            "count": self.count,
            "generation": self.generation,
            "crc": self.crc,
        }

    @classmethod
    def parse(cls, doc: Any) -> RunRef:
        ok = isinstance(doc, dict) and set(doc) == {"first", "count", "generation", "crc"}
        if ok:
            ints = [doc[n] for n in ("first", "count", "generation")]
            ok = all(type(v) is int and v >= 0 for v in ints) and doc["count"] > 0
            ok = ok and isinstance(doc["crc"], str) and len(doc["crc"]) == 8
        if not ok:
            raise ValueError(
                f"key_index entry {doc!r} is not a run (first, count, generation, crc)"
            )
        return cls(doc["first"], doc["count"], doc["generation"], doc["crc"])


def parse_runs(docs: Any, num_sequences: int) -> list[RunRef]:
    """The manifest's ``key_index`` as runs; they must tile ``[0, num_sequences)`` in order."""
    if not isinstance(docs, list):
        raise ValueError("key_index must be a list of runs")
    runs, at = [RunRef.parse(d) for d in docs], 0
    for r in runs:
        if r.first != at:
            raise ValueError(f"key_index: run {r.key} does not start at sequence {at}")
        at += r.count
    if at != num_sequences:
        raise ValueError(f"key_index covers {at} sequences, the commit {num_sequences}")
    return runs


def encode_run(
    entries: np.ndarray, first: int, generation: int, record: Callable[[RunRef], bytes]
) -> tuple[RunRef, bytes]:
    """The object of a run of sorted ``entries`` (:data:`ENTRY`) of sequences from ``first``;
    ``record(ref)``: the commit record (the root attributes that list ``ref``, JSON bytes)."""
    count = len(entries)
    raw = np.ascontiguousarray(entries, ENTRY).tobytes()
    starts = range(0, count, BLOCK)
    heads = entries["hash"][::BLOCK].astype("<i8")
    crcs = np.array([_crc(raw[16 * a : 16 * min(a + BLOCK, count)]) for a in starts], "<u4")
    fence = heads.tobytes() + crcs.tobytes()
    ref = RunRef(first, count, generation, f"{_crc(fence):08x}")
    rec = record(ref)
    foot = _FOOT.pack(MAGIC, first, count, generation, len(rec), _crc(fence), _crc(rec))
    return ref, b"".join((raw, rec, fence, foot, _crc(foot).to_bytes(4, "little")))  # one copy


def hash_order(hashes: np.ndarray) -> np.ndarray:
    """The permutation that sorts ``hashes`` ascending, equal hashes in position order (a stable
    argsort; numpy's default sort, 5x faster, where no two hashes are equal)."""
    order = np.argsort(hashes)
    srt = hashes[order]
    if bool((srt[1:] == srt[:-1]).any()):
        return np.argsort(hashes, kind="stable")
    return order


def merge_plan(runs: Sequence[RunRef], added: int) -> int:
    """The index of the first of the newest ``runs`` a commit adding ``added`` entries merges into
    its run: while the newest unmerged run holds no more entries than the merge so far."""
    i, total = len(runs), added
    while i > 0 and runs[i - 1].count <= total:
        total += runs[i - 1].count
        i -= 1
    return i


def _get(store: Any, key: str, byte_range: Any = None) -> bytes:
    try:
        got = get_object(store, key, byte_range)
    except FileNotFoundError:
        got = None
    if got is None:
        raise MissingDataError(f"key index run {key} is missing")
    return got


def _tail(store: Any, ref: RunRef) -> tuple[bytes, tuple[Any, ...]]:
    """The run's fence and its footer's fields (the footer checked against its CRC32C and
    ``ref``'s place)."""
    return _parse_tail(_get(store, ref.key, SuffixByteRequest(12 * ref.blocks + FOOTER_SIZE)), ref)


def _parse_tail(tail: bytes, ref: RunRef) -> tuple[bytes, tuple[Any, ...]]:
    nb = ref.blocks
    if len(tail) != 12 * nb + FOOTER_SIZE:
        raise ChecksumError(f"key index run {ref.key} is truncated")
    fence, foot = tail[: 12 * nb], tail[12 * nb :]
    if _crc(foot[:-4]) != int.from_bytes(foot[-4:], "little"):
        raise ChecksumError(f"key index run {ref.key}: footer fails its CRC32C")
    fields = _FOOT.unpack(foot[:-4])
    if fields[0] != MAGIC or fields[1:4] != (ref.first, ref.count, ref.generation):
        raise CorruptStoreError(f"key index run {ref.key}: its footer names another run")
    return fence, fields


def ref_from_footer(store: Any, key: str, first: int, count: int, generation: int) -> RunRef:
    """The run at ``key`` (named for ``first``, ``count``, ``generation``) as its footer
    describes it, its fence checked against the footer's CRC32C (no manifest needed)."""
    ref = RunRef(first, count, generation, "")
    if key != ref.key or count <= 0:
        raise CorruptStoreError(f"{key} is not a key index run")
    fence, fields = _tail(store, ref)
    if fields[5] != _crc(fence):
        raise ChecksumError(f"key index run {key}: fence fails its CRC32C")
    return RunRef(first, count, generation, f"{fields[5]:08x}")


def read_fence(store: Any, ref: RunRef) -> tuple[np.ndarray, np.ndarray, int, int]:
    """The run's block heads and block CRC32Cs (checked against the manifest's CRC32C), its
    commit record's length and CRC32C."""
    return _fence_of(*_tail(store, ref), ref)


def _fence_of(
    fence: bytes, fields: tuple[Any, ...], ref: RunRef
) -> tuple[np.ndarray, np.ndarray, int, int]:
    nb = ref.blocks
    rec_len, fcrc, rcrc = fields[4:]
    if f"{_crc(fence):08x}" != ref.crc or fcrc != _crc(fence):
        raise ChecksumError(f"key index run {ref.key}: fence fails the manifest's CRC32C")
    heads = np.frombuffer(fence[: 8 * nb], "<i8")
    crcs = np.frombuffer(fence[8 * nb :], "<u4")
    return heads, crcs, rec_len, rcrc


def _blocks(store: Any, ref: RunRef, crcs: np.ndarray, a: int, b: int) -> np.ndarray:
    """Entries of blocks ``[a, b)`` of the run, each block checked against its CRC32C."""
    lo, hi = 16 * a * BLOCK, 16 * min(b * BLOCK, ref.count)
    raw = _get(store, ref.key, RangeByteRequest(lo, hi))
    if len(raw) != hi - lo:
        raise ChecksumError(f"key index run {ref.key} is truncated")
    for j in range(a, b):
        s, e = 16 * (j * BLOCK) - lo, 16 * min((j + 1) * BLOCK, ref.count) - lo
        if _crc(raw[s:e]) != int(crcs[j]):
            raise ChecksumError(f"key index run {ref.key}: block {j} fails its CRC32C")
    return np.frombuffer(raw, ENTRY)


def read_run(store: Any, ref: RunRef) -> np.ndarray:
    """Every entry of the run (checked)."""
    crcs = read_fence(store, ref)[1]
    return _blocks(store, ref, crcs, 0, ref.blocks)


def read_record(store: Any, ref: RunRef) -> dict[str, Any]:
    """The commit record of the run: the root attributes of the commit that wrote it."""
    _, _, rec_len, rcrc = read_fence(store, ref)
    at = 16 * ref.count
    rec = _get(store, ref.key, RangeByteRequest(at, at + rec_len))
    if len(rec) != rec_len or _crc(rec) != rcrc:
        raise ChecksumError(f"key index run {ref.key}: commit record fails its CRC32C")
    doc = json.loads(rec)
    if not isinstance(doc, dict):
        raise CorruptStoreError(f"key index run {ref.key}: commit record is not an object")
    return doc


class KeyRuns:
    """The runs of a store's newest known commit, looked up without loading them (a bounded
    number of checked blocks and of runs' hash columns kept; thread-safe).
    ``reload()`` returns the runs of the store's latest commit: called once when a run object
    is gone (merged into a newer run by a later commit)."""

    def __init__(self, store: Any, runs: list[RunRef], reload: Callable[[], list[RunRef]]) -> None:
        self._store, self._runs, self._reload = store, runs, reload
        self._fences: dict[str, tuple[np.ndarray, np.ndarray, int, int]] = {}
        self._kept: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
        self._hashes: OrderedDict[RunRef, np.ndarray] = OrderedDict()  # each run's, in order
        self._held = 0  # entries in ``_hashes``
        self._lock = threading.Lock()

    @property
    def covered(self) -> int:
        """Sequences ``[0, covered)`` are indexed."""
        return sum(r.count for r in self._runs)

    def update(self, runs: list[RunRef]) -> None:
        with self._lock:
            self._runs = runs
            live = {r.key for r in runs}
            self._fences = {k: v for k, v in self._fences.items() if k in live}
            for k in [k for k in self._kept if k[0] not in live]:
                del self._kept[k]
            refs = set(runs)
            for r in [r for r in self._hashes if r not in refs]:
                self._held -= len(self._hashes.pop(r))

    def wrote(self, ref: RunRef, obj: bytes) -> None:
        """Keep what lookups and merges read of run ``ref``, just written as ``obj`` and committed
        (its fence, its hashes, its entries while small), so that nothing of it is read back."""
        tail = obj[len(obj) - 12 * ref.blocks - FOOTER_SIZE :]
        got = _fence_of(*_parse_tail(tail, ref), ref)
        ent = np.frombuffer(obj, ENTRY, ref.count)
        with self._lock:
            self._fences[ref.key] = got
        self._keep_hashes(ref, ent["hash"])
        if ref.blocks <= KEEP_BLOCKS // 4:
            self._keep(ref, {j: ent[j * BLOCK : (j + 1) * BLOCK].copy() for j in range(ref.blocks)})

    def _keep(self, ref: RunRef, blocks: dict[int, np.ndarray]) -> None:
        """Keep checked ``blocks`` (block index -> entries) of run ``ref``, the least recently
        used dropped past :data:`KEEP_BLOCKS`."""
        with self._lock:
            for j, got in blocks.items():
                self._kept[(ref.key, j)] = got
            while len(self._kept) > KEEP_BLOCKS:
                self._kept.popitem(last=False)

    def _keep_hashes(self, ref: RunRef, hashes: np.ndarray) -> None:
        """Keep the hashes of run ``ref`` (every entry's, checked), the least recently used
        runs' dropped past :data:`KEEP_HASHES` entries."""
        if ref.count > KEEP_HASHES:
            return
        got = np.array(hashes, np.int64)
        with self._lock:
            if ref not in self._runs or ref in self._hashes:
                return
            self._hashes[ref] = got
            self._held += len(got)
            while self._held > KEEP_HASHES:
                self._held -= len(self._hashes.popitem(last=False)[1])

    def _hashes_of(self, ref: RunRef) -> np.ndarray | None:
        with self._lock:
            got = self._hashes.get(ref)
            if got is not None:
                self._hashes.move_to_end(ref)
            return got

    def entries(self, ref: RunRef) -> np.ndarray:
        """Every entry of run ``ref`` (checked): a small run's blocks kept in memory (as
        :meth:`wrote` keeps them), a large one read whole."""
        if ref.blocks > KEEP_BLOCKS // 4:
            return read_run(self._store, ref)
        return self._run_blocks(ref, self._fence(ref)[1], list(range(ref.blocks)))

    def _fence(self, ref: RunRef) -> tuple[np.ndarray, np.ndarray, int, int]:
        """:func:`read_fence` of ``ref``, kept per run."""
        with self._lock:
            got = self._fences.get(ref.key)
        if got is None:
            got = read_fence(self._store, ref)
            with self._lock:
                self._fences[ref.key] = got
        return got

    def candidates(self, hashes: np.ndarray) -> list[list[int]]:
        """For each hash, the sequences whose key hashes to it (ascending)."""
        j, seqs = self.matches(hashes)
        out: list[list[int]] = [[] for _ in range(len(hashes))]
        for i, s in zip(j.tolist(), seqs.tolist(), strict=True):
            out[i].append(s)
        return [sorted(x) for x in out]

    def matches(
        self, hashes: np.ndarray, order: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Every ``(j, sequence)`` whose key hashes to ``hashes[j]``, as two int64 arrays;
        ``order``: the permutation that sorts ``hashes`` (:func:`hash_order`), where the caller
        has it."""
        if order is None:
            order = np.argsort(hashes)
        try:
            return self._matches(hashes, order)
        except MissingDataError:
            self.update(self._reload())
            return self._matches(hashes, order)

    def _run_blocks(self, ref: RunRef, crcs: np.ndarray, used: list[int]) -> np.ndarray:
        """Entries of blocks ``used`` (ascending) of run ``ref``: kept ones from memory, the
        others read (consecutive ones in one request), checked and kept (the least recently
        used dropped past :data:`KEEP_BLOCKS`)."""
        with self._lock:
            have = {j: self._kept[(ref.key, j)] for j in used if (ref.key, j) in self._kept}
            for j in have:
                self._kept.move_to_end((ref.key, j))
        parts: list[np.ndarray] = []
        read: dict[int, np.ndarray] = {}
        i = 0
        while i < len(used):
            a = b = used[i]
            i += 1
            if a in have:
                parts.append(have[a])
                continue
            while i < len(used) and used[i] == b + 1 and used[i] not in have:
                b = used[i]
                i += 1
            ent = _blocks(self._store, ref, crcs, a, b + 1)
            parts.append(ent)
            for j in range(max(a, b + 1 - KEEP_BLOCKS), b + 1):  # no more than the bound keeps
                read[j] = ent[(j - a) * BLOCK : (j - a + 1) * BLOCK].copy()
        self._keep(ref, read)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _blocks_for(self, ref: RunRef, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The blocks of run ``ref`` that can hold an entry of sorted ``hashes`` (ascending) and
        the positions in ``hashes`` that may be found in them: from the run's kept hashes where
        kept (only the blocks of hashes it holds), else from its fence."""
        nb, kept = ref.blocks, self._hashes_of(ref)
        if kept is not None:
            lo = np.searchsorted(kept, hashes, "left")
            who = np.flatnonzero(lo < len(kept))
            who = who[kept[lo[who]] == hashes[who]]
            first = lo[who] // BLOCK
            stop = (np.searchsorted(kept, hashes[who], "right") - 1) // BLOCK + 1
        else:
            heads = self._fence(ref)[0]
            first = np.maximum(np.searchsorted(heads, hashes, "left") - 1, 0)
            stop = np.searchsorted(heads, hashes, "right")
            who = np.arange(len(hashes))
        need = np.bincount(first, minlength=nb + 1) - np.bincount(stop, minlength=nb + 1)
        return np.flatnonzero(np.cumsum(need)[:nb] > 0), who

    def _matches(self, hashes: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        hashes = hashes[order]  # sorted queries: each search starts where the last ended
        js, seqs = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        for ref in list(self._runs):
            used, who = self._blocks_for(ref, hashes)
            if not len(used):
                continue
            ent = self._run_blocks(ref, self._fence(ref)[1], used.tolist())
            got = np.ascontiguousarray(ent["hash"])
            if len(used) == ref.blocks:  # read whole: its hashes spare the next lookup that
                self._keep_hashes(ref, got)
            want = hashes[who]
            a = np.searchsorted(got, want, "left")
            count = np.searchsorted(got, want, "right") - a
            hit = np.flatnonzero(count)
            if not len(hit):
                continue
            c = count[hit]
            pos = np.repeat(a[hit] - np.cumsum(c) + c, c) + np.arange(int(c.sum()))
            js.append(order[who[np.repeat(hit, c)]].astype(np.int64))
            seqs.append(ent["seq"][pos].astype(np.int64))
        return np.concatenate(js), np.concatenate(seqs)


def next_runs(
    read: Callable[[RunRef], np.ndarray],
    runs: list[RunRef],
    hashes: np.ndarray,
    first_seq: int,
    generation: int,
    record: Callable[[list[RunRef]], bytes],
    order: np.ndarray | None = None,
) -> tuple[list[RunRef], RunRef, bytes, list[RunRef]]:
    """The runs after a commit ``generation`` that adds the keys of ``hashes`` as sequences from
    ``first_seq``: ``(runs, the new run, its object, the runs merged into it)``. ``read(run)``: a
    run's checked entries; ``record(runs)``: the commit record listing ``runs``; ``order``:
    :func:`hash_order` of ``hashes``, where the caller has it."""
    i = merge_plan(runs, len(hashes))
    order = hash_order(hashes) if order is None else order
    ent = np.empty(len(hashes), ENTRY)
    ent["hash"], ent["seq"] = hashes[order], first_seq + order
    if i < len(runs):  # sorted parts, the runs in sequence order: ties stay so
        parts = [*(read(r) for r in runs[i:]), ent]
        merged = fastencode.merge_sorted(parts)
        if merged is None:
            ent = np.concatenate(parts)
            merged = ent[np.argsort(ent["hash"], kind="stable")]
        ent = merged
    first = runs[i].first if i < len(runs) else first_seq
    ref, obj = encode_run(ent, first, generation, lambda ref: record([*runs[:i], ref]))
    return [*runs[:i], ref], ref, obj, runs[i:]


def put(store: Any, key: str, data: bytes) -> None:
    """Write object ``key`` (atomically, as every object of a store is written; on a local disk
    durable on return, written on the calling thread: :func:`.store.put_objects`)."""
    put_objects(store, [(key, data)])


def drop(store: Any, keys: Sequence[str]) -> None:
    """Delete the objects ``keys`` where the store can (a leftover is harmless: no manifest
    lists it, and the next writer's open deletes it)."""
    if not store.supports_deletes:
        return
    for key in keys:
        try:
            sync(store.delete(key))
        except (FileNotFoundError, OSError):
            continue


def listed(store: Any) -> list[str]:
    """The run objects stored (listed), listed or not by the manifest."""

    async def names() -> list[str]:
        return [k async for k in store.list_prefix(PREFIX)]

    if not store.supports_listing:
        return []
    return sync(names())


def check_runs(store: Any, runs: list[RunRef], hashes: np.ndarray) -> list[str]:
    """Problems of the key index ``runs`` against ``hashes[i]``, the hash of committed key ``i``:
    each run readable (CRC32Cs, its commit record naming its generation), sorted, holding each of
    its sequences once with its key's hash."""
    bad = []
    for ref in runs:
        try:
            ent = read_run(store, ref)
            rec = read_record(store, ref).get("logitcache")
            if not isinstance(rec, dict) or rec.get("generation") != ref.generation:
                bad.append(f"{ref.key}: its commit record is not commit {ref.generation}'s")
                continue
        except (FormatError, ValueError) as e:
            bad.append(f"{ref.key}: {e}")
            continue
        seqs = np.sort(ent["seq"])
        if not np.array_equal(seqs, np.arange(ref.first, ref.first + ref.count)):
            bad.append(f"{ref.key}: does not hold each of sequences {ref.first}.. once")
        elif not (ent["hash"][1:] >= ent["hash"][:-1]).all():
            bad.append(f"{ref.key}: not sorted by hash")
        elif not np.array_equal(ent["hash"], hashes[ent["seq"]]):
            j = int(np.flatnonzero(ent["hash"] != hashes[ent["seq"]])[0])
            bad.append(f"{ref.key}: sequence {int(ent['seq'][j])} with another key's hash")
    return bad
