"""logitcache.server: the teacher service (FastAPI + uvicorn around one teacher engine).

Run it with ``logitcache-server --model DIR -k 20 --store-root caches`` (or ``python -m
logitcache.server``; every option is also a ``LOGITCACHE_*`` environment variable, see
:mod:`~logitcache.server.settings`). The HTTP API is described in ``server/API.md`` and in the
OpenAPI document at ``/openapi.json`` (``/docs`` renders it).

Module map (one job each; routes hold no logic, services import no FastAPI). The request and
response models, media types and job states are :mod:`logitcache.protocol` (shared with the
client).

========================  ========================================================================
``settings``              ``ServerSettings`` (pydantic-settings: env, ``.env``, CLI)
``errors``                typed service errors and their one mapping to HTTP
``inputs``                reading, tokenising, checking, keying and batching input sequences
``pipeline``              the one batch pipeline: batches -> engine -> records -> ordered appends
``scoring``               ``ScoringService``: on-demand scoring (+ optional store)
``caches``                ``CacheRegistry``: named caches, identity checks, shared writers
``job_store``             the SQLite job table
``jobs``                  ``JobRunner``: background jobs, restart-safe resume, cancel
``shards``                sharded batch scoring: plan, check, score into staging, commit
``distributed``           the Ray driver and ``logitcache-distributed`` CLI over ``shards``
``metrics``               Prometheus metrics of one app
``middleware``            API key, body-size limit, request metrics (pure ASGI)
``routes_*``              thin routers: score, jobs, caches (block streaming), ops
``app``                   ``create_app(settings, engine=None)``: lifespan owns engine + runner
``__main__``              ``main()``: uvicorn
``engine*``               the teacher engines (vLLM, transformers) behind ``TeacherEngine``
========================  ========================================================================
"""
