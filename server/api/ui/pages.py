"""Server-rendered HTML of the status page and the login form: Jinja templates in
``templates/`` (autoescaped: every value from outside, such as job ids, cache names and error
messages, is escaped) and one stylesheet (``static/status.css``); no JavaScript framework, no
CDN, no build step. The status page reloads itself every ``refresh`` seconds with
``<meta http-equiv="refresh">`` (0: never).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jinja2

from .summary import LOW_COVERAGE, CacheSummary, human_bytes, human_seconds

_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
    autoescape=True,
    trim_blocks=True,
    lstrip_blocks=True,
    undefined=jinja2.StrictUndefined,
)
_ENV.filters.update(n="{:,}".format, bytes=human_bytes, seconds=human_seconds)

#: The columns of the teachers table (keys of :func:`.summary.teacher_rows`' rows).
TEACHER_COLUMNS = (
    "name",
    "model",
    "backend",
    "state",
    "in_flight",
    "memory_bytes",
    "loads",
    "caches",
    "cache use",
)


def login_page(*, error: str | None = None, next_url: str = "/") -> str:
    """The login form: posts the API key to ``/login``, which sets the session cookie."""
    return _ENV.get_template("login.html").render(error=error, next_url=next_url)


@dataclass(frozen=True)
class JobsPage:
    """Where the shown jobs lie in the whole table: ``shown`` jobs from ``offset`` (oldest
    first) of ``total``, pages of ``size``."""

    offset: int
    shown: int
    total: int
    size: int


def _job_row(j: Any) -> tuple[Any, str, str, list[str], str | None]:
    """A job with its state, progress percentage, notes on its input, and error."""
    pct = 100.0 * j.tokens_done / j.tokens_total if j.tokens_total else 0.0
    counts = getattr(j, "input", None)
    notes = []
    if counts is not None:
        if counts.duplicates:
            notes.append(f"{counts.duplicates} duplicate(s) dropped")
        if counts.skipped:
            notes.append(f"{counts.skipped} skipped (too long)")
        if counts.truncated:
            notes.append(f"{counts.truncated} truncated")
        if counts.split:
            notes.append(f"{counts.split} split into {counts.windows} windows")
    return j, str(getattr(j.state, "value", j.state)), f"{pct:.1f}", notes, j.error


def status_page(
    *,
    engine: dict[str, Any],
    teachers: Sequence[dict[str, Any]] = (),
    jobs: Sequence[Any],
    caches: Iterable[CacheSummary] | None,
    jobs_paging: JobsPage | None = None,
    refresh: int,
    logged_in_by_cookie: bool,
    caches_error: str | None = None,
) -> str:
    """The status page: engine, teachers (:meth:`~..serving.teachers.Teacher.status` with
    :func:`.summary.teacher_rows`), one page of jobs, and every cache."""
    return _ENV.get_template("status.html").render(
        now=datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        refresh=refresh,
        logged_in_by_cookie=logged_in_by_cookie,
        engine=engine,
        teacher_cols=TEACHER_COLUMNS,
        teachers=teachers,
        paging=jobs_paging,
        jobs=[_job_row(j) for j in jobs],
        caches=None if caches is None else list(caches),
        caches_error=caches_error,
        low=LOW_COVERAGE,
    )
