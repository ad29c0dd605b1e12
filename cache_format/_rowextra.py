"""The optional per-row arrays beside a store's rows (:data:`EXTRAS`): the teacher's entropy
(FORMAT.md 4.9) and the logprob of the actual next token (FORMAT.md 4.12), each named like its
manifest flag and record attribute. A store with the flag takes only records that carry the
values, a store without it refuses them; readers attach the stored values (``None`` without)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from . import spec
from ._decode import OpenArrays, stored_values
from ._manifest import Manifest
from .errors import RecordError


@dataclass(frozen=True)
class RowExtra:
    """One optional per-row array: ``name`` is the array, the manifest flag and the record
    attribute; ``dtype`` the stored dtype; ``what`` the values, for error messages."""

    name: str
    dtype: type[np.floating]
    what: str


#: The entropy is at most ``log(V)``, under 21.5 nats for any vocabulary below 2^31, where
#: float16's relative rounding is at most 2^-11 (about 0.05%); the actual token's logprob is
#: kept as computed (float32): it is compared with a fresh engine's value by trainers.
EXTRAS = (
    RowExtra(spec.ENTROPY, np.float16, "per-row entropy"),
    RowExtra(spec.ACTUAL_LOGPROB, np.float32, "the actual token's logprob per row"),
)


def kept(manifest: Manifest) -> list[RowExtra]:
    """The optional per-row arrays ``manifest``'s store has."""
    return [x for x in EXTRAS if getattr(manifest, x.name)]


def encode(rec: Any, manifest: Manifest, index: int | None = None) -> dict[str, np.ndarray]:
    """The stored optional arrays of record ``rec`` (stored dtype) for a store with
    ``manifest``; a :class:`RecordError` when the record and the store disagree on having one."""
    out = {}
    for x in EXTRAS:
        value, has = getattr(rec, x.name), bool(getattr(manifest, x.name))
        if has and value is None:
            raise RecordError(
                f"the store keeps {x.what} (manifest {x.name}=true) and the record has none",
                key=rec.key,
                index=index,
            )
        if not has and value is not None:
            raise RecordError(
                f"record has {x.name} but the store has none (create it with {x.name}=True)",
                key=rec.key,
                index=index,
            )
        if value is not None:
            out[x.name] = value.astype(x.dtype)
    return out


def batch_matches(records: Sequence[Any], manifest: Manifest) -> bool:
    """Whether every record has each optional array exactly when the store keeps it."""
    return all(
        (getattr(r, x.name) is not None) == bool(getattr(manifest, x.name))
        for r in records
        for x in EXTRAS
    )


def read(
    opened: OpenArrays, retry: Callable[[Callable[[], Any]], Any], rows: Sequence[slice]
) -> dict[str, list[np.ndarray]]:
    """Per optional array of the store, its stored values of each global row range in
    ``rows``, with the reader's retries (empty for a store with none)."""
    out = {}
    for x in kept(opened.manifest):
        jobs = [(x.name, r.start, r.stop) for r in rows]
        got: list[np.ndarray] = retry(partial(stored_values, opened, jobs))
        out[x.name] = [np.asarray(g).view(x.dtype) for g in got]
    return out


def attach(records: list[Any], values: dict[str, list[np.ndarray]]) -> list[Any]:
    """``records`` (a reader's, in row order of ``values``: each array's values of their rows,
    in pieces) with each array's attribute set to their rows' values (views)."""
    for name, pieces in values.items():
        flat = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        r = 0
        for rec in records:
            n = rec.num_rows
            rec.__dict__[name] = flat[r : r + n]
            r += n
    return records


def first(values: dict[str, list[np.ndarray]], name: str) -> np.ndarray | None:
    """The first piece of array ``name`` in :func:`read`'s ``values``, or ``None``."""
    got = values.get(name)
    return None if got is None else got[0]
