"""The FastAPI application factory: ``create_app(settings, engine=None)``.

No import-time singletons: every app owns its settings, metrics registry, engine and job runner.
The lifespan builds the engine, supervised (restarted when it dies; unless one is given, e.g. by a
test or an embedding program, in which case the caller keeps ownership and closes it), opens the
job table, starts the job runner (resuming interrupted jobs), and on shutdown stops the runner,
commits the queued on-demand appends, closes the cache writers and the engine it built.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.routing import APIRoute
from logitcache.cache_format.store import remove_partials

from .api import caches as routes_caches
from .api import jobs as routes_jobs
from .api import openai, sglang, ui, vllm_generate
from .api import ops as routes_ops
from .api import score as routes_score
from .api import store as routes_store
from .api.deps import Services
from .api.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    InternalErrorMiddleware,
    MetricsMiddleware,
    TeacherPrefixMiddleware,
)
from .batch.job_store import JobStore
from .batch.jobs import JobRunner
from .errors import install_error_handlers
from .metrics import Metrics
from .serving.caches import CacheRegistry, is_url
from .serving.teachers import TeacherPool
from .settings import ServerSettings

if TYPE_CHECKING:
    from .engine import TeacherEngine

log = logging.getLogger("logitcache.server")


def _operation_id(route: APIRoute) -> str:
    """Stable OpenAPI operation ids: ``<tag>-<function name>``."""
    tag = route.tags[0] if route.tags else "default"
    return f"{tag}-{route.name}"


#: Age after which a ``*.partial`` temporary file under a local store root is a crash leftover.
PARTIAL_MAX_AGE_S = 300.0
#: Period of the maintenance task (job pruning, ``*.partial`` cleanup).
MAINTENANCE_PERIOD_S = 3600.0


def maintain(store: JobStore, caches: CacheRegistry, settings: ServerSettings) -> None:
    """Prune finished jobs past ``job_retention_s``, clean old ``*.partial`` files and warn about
    stores whose creation was interrupted."""
    pruned = store.prune(settings.job_retention_s)
    if pruned:
        log.info("pruned %d finished job(s) older than %g s", pruned, settings.job_retention_s)
    cleaned = 0 if is_url(caches.root) else remove_partials(caches.root, PARTIAL_MAX_AGE_S)
    if cleaned:
        log.info("removed %d leftover *.partial file(s) under the store root", cleaned)
    for name, reason in caches.incomplete().items():
        log.warning("cache %r is incomplete: %s", name, reason)


async def _maintenance(store: JobStore, caches: CacheRegistry, settings: ServerSettings) -> None:
    while True:
        await asyncio.sleep(MAINTENANCE_PERIOD_S)
        try:
            await asyncio.to_thread(maintain, store, caches, settings)
        except Exception:  # noqa: BLE001 - maintenance must never stop the server
            log.exception("maintenance failed")


#: Paths whose operations answer without services or the key (no 401/503 to declare).
_NO_SERVICE_PATHS = frozenset({"/openapi.json", "/docs", "/login", "/logout", "/"})


def declare_common_errors(app: FastAPI, *, keyed: bool) -> None:
    """Declare in ``/openapi.json`` the error answers the middleware and app state give every
    operation (401, 503; with a body 400, 408, 413, 422) as
    :class:`~logitcache.protocol.ErrorResponse`."""
    from .api.middleware import PUBLIC_PATHS

    build = app.openapi
    ref = {
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    }
    common = {
        "401": "missing or wrong API key",
        "503": "starting, stopping, or the engine is unavailable",
    }
    with_body = {
        "400": "body is not parsable",
        "408": "request body sent too slowly",
        "413": "request body over the size limit",
        "422": "invalid request",
    }

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        for path, ops in schema.get("paths", {}).items():
            if path in _NO_SERVICE_PATHS:
                continue
            for op in ops.values():
                if not isinstance(op, dict) or "responses" not in op:
                    continue
                responses = op["responses"]
                for status, what in common.items():
                    if status == "401" and (not keyed or path in PUBLIC_PATHS):
                        continue
                    responses.setdefault(status, {"description": what, **ref})
                if "requestBody" in op:
                    for status, what in with_body.items():
                        responses.setdefault(status, {"description": what, **ref})
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(
    settings: ServerSettings,
    engine: TeacherEngine | None = None,
    *,
    build: Callable[[ServerSettings], TeacherEngine] | None = None,
) -> FastAPI:
    """A new app serving ``settings``' teachers (``engine``: the default teacher's, not closed;
    ``build``: makes a teacher's engine, default the configured backend, supervised)."""
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = JobStore(settings.job_db_path)
        caches = CacheRegistry(settings.store_root, settings.storage_options)
        teachers = TeacherPool(settings, caches, metrics, build=build, engine=engine)
        try:
            await teachers.start()
        except BaseException:
            caches.close()
            store.close()
            raise
        runner = JobRunner(
            store=store, teachers=teachers, caches=caches, settings=settings, metrics=metrics
        )
        await asyncio.to_thread(maintain, store, caches, settings)
        await runner.start()
        upkeep = asyncio.create_task(_maintenance(store, caches, settings), name="maintenance")
        app.state.services = Services(
            settings=settings, teachers=teachers, caches=caches, jobs=runner, metrics=metrics
        )
        first = teachers.default.engine
        assert first is not None  # loaded by teachers.start()
        names = ",".join(teachers.teachers)
        log.info("serving %s (k<=%d) from %s", names, first.info.max_k, caches.root)
        try:
            yield
        finally:
            app.state.services = None
            upkeep.cancel()
            await runner.stop()
            await teachers.aclose()
            caches.close()
            store.close()

    app = FastAPI(
        title="logitcache teacher service",
        summary="Teacher top-k logprobs on demand and as batch jobs into Zarr caches",
        version="1",
        lifespan=lifespan,
        generate_unique_id_function=_operation_id,
        docs_url=None,  # /docs is served by server/api/ui with local assets (no CDN)
        redoc_url=None,
    )
    app.state.services = None
    app.state.metrics = metrics
    routers = (routes_ops, routes_score, routes_jobs, routes_caches, routes_store)
    for module in (*routers, openai, sglang, vllm_generate):
        app.include_router(module.router)
    ui.install(app, settings)  # status page at /, login form, /docs, Bearer scheme
    install_error_handlers(app)
    declare_common_errors(app, keyed=settings.api_key is not None)
    # Outermost last: metrics see everything; the key is checked before the body is read.
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_request_bytes,
        timeout_s=settings.body_timeout_s,
        deadline_s=settings.body_deadline_s,
    )
    if settings.api_key is not None:
        app.add_middleware(
            ApiKeyMiddleware,
            api_key=settings.api_key.get_secret_value(),
            sessions=app.state.ui_sessions,
        )
    app.add_middleware(InternalErrorMiddleware)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.add_middleware(TeacherPrefixMiddleware)  # before all: they see the teacher's path
    return app
