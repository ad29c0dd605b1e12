"""Size accounting of a store: bytes stored per array versus the raw (uncompressed) layout.

Raw reference (the issue's): ``k * (4 + 2)`` bytes per position (int32 ids + float16 logprobs),
i.e. 600 B at k=100. ``bytes_per_position`` counts every stored byte of the row arrays (ids,
logprobs, quantisation parameters, tail mass) divided by the committed rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from zarr.core.sync import sync

from . import spec
from .manifest import Manifest

ROW_FAMILY = (
    spec.TOPK_IDS,
    spec.TOPK_LOGPROBS,
    spec.LOGPROB_MAX,
    spec.LOGPROB_STEP,
    spec.TAIL_MASS,
)


@dataclass
class StoreStats:
    bytes_by_array: dict[str, int]
    num_rows: int
    k: int

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
        return self.k * 6

    @property
    def compression_ratio(self) -> float:
        """Raw int32+float16 bytes over stored row bytes (> 1 means smaller than raw)."""
        return self.raw_bytes_per_position / self.bytes_per_position if self.num_rows else 0.0


def store_stats(zstore, manifest: Manifest) -> StoreStats:
    """Stored bytes of every array of the store (all objects under each array's prefix)."""
    names = [spec.TOPK_IDS, spec.TOPK_LOGPROBS, spec.TAIL_MASS, spec.INPUT_IDS, *spec.SEQ_ARRAYS]
    if manifest.logprob_dtype in spec.QUANTISED_DTYPES:
        names += [spec.LOGPROB_MAX, spec.LOGPROB_STEP]
    if manifest.format_version >= 2:
        names += list(spec.KEY_BYTES_ARRAYS)
    sizes = {n: int(sync(zstore.getsize_prefix(n + "/"))) for n in names}
    return StoreStats(sizes, manifest.num_rows, manifest.k)
