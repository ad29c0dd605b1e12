"""Loader state: the few integers that pin a position in the item stream.

The item stream of a rank is a pure function of the cache lengths and the dataset configuration
(see :mod:`logitcache.client.order` and :mod:`logitcache.client.collate`), so resuming needs no
buffers: rebuild the same stream and skip ``items_consumed`` items. ``items_consumed`` counts items
*delivered to the trainer* on this rank in ``epoch`` (not items prefetched or produced by workers).

JSON form (``LoaderState.to_dict()``)::

    {"version": 1, "epoch": 3, "items_consumed": 1200, "seed": 0, "num_sequences": 50000,
     "rank": 0, "world_size": 8, "config": "<sha256 of the stream-shaping settings>"}

``num_sequences`` is the number of cache sequences the epoch was planned over: a cache that grew
since (more committed sequences) is read as its first ``num_sequences`` sequences until the next
epoch, so the remaining stream is identical.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .errors import StateError

__all__ = ["LoaderState", "STATE_VERSION"]

STATE_VERSION = 1

_INT_FIELDS = ("version", "epoch", "items_consumed", "seed", "num_sequences", "rank", "world_size")


@dataclass(frozen=True)
class LoaderState:
    """Position of one rank's loader (see the module docstring for the semantics)."""

    epoch: int
    items_consumed: int
    seed: int
    num_sequences: int
    rank: int
    world_size: int
    config: str
    version: int = STATE_VERSION

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> LoaderState:
        """Parse and check a dict made by :meth:`to_dict`; raises :class:`StateError`."""
        if not isinstance(data, dict):
            raise StateError(f"loader state must be a dict, got {type(data).__name__}")
        missing = [f for f in (*_INT_FIELDS, "config") if f not in data]
        if missing:
            raise StateError(f"loader state lacks {missing}")
        unknown = sorted(set(data) - set(_INT_FIELDS) - {"config"})
        if unknown:
            raise StateError(f"loader state has unknown fields {unknown}")
        for name in _INT_FIELDS:
            value = data[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise StateError(f"loader state field {name!r} must be an int >= 0, got {value!r}")
        if data["version"] != STATE_VERSION:
            raise StateError(
                f"loader state version {data['version']} is not supported (need {STATE_VERSION})"
            )
        if not isinstance(data["config"], str):
            raise StateError("loader state field 'config' must be a string")
        return cls(**{k: data[k] for k in (*_INT_FIELDS, "config")})
