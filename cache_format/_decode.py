"""The reader's decoders (FORMAT.md §6, D2-D4): what turns row and token spans of a snapshot's
arrays into decoded arrays. One interface, two implementations:

- ``"numpy"``: the reference, always available: chunk by chunk (:mod:`._pointread`), then the
  logprobs in row blocks; arrays not in the format's sharded layout through zarr.
- ``"numba"``: the whole call in one compiled call per thread (:mod:`._fastdecode`) where it
  applies (a local store, float16 or float32 logprobs); anything else, and anything the compiled
  code hands back, goes to the NumPy decoder, which raises the typed error.

:func:`default_decoder` is the compiled one where numba is installed. Both give the same bits."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import zarr

from . import _fastdecode as fastdecode
from . import _kernels as kernels
from . import _plan, spec
from . import _pointread as pointread
from ._integrity import checked_read
from ._manifest import Manifest
from ._seal import sealed
from ._shardread import DirectLayout
from .errors import CorruptStoreError
from .quant import OUT_DTYPES, decode_logprobs

Span = tuple[slice, slice | None]
"""Rows ``[a, b)`` of the row arrays and, for a sequence span, tokens ``[ta, tb)``."""

Fetched = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]
"""Per span: top-k ids, logprobs, float32 tail, tokens (``None`` for a row-only span), loss
mask (``None`` unless the store has one)."""


@dataclass
class OpenArrays:
    """The arrays of one snapshot as the decoders read them: zarr's handles, the direct layouts, the
    committed entries of each (R6), a local store's directory and the id order (FORMAT.md 4.3)."""

    manifest: Manifest
    arrays: dict[str, zarr.Array]
    direct: dict[str, DirectLayout]
    need: dict[str, int]
    strict: bool
    root: str | None
    id_order: np.ndarray | None
    plans: dict[tuple[str, bool], _FastPlan | None] = field(default_factory=dict)

    def row_names(self) -> list[str]:
        """The row arrays a read of top-k rows needs (FORMAT.md 4.1, 4.6)."""
        m = self.manifest
        names = [spec.TOPK_IDS, spec.TOPK_LOGPROBS, spec.TAIL_MASS]
        if m.logprob_dtype in spec.QUANTISED_DTYPES:
            names += [spec.LOGPROB_MAX, spec.LOGPROB_STEP]
        if m.loss_mask:
            names.append(spec.LOSS_MASK)
        return names

    def check(self, name: str, start: int, stop: int) -> None:
        """R6: never past the committed count, whatever asked."""
        if not 0 <= start <= stop <= self.need[name]:
            raise CorruptStoreError(
                f"read of {name}[{start}:{stop}] past the committed {self.need[name]} entries"
            )


class Decoder(Protocol):
    """Decodes spans of one snapshot's arrays (see the module docstring)."""

    name: str

    def active(self) -> str:
        """The name of the decoder that runs (the compiled one may find it cannot, at its
        first use, and hand every call to the NumPy one)."""
        ...

    def fetch(
        self,
        arrays: OpenArrays,
        spans: list[Span],
        logprob_dtype: str,
        pool: ThreadPoolExecutor | None,
        threads: int,
    ) -> list[Fetched]:
        """Per span ``(ids, logprobs as logprob_dtype, tail, tokens, mask)``."""
        ...


def _blockwise(stored: str, out: str) -> bool:
    """Whether logprobs stored as ``stored`` are decoded into ``out`` in row blocks with no
    dequantisation (float16 bits -> float16 or float32, float32 bits -> float32)."""
    return stored == "float16" or (stored == "float32" and out == "float32")


def stored_spans(
    arrays: OpenArrays,
    spans: Sequence[Span],
    names: Sequence[str],
    pool: ThreadPoolExecutor | None = None,
    threads: int = 1,
) -> list[tuple[dict[str, np.ndarray], np.ndarray | None]]:
    """Per span, the stored values of the row arrays ``names`` over its rows (by name) and of
    ``input_ids`` over its tokens (``None`` without), in one :func:`stored_values` call."""
    jobs: list[tuple[str, int, int]] = []
    for rows, toks in spans:
        jobs += [(n, rows.start, rows.stop) for n in names]
        if toks is not None:
            jobs.append((spec.INPUT_IDS, toks.start, toks.stop))
    vals = iter(stored_values(arrays, jobs, pool, threads))
    out: list[tuple[dict[str, np.ndarray], np.ndarray | None]] = []
    for _rows, toks in spans:
        got = {n: next(vals) for n in names}
        out.append((got, next(vals) if toks is not None else None))
    return out


