"""The optional per-row teacher entropy (FORMAT.md 4.9): encoding a record's entropy for the
store, and attaching the stored entropy to what a reader returns.

An ``entropy`` store (``manifest.entropy``) keeps, per row, the entropy in nats of the teacher's
full distribution at the manifest's temperature, as float16. Every record appended to such a
store carries it; a record with entropy appended to a store without the array is refused (the
values would be lost silently). Readers read the array after the row arrays of the same
snapshot and give records and row blocks their rows' values (float16); stores without it give
``None``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import spec
from ._decode import OpenArrays, stored_values
from ._manifest import Manifest
from .errors import RecordError

#: The stored dtype: an entropy is at most ``log(V)``, under 21.5 nats for any vocabulary below
#: 2^31, where float16's relative rounding is at most 2^-11 (about 0.05%).
STORED_DTYPE = np.float16


def encode(rec: Any, manifest: Manifest, index: int | None = None) -> np.ndarray | None:
    """The stored ``entropy`` rows of record ``rec`` (float16), or ``None`` for a store without
    the array; a :class:`RecordError` when the record and the store disagree on having it."""
    ent = rec.entropy
    if manifest.entropy and ent is None:
        raise RecordError(
            "the store keeps per-row entropy (manifest entropy=true) and the record has none",
            key=rec.key,
            index=index,
        )
    if not manifest.entropy and ent is not None:
        raise RecordError(
            "record has entropy but the store has none (create it with entropy=True)",
            key=rec.key,
            index=index,
        )
    return None if ent is None else ent.astype(STORED_DTYPE)


def batch_matches(records: Sequence[Any], manifest: Manifest) -> bool:
    """Whether every record has entropy exactly when the store keeps it."""
    return all((r.entropy is not None) == manifest.entropy for r in records)


def read(
    opened: OpenArrays, retry: Callable[[Callable[[], Any]], Any], rows: Sequence[slice]
) -> list[np.ndarray] | None:
    """The stored entropy (float16) of each global row range in ``rows``, with the reader's
    retries; ``None`` for a store without the array."""
    if not opened.manifest.entropy:
        return None
    jobs = [(spec.ENTROPY, r.start, r.stop) for r in rows]
    got: list[np.ndarray] = retry(lambda: stored_values(opened, jobs))
    return [np.asarray(g).view(STORED_DTYPE) for g in got]


def attach(records: list[Any], values: list[np.ndarray] | None) -> list[Any]:
    """``records`` (a reader's, in row order of ``values``: the entropy of their rows, in
    pieces) with ``entropy`` set to their rows' values (views)."""
    if values is not None:
        flat = values[0] if len(values) == 1 else np.concatenate(values)
        r = 0
        for rec in records:
            n = rec.num_rows
            rec.__dict__["entropy"] = flat[r : r + n]
            r += n
    return records
