"""Server-rendered HTML of the status page and the login form.

Plain HTML and one stylesheet (``static/status.css``): no JavaScript framework, no CDN, no build
step. The status page reloads itself every ``refresh`` seconds with ``<meta http-equiv="refresh">``
(0: never).
Every value from outside (job ids, cache names, error messages) goes through :func:`html.escape`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from html import escape
from typing import Any

from .summary import LOW_COVERAGE, CacheSummary, human_bytes, human_seconds


def _page(title: str, body: str, *, refresh: int = 0) -> str:
    meta = f'<meta http-equiv="refresh" content="{refresh}">' if refresh > 0 else ""
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"{meta}<title>{escape(title)}</title>"
        '<link rel="stylesheet" href="/ui/static/status.css"></head>'
        f"<body>{body}</body></html>"
    )


def login_page(*, error: str | None = None, next_url: str = "/") -> str:
    """The login form: posts the API key to ``/login``, which sets the session cookie."""
    err = f'<p class="err" id="login-error">{escape(error)}</p>' if error else ""
    body = (
        "<h1>logitcache teacher service</h1>"
        '<p class="muted">This service needs its API key.</p>'
        f'<form class="login" method="post" action="/login">{err}'
        '<label for="key">API key</label>'
        '<input id="key" name="key" type="password" autocomplete="current-password" autofocus>'
        f'<input type="hidden" name="next" value="{escape(next_url)}">'
        '<button type="submit">Sign in</button></form>'
        '<p class="muted">API reference: <a href="/docs">/docs</a></p>'
    )
    return _page("logitcache: sign in", body)


def _bar(done: int, total: int) -> str:
    pct = 100.0 * done / total if total else 0.0
    return (
        f'<div class="bar" title="{pct:.1f}%"><div style="width:{pct:.1f}%"></div></div>'
        f'<span class="muted">{pct:.1f}%</span>'
    )


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _cov(x: float | None) -> str:
    if x is None:
        return "-"
    if x < LOW_COVERAGE:
        return f'<span class="warn" title="mean top-k mass below {LOW_COVERAGE}">{x:.3f}</span>'
    return f"{x:.3f}"


@dataclass(frozen=True)
class JobsPage:
    """Where the shown jobs lie in the whole table: ``shown`` jobs from ``offset`` (oldest
    first) of ``total``, pages of ``size``."""

    offset: int
    shown: int
    total: int
    size: int


def jobs_nav(p: JobsPage | None) -> str:
    """``jobs a-b of N`` with links to the earlier/later pages (none when one page holds all)."""
    if p is None or p.total <= p.size:
        return ""
    links = []
    if p.offset > 0:
        links.append(
            f'<a id="jobs-earlier" href="/?jobs_offset={max(0, p.offset - p.size)}">earlier</a>'
        )
    if p.offset + p.shown < p.total:
        links.append(f'<a id="jobs-later" href="/?jobs_offset={p.offset + p.size}">later</a>')
    return (
        f'<p class="muted" id="jobs-paging">jobs {p.offset + 1}-{p.offset + p.shown} of '
        f"{p.total:,} (oldest first) {' '.join(links)}</p>"
    )


def jobs_table(jobs: Sequence[Any]) -> str:
    if not jobs:
        return '<p class="muted" id="no-jobs">No jobs yet.</p>'
    rows = []
    for j in jobs:
        state = str(getattr(j.state, "value", j.state))
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
        if j.error:
            notes.append(f'<span class="err">{escape(j.error)}</span>')
        rows.append(
            f'<tr class="job" data-job="{escape(j.id)}"><td><code>{escape(j.id)}</code></td>'
            f'<td>{escape(j.cache)}</td><td class="state-{escape(state)}">{escape(state)}</td>'
            f"<td>{_bar(j.tokens_done, j.tokens_total)}</td>"
            f'<td class="num">{j.sequences_done:,} / {j.sequences_total:,}</td>'
            f'<td class="num">{j.tokens_done:,} / {j.tokens_total:,}</td>'
            f'<td class="num">{_rate(j.tokens_per_s)}</td>'
            f'<td class="num">{human_seconds(j.eta_s)}</td>'
            f'<td class="num">{_cov(getattr(j, "coverage", None))}</td>'
            f"<td>{'; '.join(notes)}</td></tr>"
        )
    head = (
        "<tr><th>job</th><th>cache</th><th>state</th><th>progress (tokens)</th>"
        "<th>sequences</th><th>tokens</th><th>tokens/s</th><th>ETA</th>"
        "<th>coverage</th><th>notes</th></tr>"
    )
    return f'<table id="jobs">{head}{"".join(rows)}</table>'


def caches_table(caches: Iterable[CacheSummary]) -> str:
    caches = list(caches)
    if not caches:
        return '<p class="muted" id="no-caches">No caches yet.</p>'
    rows = []
    for c in caches:
        if c.error:
            rows.append(
                f'<tr class="cache" data-cache="{escape(c.name)}"><td>{escape(c.name)}</td>'
                f'<td colspan=7 class="err">{escape(c.error)}</td></tr>'
            )
            continue
        cov = "-"
        if c.coverage is not None:
            cov = f"{c.coverage:.3f}"
            if c.low_coverage:
                cov = (
                    f'<span class="warn" title="mean top-k mass below {LOW_COVERAGE}: '
                    f'the top-k misses much of the teacher">{cov} (low)</span>'
                )
            cov += f' <span class="muted">({c.coverage_rows:,} rows)</span>'
        bpp = "-" if c.bytes_per_position is None else f"{c.bytes_per_position:.1f}"
        rows.append(
            f'<tr class="cache" data-cache="{escape(c.name)}"><td>{escape(c.name)}</td>'
            f'<td class="num">{c.k}</td><td class="num">{c.num_sequences:,}</td>'
            f'<td class="num">{c.num_rows:,}</td><td class="num">{human_bytes(c.stored_bytes)}</td>'
            f'<td class="num">{bpp}</td><td class="cov">{cov}</td>'
            f"<td class=muted>{escape(c.model)}</td></tr>"
        )
    head = (
        "<tr><th>cache</th><th>k</th><th>sequences</th><th>rows (positions)</th><th>size</th>"
        "<th>bytes/position</th><th>coverage (mean top-k mass)</th><th>teacher</th></tr>"
    )
    return f'<table id="caches">{head}{"".join(rows)}</table>'


def engine_block(engine: dict[str, Any]) -> str:
    items = "".join(f"<dt>{escape(k)}</dt><dd>{escape(str(v))}</dd>" for k, v in engine.items())
    return f'<dl id="engine">{items}</dl>'


def teachers_table(teachers: Sequence[dict[str, Any]]) -> str:
    """Every teacher's state (:meth:`~logitcache.server.serving.teachers.Teacher.status`), its
    caches and its cache use (:func:`.summary.teacher_rows`)."""
    cols = (
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
    head = "".join(f"<th>{escape(c.replace('_', ' '))}</th>" for c in cols)
    rows = "".join(
        "<tr>" + "".join(f"<td>{escape(str(t.get(c)))}</td>" for c in cols) + "</tr>"
        for t in teachers
    )
    return f'<table id="teachers"><tr>{head}</tr>{rows}</table>'


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
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    logout = (
        '<form method="post" action="/logout" style="display:inline">'
        '<button type="submit" id="logout">Sign out</button></form>'
        if logged_in_by_cookie
        else ""
    )
    if caches is None:
        caches_html = f'<p class="err">{escape(caches_error or "caches unavailable")}</p>'
    else:
        caches_html = caches_table(caches)
    body = (
        f'<nav><a href="/docs">API docs</a><a href="/metrics">metrics</a>{logout}</nav>'
        "<h1>logitcache teacher service</h1>"
        f'<p class="muted">{now}; refreshes every {refresh}s (<a href="/?refresh=0">stop</a>)</p>'
        f"<h2>Engine</h2>{engine_block(engine)}"
        f"<h2>Teachers</h2>{teachers_table(teachers)}"
        f"<h2>Jobs</h2>{jobs_nav(jobs_paging)}{jobs_table(jobs)}"
        f"<h2>Caches</h2>{caches_html}"
    )
    return _page("logitcache status", body, refresh=refresh)