def stored_values(
    arrays: OpenArrays,
    jobs: list[tuple[str, int, int]],
    pool: ThreadPoolExecutor | None = None,
    threads: int = 1,
) -> list[np.ndarray]:
    """The stored values of ``name[a:b]`` for each job: direct arrays chunk by chunk
    (:func:`._pointread.read`, split over ``threads`` of ``pool``), others through zarr."""
    for name, a, b in jobs:
        arrays.check(name, a, b)
    direct = [j for j in jobs if j[0] in arrays.direct]
    got = iter(pointread.read(arrays.direct, direct, pool, threads) if direct else [])
    return [
        next(got)
        if n in arrays.direct
        else checked_read(
            arrays.arrays[n], n, a, b, arrays.strict, sealed(arrays.manifest.format_version)
        )
        for n, a, b in jobs
    ]


def index_block(
    opened: OpenArrays, a: int, b: int, upto: bool
) -> tuple[np.ndarray, int, int | None]:
    """``seq_lengths[a:b]``, ``seq_row_start[a]`` and, if ``upto``, ``seq_row_start[b]``: an
    index block (:mod:`._snapshot`) in one read."""
    jobs = [(spec.SEQ_LENGTHS, a, b), (spec.SEQ_ROW_START, a, a + 1)]
    if upto:
        jobs.append((spec.SEQ_ROW_START, b, b + 1))
    got = stored_values(opened, jobs)
    return got[0], int(got[1][0]), int(got[2][0]) if upto else None


class NumpyDecoder:
    """The reference decoder (see the module docstring)."""

    name = "numpy"

    def active(self) -> str:
        return self.name

    def fetch(
        self,
        arrays: OpenArrays,
        spans: list[Span],
        logprob_dtype: str,
        pool: ThreadPoolExecutor | None,
        threads: int,
    ) -> list[Fetched]:
        if logprob_dtype not in OUT_DTYPES:
            raise ValueError(f"logprob_dtype must be one of {OUT_DTYPES}, got {logprob_dtype!r}")
        names = arrays.row_names()
        wanted = [*names, *([spec.INPUT_IDS] if any(t for _, t in spans) else [])]
        dtype, order = arrays.manifest.logprob_dtype, arrays.id_order
        # direct arrays: the logprobs (and id remap) in row blocks, on the pool if any
        blockwise = _blockwise(dtype, logprob_dtype) and all(n in arrays.direct for n in wanted)
        out: list[Fetched] = []
        blocks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (bits, logprobs, ids)
        for got, tokens in stored_spans(arrays, spans, names, pool, threads):
            ids, d = got[spec.TOPK_IDS], got[spec.TOPK_LOGPROBS]
            if blockwise:
                lp = d.view(np.float16 if dtype == "float16" else np.float32)
                if dtype == "float16" and logprob_dtype == "float32":
                    lp = np.empty(d.shape, dtype=np.float32)
                blocks.append((d, lp, ids))
            else:
                if order is not None:
                    ids = order[ids]
                lp = decode_logprobs(
                    d,
                    dtype,
                    got.get(spec.LOGPROB_MAX),
                    got.get(spec.LOGPROB_STEP),
                    out_dtype=logprob_dtype,
                    in_place=True,
                )
            tail = np.asarray(got[spec.TAIL_MASS], dtype=np.float32)
            out.append((ids, lp, tail, tokens, got.get(spec.LOSS_MASK)))
        if blocks:
            _decode_blocks(blocks, order, pool, threads)
        return out


