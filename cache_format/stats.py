"""Size accounting of a store: bytes stored per array versus the raw (uncompressed) layout.

Raw reference: ``k * (4 + 2)`` bytes per position (int32 ids + float16 logprobs),
i.e. 600 B at k=100. ``bytes_per_position`` counts every stored byte of the row arrays (ids,
logprobs, quantisation parameters, tail mass, and the optional per-row arrays: loss mask,
entropy, actual-token logprob) divided by the committed rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zarr.abc.store import Store

from . import _rowextra, spec
from ._keyruns import PREFIX
from ._manifest import Manifest
from ._zarr_adapter import sync
from .hidden import bytes_per_position

if TYPE_CHECKING:
    from ._reader import CacheReader
    from .records import RowBlock

ROW_FAMILY = (
    spec.TOPK_IDS,
    spec.TOPK_LOGPROBS,
    spec.LOGPROB_MAX,
    spec.LOGPROB_STEP,
    spec.TAIL_MASS,
    spec.HIDDEN,
    spec.HIDDEN_SCALE,
    spec.LOSS_MASK,
    spec.ENTROPY,
    spec.ACTUAL_LOGPROB,
)


@dataclass
class StoreStats:
    bytes_by_array: dict[str, int]
    num_rows: int
    k: int
    raw_per_position: int | None = None
    """Raw row bytes per position when not ``k * 6`` (a hidden store: 4.10's bytes per row)."""

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_array.values())

    @property
    def row_bytes(self) -> int:
        return sum(v for n, v in self.bytes_by_array.items() if n in ROW_FAMILY)

    @property
    def bytes_per_position(self) -> float:
        return self.row_bytes / self.num_rows if self.num_rows else 0.0

    @property
    def raw_bytes_per_position(self) -> int:
        return self.k * 6 if self.raw_per_position is None else self.raw_per_position

    @property
    def compression_ratio(self) -> float:
        """Raw int32+float16 bytes over stored row bytes (> 1 means smaller than raw)."""
        return self.raw_bytes_per_position / self.bytes_per_position if self.num_rows else 0.0


def store_stats(zstore: Store, manifest: Manifest) -> StoreStats:
    """Stored bytes of every array of the store (all objects under each array's prefix), and of
    the key index (``key_index``)."""
    names = [spec.TOPK_IDS, spec.TOPK_LOGPROBS, spec.TAIL_MASS, spec.INPUT_IDS, *spec.SEQ_ARRAYS]
    h, raw = manifest.hidden, None
    if h is not None:  # FORMAT.md 4.10: hidden rows (and the head) instead of top-k arrays
        names = [spec.HIDDEN, spec.HIDDEN_SCALE, spec.HEAD_WEIGHT, spec.HEAD_BIAS, *names[3:]]
        raw = bytes_per_position(h["dim"], h["dtype"])
    elif manifest.logprob_dtype in spec.QUANTISED_DTYPES:
        names += [spec.LOGPROB_MAX, spec.LOGPROB_STEP]
    if manifest.format_version >= 2:
        names += list(spec.KEY_BYTES_ARRAYS)
    names += [spec.LOSS_MASK] if manifest.loss_mask else []
    names += [x.name for x in _rowextra.kept(manifest)]  # FORMAT.md 4.9, 4.12
    sizes = {n: int(sync(zstore.getsize_prefix(n + "/"))) for n in names}
    if manifest.key_index is not None:  # its runs lie under seq_keys/ (FORMAT.md 4.11)
        sizes["key_index"] = int(sync(zstore.getsize_prefix(PREFIX)))
        sizes[spec.SEQ_KEYS] -= sizes["key_index"]
    return StoreStats(sizes, manifest.num_rows, manifest.k, raw)


#: Windows sampled by :func:`tail_summary`, and rows per window.
TAIL_WINDOWS = 8
TAIL_WINDOW_ROWS = 2048
#: Mean top-k mass below which ``logitcache info`` and the status page warn.
LOW_COVERAGE = 0.9


@dataclass
class TailSummary:
    """Tail mass over the sampled rows: ``coverage = 1 - mean(tail_mass)`` is the mean teacher
    probability the cached top-k holds; percentiles are of the tail mass itself."""

    rows: int
    mean_tail: float
    p50: float
    p90: float
    p99: float

    @property
    def coverage(self) -> float:
        return 1.0 - self.mean_tail

    @property
    def low(self) -> bool:
        return self.coverage < LOW_COVERAGE


def tail_windows(num_rows: int) -> list[tuple[int, int]]:
    """Row ranges :func:`tail_summary` reads: all rows, or evenly spaced windows."""
    total = TAIL_WINDOWS * TAIL_WINDOW_ROWS
    if num_rows <= total:
        return [(0, num_rows)] if num_rows else []
    step = (num_rows - TAIL_WINDOW_ROWS) / (TAIL_WINDOWS - 1)
    return [(round(i * step), round(i * step) + TAIL_WINDOW_ROWS) for i in range(TAIL_WINDOWS)]


def tail_summary(reader: CacheReader) -> TailSummary | None:
    """Tail mass of every row (caches up to 16,384 rows) or of 8 evenly spaced windows of 2,048
    rows of an open ``CacheReader``; None for an empty cache, or one of sampled targets (its rows
    hold importance weights that sum to 1: there is no top-k mass to report)."""
    import numpy as np

    if getattr(reader.manifest, "targets", "topk") != "topk":
        return None

    parts = [_tail(reader.rows(a, b)) for a, b in tail_windows(reader.num_rows)]
    if not parts:
        return None
    tails = np.concatenate(parts).astype(np.float64)
    p50, p90, p99 = (float(x) for x in np.percentile(tails, [50, 90, 99]))
    return TailSummary(int(tails.size), float(tails.mean()), p50, p90, p99)


def _tail(block: RowBlock | dict) -> Any:
    """The tail masses of a row block (a ``RowBlock``, or its dict from an ``as_torch`` reader)."""
    return block["tail_mass"] if isinstance(block, dict) else block.tail_mass
