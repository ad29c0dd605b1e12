"""Routes of the browser UI and :func:`install`, which ``create_app`` calls: the status page
``GET /`` (the login form without the key), ``POST /login`` and ``/logout`` (:mod:`.auth`), and
``GET /docs`` (Swagger UI from the ``fastapi-offline`` package's files, no CDN; only its files
are used, not its code). The OpenAPI schema declares an HTTP Bearer scheme when the server has
an API key. What each page shows: ``server/API.md``.

``/``, ``/login``, ``/logout``, ``/docs``, ``/openapi.json`` and ``/ui/static/*`` are public at
the middleware (:data:`PUBLIC_PATHS`, :data:`PUBLIC_PREFIXES`); ``/`` checks the key itself.
"""

from __future__ import annotations

import asyncio
import importlib.util
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response

from ...errors import public_message, public_name
from ..deps import public_status
from . import auth, pages
from .summary import CacheSummaries, teacher_rows

if TYPE_CHECKING:
    from ...settings import ServerSettings

#: Paths the API-key middleware lets through (the routes below check what they must).
PUBLIC_PATHS = frozenset({"/", "/login", "/logout", "/docs", "/openapi.json"})
#: Path prefixes the API-key middleware lets through.
PUBLIC_PREFIXES = ("/ui/static/",)

STATIC = "/ui/static"
#: The Swagger UI files served from the ``fastapi-offline`` package's ``static`` folder.
SWAGGER_FILES = frozenset({"swagger-ui.css", "swagger-ui-bundle.js", "favicon.png"})
#: The pages' own files, in ``static/`` beside this module (``docs.html``: the Swagger UI page).
OWN_STATIC = Path(__file__).parent / "static"
OWN_FILES = frozenset({"status.css"})

#: Jobs per page of the status page's jobs table (the newest page by default).
JOBS_PAGE = 100

#: Seconds between automatic reloads of the status page (``?refresh=N`` overrides; 0: never).
DEFAULT_REFRESH = 5

router = APIRouter(include_in_schema=False)


def swagger_dir() -> Path | None:
    """Folder of the Swagger UI assets (``fastapi_offline/static``), or None if not installed."""
    spec = importlib.util.find_spec("fastapi_offline")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "static"
    return folder if (folder / "swagger-ui-bundle.js").is_file() else None


def _settings(request: Request) -> ServerSettings:
    return request.app.state.ui_settings


def _sessions(request: Request) -> auth.Sessions:
    return request.app.state.ui_sessions


def _api_key(request: Request) -> str | None:
    key = _settings(request).api_key
    return key.get_secret_value() if key is not None else None


def _authorized(request: Request) -> tuple[bool, bool]:
    """``(authorized, by_cookie)`` for this request."""
    key = _api_key(request)
    if key is None:
        return True, False
    header = request.headers.get("authorization", "")
    if secrets.compare_digest(header.encode(), f"Bearer {key}".encode()):
        return True, False
    ok = _sessions(request).cookie_ok(request.headers.get("cookie"))
    return ok, ok


def _engine_state(request: Request) -> dict[str, Any]:
    settings = _settings(request)
    services = getattr(request.app.state, "services", None)
    if services is None:
        return {
            "state": "starting (loading the teacher) or stopping",
            "model": public_name(settings.model),
        }
    running = getattr(services.jobs, "_current", None)
    teacher = services.teachers.default
    if teacher.engine is None or teacher.scoring is None:
        return {"state": f"ready (default teacher {teacher.state})", "model": teacher.name}
    info = teacher.engine.info
    return {
        "state": "ready",
        "model": public_name(info.model_id),
        "backend": info.backend,
        "dtype": info.dtype,
        "vocab size": info.vocab_size,
        "k (default / max)": f"{teacher.scoring.default_k} / {info.max_k}",
        "max sequence length": teacher.scoring.limits.max_seq_len,
        "temperature": info.temperature,
        "on-demand requests in flight": teacher.scoring.active,
        "served from caches": services.metrics.cache_line(teacher.name),
        "running job": running or "none",
        # last components only: no page shows where the server keeps its files
        "store root": public_name(str(services.caches.root)),
        "data dir": public_name(str(Path(settings.data_dir).expanduser().absolute())),
    }


