"""The FastAPI application factory: ``create_app(settings, engine=None)``.

No import-time singletons: every app owns its settings, metrics registry, engine and job runner.
The lifespan builds the engine (unless one is given, e.g. by a test or an embedding program, in
which case the caller keeps ownership and closes it), opens the job table, starts the job runner
(resuming interrupted jobs), and on shutdown stops the runner, closes the cache writers and the
engine it built.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.routing import APIRoute

from . import routes_caches, routes_jobs, routes_ops, routes_score, ui
from .caches import CacheRegistry
from .deps import Services
from .errors import install_error_handlers
from .job_store import JobStore
from .jobs import JobRunner
from .metrics import Metrics
from .middleware import ApiKeyMiddleware, BodyLimitMiddleware, MetricsMiddleware
from .scoring import ScoringService
from .settings import ServerSettings

if TYPE_CHECKING:
    from .engine import TeacherEngine

log = logging.getLogger("logitcache.server")


def _operation_id(route: APIRoute) -> str:
    """Stable OpenAPI operation ids: ``<tag>-<function name>``."""
    tag = route.tags[0] if route.tags else "default"
    return f"{tag}-{route.name}"


async def _build_engine(settings: ServerSettings) -> TeacherEngine:
    from .engine import build_engine

    engine = build_engine(settings)
    if asyncio.iscoroutine(engine):
        engine = await engine
    return engine  # type: ignore[return-value]


def create_app(settings: ServerSettings, engine: TeacherEngine | None = None) -> FastAPI:
    """A new app serving ``settings``; with ``engine`` given, that engine is used (not closed)."""
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        own_engine = engine is None
        eng = await _build_engine(settings) if engine is None else engine
        store = JobStore(settings.job_db_path)
        caches = CacheRegistry(settings.store_root, settings.storage_options)
        scoring = ScoringService(engine=eng, caches=caches, settings=settings, metrics=metrics)
        runner = JobRunner(
            store=store, scoring=scoring, caches=caches, settings=settings, metrics=metrics
        )
        await runner.start()
        app.state.services = Services(
            settings=settings,
            engine=eng,
            caches=caches,
            scoring=scoring,
            jobs=runner,
            metrics=metrics,
        )
        log.info("serving %s (k<=%d) from %s", eng.info.model_id, eng.info.max_k, caches.root)
        try:
            yield
        finally:
            app.state.services = None
            await runner.stop()
            caches.close()
            store.close()
            if own_engine:
                await eng.aclose()

    app = FastAPI(
        title="logitcache teacher service",
        summary="Teacher top-k logprobs on demand and as batch jobs into Zarr caches",
        version="1",
        lifespan=lifespan,
        generate_unique_id_function=_operation_id,
        docs_url=None,  # /docs is served by server/ui with local assets (no CDN)
        redoc_url=None,
    )
    app.state.services = None
    app.state.metrics = metrics
    for module in (routes_ops, routes_score, routes_jobs, routes_caches):
        app.include_router(module.router)
    ui.install(app, settings)  # status page at /, login form, /docs, Bearer scheme
    install_error_handlers(app)
    # Outermost last: metrics see everything; the key is checked before the body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    if settings.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key.get_secret_value())
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app
