"""What the status page shows, as plain dataclasses built from the running services.

Each teacher's row carries its own cache counters and the caches its model made
(:func:`teacher_rows`). Cache coverage is the mean teacher probability mass held by the cached
top-k, ``coverage = 1 - mean(tail_mass)`` over rows
(:func:`logitcache.cache_format.stats.tail_summary`: every row of a small cache, 8 evenly spaced
windows of 2048 rows of a large one); the page says how many rows it used. Summaries are memoised
per ``(cache, num_rows)``: a cache is re-read only after it has grown.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from logitcache.cache_format.stats import LOW_COVERAGE

from ...errors import public_message, public_name

if TYPE_CHECKING:
    from logitcache.cache_format import CacheReader

    from ...serving.caches import CacheRegistry


@dataclass(frozen=True)
class CacheSummary:
    """One cache: identity, size and coverage (``None`` when empty or unreadable)."""

    name: str
    k: int
    model: str
    num_sequences: int
    num_rows: int
    stored_bytes: int | None
    bytes_per_position: float | None
    coverage: float | None
    coverage_rows: int
    error: str | None = None

    @property
    def low_coverage(self) -> bool:
        return self.coverage is not None and self.coverage < LOW_COVERAGE


def summarize_cache(name: str, reader: CacheReader) -> CacheSummary:
    """Size (stored bytes, bytes per position) and coverage of one cache."""
    from logitcache.cache_format.stats import store_stats, tail_summary

    m = reader.manifest
    stored = bpp = None
    try:
        st = store_stats(reader.store, m)
        stored, bpp = st.total_bytes, st.bytes_per_position
    except Exception:  # sizes are best-effort (some stores cannot list sizes)
        pass
    tail = tail_summary(reader)
    return CacheSummary(
        name=name,
        k=m.k,
        model=public_name(m.teacher_model),  # a teacher given as a folder: its name only
        num_sequences=reader.num_sequences,
        num_rows=reader.num_rows,
        stored_bytes=stored,
        bytes_per_position=bpp,
        coverage=None if tail is None else tail.coverage,
        coverage_rows=0 if tail is None else tail.rows,
    )


class CacheSummaries:
    """Memoised :func:`summarize_cache` per ``(name, num_rows)`` (thread-safe)."""

    def __init__(self) -> None:
        self._memo: dict[str, tuple[int, CacheSummary]] = {}
        self._lock = threading.Lock()

    def all(self, caches: CacheRegistry) -> list[CacheSummary]:
        out = []
        incomplete = caches.incomplete()
        for name in sorted(set(caches.names()) | set(incomplete)):
            if name in incomplete:
                out.append(_broken(name, Exception(f"incomplete: {incomplete[name]}")))
                continue
            try:
                reader = caches.open_reader(name)
            except Exception as e:  # an empty, incomplete or broken cache is listed, not fatal
                out.append(_broken(name, e))
                continue
            with self._lock:
                hit = self._memo.get(name)
            if hit is not None and hit[0] == reader.num_rows:
                out.append(hit[1])
                continue
            try:
                s = summarize_cache(name, reader)
            except Exception as e:  # noqa: BLE001 - a cache the page cannot summarise is listed
                out.append(_broken(name, e))
                continue
            with self._lock:
                self._memo[name] = (reader.num_rows, s)
            out.append(s)
        return out


def teacher_rows(
    teachers: Sequence[dict[str, Any]],
    caches: Sequence[CacheSummary] | None,
    cache_line: Callable[[str], str],
) -> list[dict[str, Any]]:
    """Each teacher's status row with its cache use and the caches its model made (``"-"``
    when the caches cannot be listed)."""
    out = []
    for t in teachers:
        own = None if caches is None else [c.name for c in caches if c.model == t.get("model")]
        listed = "-" if own is None else ", ".join(own) or "none"
        out.append({**t, "caches": listed, "cache use": cache_line(str(t["name"]))})
    return out


def _broken(name: str, e: Exception) -> CacheSummary:
    msg = public_message(str(e).splitlines()[0]) if str(e) else type(e).__name__
    return CacheSummary(name, 0, "", 0, 0, None, None, None, 0, error=msg)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_seconds(s: float | None) -> str:
    if s is None or not math.isfinite(s):
        return "-"
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"