def jobs_page(jobs: Any, offset: int | None) -> tuple[list[Any], pages.JobsPage]:
    """One page of :data:`JOBS_PAGE` jobs (oldest first) and where it lies (``offset`` None: the
    newest page)."""
    total = jobs.store.count()
    last = max(0, total - JOBS_PAGE)
    start = last if offset is None else min(max(0, offset), last)
    page = [public_status(j) for j in jobs.list(limit=JOBS_PAGE, offset=start)]
    return page, pages.JobsPage(offset=start, shown=len(page), total=total, size=JOBS_PAGE)


@router.get("/", response_class=HTMLResponse)
async def status_page(
    request: Request, refresh: int = DEFAULT_REFRESH, jobs_offset: int | None = None
) -> Response:
    ok, by_cookie = _authorized(request)
    if not ok:
        return HTMLResponse(pages.login_page())
    services = getattr(request.app.state, "services", None)
    jobs: list[Any] = []
    paging = None
    caches = None
    caches_error = None
    if services is not None:
        jobs, paging = await asyncio.to_thread(jobs_page, services.jobs, jobs_offset)
        summaries: CacheSummaries = request.app.state.ui_caches
        try:
            caches = await asyncio.to_thread(summaries.all, services.caches)
        except Exception as e:  # the page must render even if the store is unreachable
            caches_error = public_message(f"cannot list caches: {e}")
    html = pages.status_page(
        engine=_engine_state(request),
        teachers=[]
        if services is None
        else teacher_rows(services.teachers.status(), caches, services.metrics.cache_line),
        jobs=jobs,
        jobs_paging=paging,
        caches=caches,
        caches_error=caches_error,
        refresh=max(0, refresh),
        logged_in_by_cookie=by_cookie,
    )
    return HTMLResponse(html)


def _safe_next(url: str) -> str:
    """Only same-site absolute paths (no ``//host`` or scheme) are followed after login."""
    return url if url.startswith("/") and not url.startswith("//") else "/"


@router.post("/login")
async def login(request: Request) -> Response:
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    given = (form.get("key") or [""])[0]
    next_url = _safe_next((form.get("next") or ["/"])[0])
    key = _api_key(request)
    if key is None:
        return RedirectResponse(next_url, status_code=303)
    if not secrets.compare_digest(given.encode(), key.encode()):
        return HTMLResponse(pages.login_page(error="Wrong API key.", next_url=next_url), 401)
    resp = RedirectResponse(next_url, status_code=303)
    resp.set_cookie(
        auth.COOKIE,
        _sessions(request).start(),
        max_age=int(_settings(request).session_ttl_s),
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/",
    )
    return resp


@router.post("/logout")
async def logout(request: Request) -> Response:
    _sessions(request).end(auth.cookie_from_header(request.headers.get("cookie", "")))
    resp = RedirectResponse("/", status_code=303)
    resp.delete_cookie(auth.COOKIE, path="/")
    return resp


@router.get("/docs", response_class=HTMLResponse)
async def docs(request: Request) -> Response:
    if swagger_dir() is None:
        return HTMLResponse(
            "<p>Swagger UI assets are not installed (pip install fastapi-offline); "
            'the schema is at <a href="/openapi.json">/openapi.json</a>.</p>',
            503,
        )
    return FileResponse(OWN_STATIC / "docs.html")


@router.get(STATIC + "/{name}")
async def static(name: str) -> Response:
    folder = OWN_STATIC if name in OWN_FILES else swagger_dir()
    if folder is None or name not in SWAGGER_FILES | OWN_FILES:
        return Response(status_code=404)
    return FileResponse(folder / name, headers={"cache-control": "public, max-age=86400"})


def _with_bearer_scheme(app: FastAPI) -> None:
    """Declare ``bearerAuth`` (HTTP Bearer) in the schema, required by all operations but the
    public ones (``/health``)."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = base()
        comps = schema.setdefault("components", {})
        comps.setdefault("securitySchemes", {})["bearerAuth"] = {
            "type": "http",
            "scheme": "bearer",
            "description": "the server's API key (--api-key / LOGITCACHE_API_KEY)",
        }
        schema["security"] = [{"bearerAuth": []}]
        for path, ops in schema.get("paths", {}).items():
            if path == "/health":
                for op in ops.values():
                    if isinstance(op, dict):
                        op["security"] = []
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def install(app: FastAPI, settings: ServerSettings) -> None:
    """Add the UI routes to ``app`` (built with ``docs_url=None, redoc_url=None``)."""
    app.state.ui_settings = settings
    app.state.ui_caches = CacheSummaries()
    app.state.ui_sessions = auth.Sessions(settings.session_ttl_s)
    app.include_router(router)
    if settings.api_key is not None:
        _with_bearer_scheme(app)