def _decode_blocks(
    blocks: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
    order: np.ndarray | None,
    pool: ThreadPoolExecutor | None,
    threads: int,
) -> None:
    """The row-delta inverse of each span's stored logprob bits (in place), widened into its
    logprobs if those are float32 of other memory (a float16 store), and the id remap of its
    ids (in place), in row blocks of :data:`._kernels.BLOCK_ELEMENTS`, split over ``threads``
    by :func:`._plan.split` (a block's cost: the bytes it reads and writes)."""
    steps = [max(1, kernels.BLOCK_ELEMENTS // max(1, d.shape[1])) for d, _, _ in blocks]
    items = [(j, 0, d.shape[0], 0) for j, (d, _, _) in enumerate(blocks) if d.shape[0]]
    groups = [items]  # one thread: no plan
    if pool is not None and threads > 1:
        cost = [d.shape[1] * 6 for d, _, _ in blocks]
        n, least = min(threads, pointread.MAX_SHARES), pointread.PARALLEL_MIN_BYTES
        groups = _plan.split(items, steps, cost, n, least)

    def run(group: list[_plan.Item]) -> None:
        for j, st, sp, _ in group:
            d, lp, ids = blocks[j]
            for a in range(st, sp, steps[j]):
                b = min(a + steps[j], sp)
                kernels.undelta_block(d[a:b])
                if lp.dtype == np.float32 and d.dtype == np.uint16:
                    kernels.widen_block(d[a:b].view(np.float16), lp[a:b])
                if order is not None:
                    np.take(order, ids[a:b], out=ids[a:b])

    _plan.run_groups(run, groups, pool)


class _FastPlan:
    """What :class:`NumbaDecoder` passes to :func:`._fastdecode.read_arrays` for one
    ``(logprob_dtype, tokens)``: the arrays' layouts in the order ``topk_ids, topk_logprobs,
    tail_mass[, loss_mask][, input_ids]``."""

    __slots__ = ("lays", "root", "stored", "widen", "mask", "tokens", "row_arrays")

    def __init__(
        self, names: list[str], lays: list[DirectLayout], root: str, stored: np.dtype, widen: bool
    ):
        self.lays, self.root, self.stored, self.widen = lays, root, stored, widen
        self.mask = spec.LOSS_MASK in names
        self.tokens = spec.INPUT_IDS in names
        self.row_arrays = len(names) - self.tokens


def _fast_plan(arrays: OpenArrays, logprob_dtype: str, tokens: bool) -> _FastPlan | None:
    """The compiled read's arguments (made once per snapshot and key), or ``None`` where it
    does not apply: a remote store, an array not in the sharded layout, quantised logprobs,
    float32 stored read as float16."""
    key = (logprob_dtype, tokens)
    if key in arrays.plans:
        return arrays.plans[key]
    m = arrays.manifest
    names = arrays.row_names() + ([spec.INPUT_IDS] if tokens else [])
    plan = None
    if (
        arrays.root is not None
        and _blockwise(m.logprob_dtype, logprob_dtype)
        and all(n in arrays.direct for n in names)
    ):
        plan = _FastPlan(
            names,
            [arrays.direct[n] for n in names],
            arrays.root,
            np.dtype(m.logprob_dtype),
            m.logprob_dtype == "float16" and logprob_dtype == "float32",
        )
    arrays.plans[key] = plan
    return plan


class NumbaDecoder:
    """The compiled decoder (see the module docstring)."""

    name = "numba"

    def __init__(self, fallback: NumpyDecoder) -> None:
        self.fallback = fallback

    def active(self) -> str:
        return self.name if fastdecode.AVAILABLE and fastdecode.ready() else self.fallback.name

    def fetch(
        self,
        arrays: OpenArrays,
        spans: list[Span],
        logprob_dtype: str,
        pool: ThreadPoolExecutor | None,
        threads: int,
    ) -> list[Fetched]:
        if fastdecode.AVAILABLE and logprob_dtype in OUT_DTYPES:
            tokens = any(t is not None for _, t in spans)
            plan = _fast_plan(arrays, logprob_dtype, tokens)
            if plan is not None and fastdecode.ready():
                got = _fetch_fast(arrays, spans, plan, pool, threads)
                if got is not None:
                    return got
        return self.fallback.fetch(arrays, spans, logprob_dtype, pool, threads)


def _fetch_fast(
    arrays: OpenArrays,
    spans: list[Span],
    plan: _FastPlan,
    pool: ThreadPoolExecutor | None,
    threads: int,
) -> list[Fetched] | None:
    """One compiled read (the records are views of one block per array), or ``None``: the
    NumPy decoder reads it (also every span past the committed count, R6, so that it raises)."""
    rows = [(r.start, r.stop) for r, _ in spans]
    bounds = [rows] * plan.row_arrays
    if plan.tokens:
        bounds.append([(0, 0) if t is None else (t.start, t.stop) for _, t in spans])
    for jobs, lay in zip(bounds, plan.lays, strict=True):
        for st, sp in jobs:
            if st < 0 or sp < st or sp > lay.length:
                return None
    lp = (1, plan.widen)  # spec.TOPK_LOGPROBS is the plan's second array
    got = fastdecode.read_arrays(plan.lays, plan.root, bounds, lp, pool, threads)
    if got is None:
        return None
    blocks, widened = got
    ids = blocks[0]
    tail = np.asarray(blocks[2], dtype=np.float32)  # stored float16 in some caches
    if arrays.id_order is not None:
        np.take(arrays.id_order, ids, out=ids)
    lp_all = widened if widened is not None else blocks[1].view(plan.stored)
    mask = blocks[3] if plan.mask else None
    tokens = blocks[-1] if plan.tokens else None
    out: list[Fetched] = []
    r = t = 0
    for rs, ts in spans:
        n = rs.stop - rs.start
        tok = None
        if ts is not None and tokens is not None:
            tok = tokens[t : t + ts.stop - ts.start]
            t += ts.stop - ts.start
        m = None if mask is None else mask[r : r + n]
        out.append((ids[r : r + n], lp_all[r : r + n], tail[r : r + n], tok, m))
        r += n
    return out


_NUMPY = NumpyDecoder()
DECODERS: dict[str, Decoder] = {"numpy": _NUMPY, "numba": NumbaDecoder(_NUMPY)}
"""The decoders by name."""


def default_decoder() -> str:
    """``"numba"`` where numba and the C functions it calls are installed, else ``"numpy"``."""
    return "numba" if fastdecode.AVAILABLE else "numpy"


def get_decoder(name: str | None) -> Decoder:
    """The decoder called ``name`` (``None``: :func:`default_decoder`)."""
    key = default_decoder() if name is None else name
    if key not in DECODERS:
        raise ValueError(f"decoder must be one of {sorted(DECODERS)}, got {name!r}")
    return DECODERS[key]
