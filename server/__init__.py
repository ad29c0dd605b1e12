"""logitcache.server: the teacher service (FastAPI + uvicorn around one teacher engine).

Run it with ``logitcache-server --model DIR -k 20 --store-root caches`` (or ``python -m
logitcache.server``; every option is also a ``LOGITCACHE_*`` environment variable, see
:mod:`~logitcache.server.settings`). The HTTP API is described in ``server/API.md`` and in the
OpenAPI document at ``/openapi.json`` (``/docs`` renders it).

Module map (one job each; routes hold no logic, services import no FastAPI). The request and
response models, media types and job states are :mod:`logitcache.protocol` (shared with the
client).

=============================  ===================================================================
``app``                        ``create_app(settings, engine=None)``: lifespan owns engine + runner
``__main__``                   ``main()``: uvicorn
``settings``                   ``ServerSettings`` (pydantic-settings: env, ``.env``, CLI)
``errors``                     typed service errors and their one mapping to HTTP
``metrics``                    Prometheus metrics of one app
``admission``                  ``TokenGate``: the budget of on-demand prompt tokens in flight
``preflight``                  fail-fast start-up checks and the start-up banner
``paths``                      the one check of keys and paths from requests against their root
``api.deps``                   ``Services`` (the per-app container) and ``ServicesDep``
``api.middleware``             API key, body-size limit, request metrics (pure ASGI)
``api.connections``            uvicorn's options: request-head deadline, connection limit
``api.score``                  ``POST /v1/score``
``api.openai``                 vLLM-compatible ``/v1/completions`` and ``/v1/models``
``api.sglang``                 SGLang-compatible ``/generate`` (input logprobs)
``api.vllm_generate``          vLLM-compatible ``/inference/v1/generate`` (logprobs at chosen ids)
``api.jobs``                   ``/v1/jobs``: submit, list, status, cancel
``api.caches``                 ``/v1/caches``: list, describe, stream blocks
``api.store``                  ``/v1/caches/{name}/store/{key}``: the stored objects, read-only
``api.ops``                    ``/health`` and ``/metrics``
``api.ui``                     the browser pages: status page, login, ``/docs``
``serving.teachers``           ``TeacherPool``: teachers routed by ``model``, loaded within a budget
``serving.scoring``            ``ScoringService``: on-demand scoring (+ optional store)
``serving.cache_hits``         serving scores from a named cache (hits read, misses scored)
``serving.targets``            the target kind of a request or job (top-k or sampled)
``serving.chosen``             logprobs at caller-chosen ids: cached, or exact from the engine
``serving.caches``             ``CacheRegistry``: named caches, identity checks, shared writers
``serving.readers``            the kept reader per cache, refreshed for a lookup only when needed
``serving.appends``            ``GroupCommitter``: concurrent requests' misses, one commit per group
``inputs.records``             reading, tokenising, checking, keying and batching input sequences
``inputs.files``               input files: gzip JSONL, Parquet, Arrow, dataset directories
``inputs.chat``                chat records rendered with the teacher's chat template
``inputs.long``                sequences over the max length: split, skip or refuse; input counts
``inputs.jsonids``             fast parsing of JSONL token-id lists (``_jsonkernels``: numba)
``batch.job_store``            the SQLite job table
``batch.jobs``                 ``JobRunner``: background jobs, restart-safe resume, cancel
``batch.pipeline``             the one batch pipeline: batches -> engine -> records -> appends
``batch.parts``                an engine batch's rows handed to the writer as views, no copies
``batch.progress``             a job run's throughput and coverage; the append-then-progress step
``batch.shards``               sharded batch scoring: plan, check, score into staging, commit
``batch.distributed``          the Ray driver, ``logitcache-distributed``, over ``batch.shards``
``batch.distributed_config``   its settings, cluster plan, targets and early cache check
``engine``                     the teacher engines (vLLM, transformers) behind ``TeacherEngine``
=============================  ===================================================================
"""
