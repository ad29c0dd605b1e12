"""The compiled encode pass of the writer (FORMAT.md W1, 4.2): checks, float16 rounding and row
deltas in one loop over each record's rows, bit for bit what :func:`.records.rows_pass` and
:func:`.quant.encode_logprobs` do (``tests/format/test_format_fastencode.py`` compares them), with
distinct ids checked by a per-vocabulary stamp table instead of a sort. Loaded with it: the tail
mass passes (:func:`tail_rows`), the key hash sums (:func:`key_sums`) and the key-index merge
(:func:`merge_sorted`).

Optional: needs ``numba`` (:data:`._numba.AVAILABLE`). The kernels load at :func:`ready`, or once a
process has encoded :data:`LOAD_AFTER_VALUES` values with numpy (:func:`wanted`); until then, and
if compiling or a self-check fails, the writer encodes with numpy (the same bytes)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import _numba
from ._numba import harden_llvmlite

__all__ = [
    "Outputs",
    "StampTable",
    "encode_rows",
    "harden_llvmlite",
    "outputs",
    "ready",
    "tail_rows",
]

#: Largest vocabulary the stamp table serves (uint16 entries: 2 MiB); larger ones use numpy.
MAX_VOCAB = 1 << 20

_kernel: Any = None
_tail: Any = None  # (tail_rest, row_sums, PAIRWISE_BLOCK) once loaded and checked
_sums: Any = None  # the compiled key_sums once loaded and checked
_merge: Any = None  # the compiled merge_pairs once loaded and checked
_state = "unknown"  # "unknown" | "ready" | "off"
_lock = threading.Lock()

#: Top-k values a process encodes with numpy before :func:`wanted` loads the kernels: loading
#: costs ~0.35 CPU-s, what numpy's encode spends over the kernels' on about this many values.
LOAD_AFTER_VALUES = 1 << 24
_numpy_values = 0  # top-k values encoded with numpy while the kernels were not loaded


def ready() -> bool:
    """Whether the kernels are usable in this process: loaded (compiled, or from numba's cache)
    and checked against numpy once; any failure keeps every step on numpy."""
    global _kernel, _tail, _sums, _merge, _state
    if _state == "unknown":
        with _lock:
            if _state == "unknown":
                try:
                    if not _numba.AVAILABLE:
                        raise ImportError("numba is not installed")
                    from . import _encodekernels as ek

                    _kernel, _sums, _merge = ek.encode_rows, ek.key_sums, ek.merge_pairs
                    _tail = (ek.tail_rest, ek.row_sums, ek.PAIRWISE_BLOCK)
                    checks = (_self_check, _tail_check, _sums_check, _merge_check)
                    ok = all(check() for check in checks)
                except Exception:  # no numba, a failed compile: the numpy path
                    ok = False
                if not ok:
                    _kernel = _tail = _sums = _merge = None
                _state = "ready" if ok else "off"
    return _state == "ready"


def wanted(values: int) -> bool:
    """Whether an encode of ``values`` top-k values takes the compiled pass: once :func:`ready`
    loaded the kernels, or when this encode brings the values encoded with numpy in this process
    to :data:`LOAD_AFTER_VALUES` (then :func:`ready` loads them)."""
    global _numpy_values
    if _state == "unknown":
        _numpy_values += values
        if _numpy_values < LOAD_AFTER_VALUES:
            return False
    return ready()


def key_sums(buf: np.ndarray, ends: np.ndarray, weights: np.ndarray) -> np.ndarray | None:
    """:func:`._keyindex.key_sums_numpy` of the keys ``buf`` (uint8) ending at ``ends``, bit for
    bit, in one compiled pass; ``None`` when the kernels are not loaded."""
    if _sums is None:
        return None
    out = np.empty(len(ends), np.uint64)
    ins = (np.ascontiguousarray(a, d) for a, d in ((buf, np.uint8), (ends, np.int64)))
    _sums(*map(_read_only, ins), _read_only(np.ascontiguousarray(weights)), out)
    return out


def _read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a``: kernel inputs are always read-only, so numba specialises each
    kernel once (at :func:`ready`'s self-check), never again inside an append."""
    v = a.view()
    v.flags.writeable = False
    return v


def merge_sorted(parts: list[np.ndarray]) -> np.ndarray | None:
    """``parts`` (key-index entries, each sorted by hash, in sequence order) merged into one array
    sorted by hash, bit for bit what a stable sort of their concatenation gives; ``None`` when the
    kernels are not loaded."""
    if _merge is None:
        return None
    out = np.ascontiguousarray(parts[-1])
    for p in reversed(parts[:-1]):
        got = np.empty(len(p) + len(out), out.dtype)
        a, b = (_read_only(np.ascontiguousarray(x).view(np.int64).reshape(-1, 2)) for x in (p, out))
        _merge(a, b, got.view(np.int64).reshape(-1, 2))
        out = got
    return out


def _merge_check() -> bool:
    """:func:`merge_sorted` against a stable sort, on parts that share hashes."""
    from ._keyruns import ENTRY

    rng = np.random.default_rng(3)
    parts: list[np.ndarray] = []
    for n in (300, 0, 70, 5, 41):
        p = np.empty(n, ENTRY)
        p["hash"] = np.sort(rng.integers(-40, 40, n))
        p["seq"] = np.arange(n) + 1000 * len(parts)
        parts.append(p)
    ent = np.concatenate(parts)
    want = ent[np.argsort(ent["hash"], kind="stable")]
    got = merge_sorted(parts)
    return got is not None and got.tobytes() == want.tobytes()


def _sums_check() -> bool:
    """:func:`key_sums` against :func:`._keyindex.key_sums_numpy` on keys of 1 to 300 random
    bytes (weights wrapping past ``2**64``)."""
    from ._keyindex import _SEED, _mix, key_sums_numpy

    rng = np.random.default_rng(2)
    lens = rng.integers(1, 301, 200)
    lens[:3] = (1, 300, 17)
    ends = np.cumsum(lens)
    buf = rng.integers(0, 256, int(ends[-1])).astype(np.uint8)
    weights = _mix(np.arange(300, dtype=np.uint64) + _SEED) | np.uint64(1)
    got = key_sums(buf, ends, weights)
    want = key_sums_numpy(buf, ends - lens, lens, weights)
    return got is not None and got.tobytes() == want.tobytes()


def tail_rows(lp: np.ndarray) -> np.ndarray | None:
    """:func:`.records.tail_from_logprobs` of float32 ``lp`` ``[n, k]`` (rows each contiguous), bit
    for bit, with two compiled passes around numpy's own ``exp``; ``None`` when the kernels are not
    loaded or a row is unsorted or not finite (the caller's float64 path then)."""
    if _tail is None:
        return None
    n, k = lp.shape
    rest = np.empty((n, k - 1), np.float32)
    if _tail[0](_read_only(parent_rows(lp)), rest):
        return None
    np.exp(rest, out=rest)  # numpy's exp: its bits are what the format stores
    if k - 1 <= _tail[2]:
        s = np.empty(n, np.float32)
        _tail[1](rest, s)
    else:  # numpy's sum splits such rows: its own
        s = rest.sum(axis=-1, dtype=np.float32)
    np.log1p(s, out=s)  # the numpy form's -expm1(m + log1p(s)), clipped, in place
    np.add(lp[:, 0], s, out=s)
    np.expm1(s, out=s)
    np.negative(s, out=s)
    return np.clip(s, 0.0, 1.0, out=s)


def _tail_check() -> bool:
    """:func:`tail_rows` against numpy's formula (:func:`._tail.tail_numpy`) on rows of every
    summation shape, C-ordered and rows of a wider buffer, and its refusals."""
    from ._tail import tail_numpy

    rng = np.random.default_rng(1)
    for k in (1, 2, 8, 9, 100, 129, 300):
        lp = -np.sort(rng.exponential(2.0, (33, k)).astype(np.float32), axis=1)
        lp[0, 0], lp[1, :] = 0.0, -1e-30
        wide = np.zeros((33, k + 1), np.float32)
        wide[:, 1:] = lp
        for a in (lp, wide[:, 1:]):
            got = tail_rows(a)
            if got is None or got.tobytes() != tail_numpy(a).tobytes():
                return False
    bad = -np.sort(rng.exponential(2.0, (4, 5)).astype(np.float32), axis=1)
    bad[0, 3], bad[1, 2], bad[2] = 0.5, np.nan, -np.inf  # unsorted, NaN, -inf - -inf
    return all(tail_rows(bad[i : i + 1]) is None for i in range(3))


def _self_check() -> bool:
    """The kernel against :func:`.quant.encode_logprobs` and the checks on a small batch, as
    C-ordered arrays and as rows of wider ones (both of numba's specialisations)."""
    from .quant import encode_logprobs

    rng = np.random.default_rng(0)
    lp = -np.sort(rng.exponential(3.0, (64, 16)).astype(np.float32), axis=1)
    lp[0, :4] = (0.0, -0.0, -1e-30, -7e-8)
    lp[1] = -np.sort(rng.uniform(0, 1e5, 16)).astype(np.float32)
    lp[0] = np.maximum.accumulate(lp[0][::-1])[::-1]  # still non-increasing
    ids = np.stack([rng.permutation(128)[:16] for _ in range(64)]).astype(np.int32)
    table = StampTable(128)
    out_ids, stored = np.empty_like(ids), np.empty(ids.shape, np.uint16)
    if not encode_rows(ids, lp, out_ids, stored, table, 1e-3):
        return False
    wide_ids, wide_lp = np.zeros((64, 17), np.int32), np.zeros((64, 17), np.float32)
    wide_ids[:, 1:], wide_lp[:, 1:] = ids, lp  # rows of a wider buffer (the vLLM hook's views)
    out_wide, stored_wide = np.empty_like(ids), np.empty(ids.shape, np.uint16)
    if not encode_rows(wide_ids[:, 1:], wide_lp[:, 1:], out_wide, stored_wide, table, 1e-3):
        return False
    ids[5, 3] = ids[5, 9]  # a repeated id must fail
    bad = encode_rows(ids, lp, np.empty_like(ids), np.empty_like(stored), table, 1e-3)
    want = encode_logprobs(lp, "float16")["topk_logprobs"]
    same = (stored_wide == stored).all() and (out_wide == out_ids).all()
    return bool((stored == want).all() and same and (out_ids[5] != ids[5]).any() and not bad)


class StampTable:
    """The distinct-id table of :func:`encode_rows`: one uint16 stamp per vocabulary id; a row's ids
    are distinct iff none finds the row's own stamp (``state[0]``: the last stamp given; the kernel
    zeroes the table after stamp 65535)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab = int(vocab_size)
        self.seen = np.zeros(self.vocab, dtype=np.uint16)
        self.state = np.zeros(1, dtype=np.int64)  # the last stamp given (0: none yet)


#: Largest output kept between appends, in top-k entries (``rows * k``): 64 MiB of ids and 32 MiB
#: of stored logprobs. A job's appends hold at most ``pipeline.MERGE_VALUES`` (13 x 2**20) and
#: a batch; a larger append gets arrays of its own, freed with it.
KEEP_VALUES = 1 << 24


class Outputs:
    """The compiled encode's output arrays and the arrays records' top-k rows are joined into, kept
    from one append to the next (fresh arrays per append would be fresh pages: page faults in system
    time). Taken through :func:`outputs` for one append; the next append overwrites them."""

    def __init__(self) -> None:
        self._kept: dict[str, np.ndarray] = {}

    def _views(self, rows: int, k: int, dtypes: dict[str, Any]) -> list[np.ndarray]:
        n = rows * k
        if n > KEEP_VALUES:
            return [np.empty((rows, k), d) for d in dtypes.values()]
        if any(n > self._kept.get(name, np.empty(0)).size for name in dtypes):
            size = min(max(n + n // 4, 1 << 16), KEEP_VALUES)  # headroom: group sizes vary
            for name, d in dtypes.items():
                self._kept[name] = np.empty(0, d)  # free first
                self._kept[name] = np.empty(size, d)
        return [self._kept[name][:n].reshape(rows, k) for name in dtypes]

    def take(self, rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(ids int32 [rows, k], stored uint16 [rows, k])``, uninitialised; views of the kept
        buffers when they fit in :data:`KEEP_VALUES` (grown as needed), else new arrays."""
        ids, stored = self._views(rows, k, {"ids": np.int32, "stored": np.uint16})
        return ids, stored

    def take_rows(self, rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(topk_ids int32 [rows, k], topk_logprobs float32 [rows, k])`` to join records'
        rows into, as :meth:`take` gives them (other buffers than :meth:`take` 's)."""
        ids, lp = self._views(rows, k, {"in_ids": np.int32, "in_lp": np.float32})
        return ids, lp


_outputs: list[Outputs] = []  # free ones, for the next append of any writer
_outputs_lock = threading.Lock()


@contextlib.contextmanager
def outputs() -> Iterator[Outputs]:
    """An :class:`Outputs` for one append (:meth:`._writer.CacheWriter.append`), returned to a
    process-wide pool at its end; concurrent appends take one each."""
    with _outputs_lock:
        out = _outputs.pop() if _outputs else Outputs()
    try:
        yield out
    finally:
        with _outputs_lock:
            if len(_outputs) < 2:
                _outputs.append(out)


def parent_rows(a: np.ndarray) -> np.ndarray:
    """A C-ordered ``[n, w]`` view whose first ``k`` columns are ``a`` (``[n, k]``, rows each
    contiguous, :func:`.records.rows_array`), so the kernel reads it at C-order speed; only the
    first ``k`` values of a row may be read."""
    n, k = a.shape
    if a.flags.c_contiguous or n == 0 or k == 0:
        return a
    if a.strides[1] != a.itemsize or a.strides[0] % a.itemsize or a.strides[0] < k * a.itemsize:
        raise ValueError("rows must each be contiguous and not overlap")
    w = a.strides[0] // a.itemsize
    return np.lib.stride_tricks.as_strided(a, shape=(n, w), strides=(a.strides[0], a.itemsize))


def encode_rows(
    ids: np.ndarray,
    lp: np.ndarray,
    ids_out: np.ndarray,
    stored_out: np.ndarray,
    table: StampTable,
    tol: float,
) -> bool:
    """Check ``ids`` int32 / ``lp`` float32 ``[n, k]`` (rows each contiguous) as
    :func:`.records.rows_pass` does and write ``ids_out`` and ``stored_out`` (the float16 row-delta
    bit patterns of :func:`.quant.encode_logprobs`); False at the first failing row. Call only after
    :func:`ready` returned True."""
    pl = _read_only(parent_rows(lp))
    got = _kernel(  # the ids' loop is scalar: their strides cost nothing (numba's "A")
        _read_only(ids),
        pl,
        pl.view(np.uint32),
        ids_out,
        stored_out,
        table.seen,
        table.state,
        table.vocab,
        tol,
    )
    return got == 0
