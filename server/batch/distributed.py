"""Distributed batch scoring with Ray: one dataset, several teacher replicas, one cache.

    python -m logitcache.server.batch.distributed --input data.jsonl --cache s3://bucket/name \\
        --replicas 4 --model /models/teacher -k 64 [any logitcache-server option]

Settings are :class:`~.distributed_config.DistributedSettings`. Before Ray or any engine starts,
the input and an existing target cache are checked (:func:`check_target_early`; a problem is one
JSON line on stderr). Each replica is a Ray actor (:class:`ShardWorker`) owning one engine;
:class:`ray.util.ActorPool` hands out the shards; the steps and their contract are
:mod:`.shards`' (the final cache equals a one-replica run's; a re-run resumes). ``--targets
sampled`` writes sampled targets seeded by (seed, key) only. Scaling to many nodes:
docs/SCALING.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from logitcache.cache_format import FormatError, Manifest
from logitcache.cache_format.identity import teacher_diff
from logitcache.protocol import InputFile
from pydantic import ValidationError

from ..engine.identity import teacher_identity
from ..engine.protocol import SampledTargets
from ..errors import InvalidInputError, ServiceError
from ..inputs import records as inputs
from ..serving.targets import new_manifest
from ..settings import ServerSettings
from . import shards
from .distributed_config import (
    Plan,
    check_asked,
    check_target_early,
    chosen_targets,
    load_distributed_settings,
)

if TYPE_CHECKING:
    from ..engine import EngineInfo, TeacherEngine

log = logging.getLogger("logitcache.server.distributed")

#: Environment variables forwarded to every replica (engine and hub configuration).
FORWARDED_ENV_PREFIXES = ("VLLM_", "HF_", "TRANSFORMERS_", "OMP_", "LOGITCACHE_", "CUDA_", "NCCL_")
#: Tries to start a local Ray cluster (see :func:`init_local_ray`).
START_ATTEMPTS = 3
#: Engine limits every replica must agree on, beside the teacher identity.
ENGINE_LIMITS = ("max_k", "max_seq_len")


class DistributedError(ServiceError, status=500, code="distributed_error"):
    """The Ray cluster or a replica failed in a way that is not the input's fault."""


@dataclass(frozen=True)
class RunReport:
    """What a distributed run did (printed as JSON by the CLI)."""

    cache: str
    staging: str
    replicas: int
    shards: int
    sequences: int
    """Distinct sequences in the input."""
    committed: int
    """Sequences newly committed to the final cache by this run."""
    scored_sequences: int
    scored_tokens: int
    seconds: float
    workers: dict[str, int]
    """Shards scored per replica (``host:pid``)."""
    phases: dict[str, float]
    """Wall seconds of each step: start (engines up), check, score, commit (incl. cleanup)."""
    targets: str = "topk"
    """What the cache holds: ``topk`` rows or ``sampled`` targets."""


# --- the Ray actor -------------------------------------------------------------------------


class ShardWorker:
    """One teacher replica (a Ray actor, :class:`Replicas`): builds its engine once, then checks
    and scores shards on the actor's event loop."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.engine: TeacherEngine | None = None
        self.name = f"{socket.gethostname()}:{os.getpid()}"

    async def start(self) -> EngineInfo:
        """Build the engine (once); return its :class:`EngineInfo`."""
        return (await self._ready()).info

    async def _ready(self) -> TeacherEngine:
        """The engine, built on first use (also by a replica Ray restarted)."""
        if self.engine is None:
            from ..engine import build_engine

            engine = build_engine(self.settings)
            if asyncio.iscoroutine(engine):
                engine = await engine
            self.engine = engine  # type: ignore[assignment]
        return self.engine  # type: ignore[return-value]

    def _limits(self, engine: TeacherEngine) -> inputs.Limits:
        info = engine.info
        # the engine was built from these settings: info.max_seq_len is already within them
        return inputs.Limits(vocab_size=info.vocab_size, max_seq_len=info.max_seq_len)

    async def scan(self, shard: shards.Shard) -> shards.ShardScan:
        engine = await self._ready()
        return shards.scan_shard(shard, engine.tokenize, self._limits(engine))

    async def score(
        self, task: shards.ShardTask, manifest: Manifest, storage_options: dict[str, Any] | None
    ) -> shards.ShardResult:
        engine = await self._ready()
        return await shards.score_shard(
            engine,
            task,
            manifest=manifest,
            limits=self._limits(engine),
            batch_sequences=self.settings.job_batch_sequences,
            batch_tokens=self.settings.job_batch_tokens,
            inflight_batches=self.settings.job_inflight_batches,
            storage_options=storage_options,
            worker=self.name,
            write_fill_s=self.settings.job_write_fill_s,
        )

    def pid(self) -> int:
        """The replica's process id (for operators and crash tests)."""
        return os.getpid()

    async def stop(self) -> None:
        if self.engine is not None:
            await self.engine.aclose()
            self.engine = None


# --- Ray cluster ---------------------------------------------------------------------------


def init_local_ray(num_cpus: int, num_gpus: int | None = None) -> None:
    """Start an in-process single-node Ray cluster bound to 127.0.0.1 only (checked)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    already = "ray._private.ray_constants" in sys.modules
    import ray

    if already:  # the constant was read at import time; the subprocesses read the variable
        ray._private.ray_constants.ENABLE_RAY_CLUSTER = False
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            ray.init(
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                log_to_driver=True,
            )
            break
        except Exception as e:  # Ray raises a bare Exception for this timeout
            # Ray waits a fixed 30 s for its raylet, which an overloaded machine can miss
            if "timed out during startup" not in str(e) or attempt == START_ATTEMPTS:
                raise
            log.warning("Ray start-up timed out (attempt %d); retrying", attempt)
            ray.shutdown()
    addresses = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    if addresses != {"127.0.0.1"}:
        ray.shutdown()
        raise DistributedError(f"local Ray cluster is not bound to 127.0.0.1: {addresses}")


def _forwarded_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}


@contextlib.contextmanager
def _worker_errors() -> Iterator[None]:
    """Re-raise a Ray task error as the worker's own exception (so typed errors stay typed)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - RayTaskError wraps the worker's own exception
        cause = getattr(e, "cause", None)
        if not isinstance(cause, BaseException):
            raise
        raise cause from e


# --- the run -------------------------------------------------------------------------------


def read_input(
    path: Path, *, text_field: str = "text", ids_field: str = "input_ids", id_field: str = "id"
) -> list[inputs.RawRecord]:
    """Raw records of a JSONL or Parquet file (the job input format), in order."""
    path = Path(path).expanduser().resolve()
    spec = InputFile(path=path.name, text_field=text_field, ids_field=ids_field, id_field=id_field)
    return list(inputs.raw_records(file=spec, records=None, data_dir=path.parent))


class Replicas:
    """``count`` started teacher replicas (Ray actors with their engines loaded), reusable
    across runs; exiting the context stops them. ``plan.gpus_per_replica=None`` reserves
    ``tensor x pipeline`` GPUs when the cluster has GPUs."""

    def __init__(
        self,
        settings: ServerSettings,
        count: int,
        plan: Plan | None = None,
        *,
        worker_cls: type[ShardWorker] | None = None,
    ):
        import ray

        plan = plan or Plan()
        if count < 1:
            raise InvalidInputError(f"replicas must be >= 1, got {count}")
        total = ray.cluster_resources()
        gpus = plan.gpus_per_replica
        if gpus is None:
            has_gpu = total.get("GPU", 0) > 0
            gpus = settings.tensor_parallel_size * settings.pipeline_parallel_size if has_gpu else 0
        for name, each in (("CPU", plan.cpus_per_replica), ("GPU", gpus)):
            if count * each > total.get(name, 0):
                # Ray would wait forever for resources the cluster does not have
                raise DistributedError(
                    f"{count} replica(s) x {each} {name} exceed the cluster's "
                    f"{total.get(name, 0):g} {name}"
                )
        actor_cls = ray.remote(worker_cls or ShardWorker).options(
            num_cpus=plan.cpus_per_replica,
            num_gpus=gpus,
            max_restarts=plan.max_restarts,
            max_task_retries=plan.max_restarts,
            runtime_env={"env_vars": _forwarded_env()},
        )
        t0 = time.perf_counter()
        self.actors = [actor_cls.remote(settings) for _ in range(count)]
        try:
            self.info = _agreed_info(_get([a.start.remote() for a in self.actors]))
        except BaseException:  # interrupted too: no replica outlives a failed start
            self._kill()
            raise
        self.start_seconds = time.perf_counter() - t0

    def _kill(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)
        self.actors = []

    def close(self) -> None:
        """Stop the engines, then the actors."""
        try:
            if self.actors:
                _get([a.stop.remote() for a in self.actors])
        finally:
            self._kill()

    def __enter__(self) -> Replicas:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_distributed(
    raws: Sequence[inputs.RawRecord],
    cache_url: str,
    settings: ServerSettings,
    plan: Plan,
    *,
    dataset: str = "",
    staging_root: str | None = None,
    on_event: Callable[[str], None] | None = None,
    replicas: Replicas | None = None,
    worker_cls: type[ShardWorker] | None = None,
    progress: bool = False,
    targets: SampledTargets | str | None = None,
) -> RunReport:
    """Score ``raws`` into the cache at ``cache_url`` with ``plan.replicas`` teacher replicas
    on a connected Ray cluster. ``replicas``: started ones to use (else started and stopped
    here, of ``worker_cls``). ``targets``: ``None`` for top-``max_k`` rows, a
    :class:`~.engine.SampledTargets`, or ``"sampled"`` (an existing cache's parameters, else the
    defaults). A bad input, target or cache of another teacher is refused before anything is
    written; ``progress``: tqdm bars on stderr."""
    from ray.util import ActorPool

    say = on_event or log.info
    t0 = time.perf_counter()
    if plan.replicas < 1:
        raise InvalidInputError(f"replicas must be >= 1, got {plan.replicas}")
    check_asked(targets)  # the parameters' own ranges, before any replica starts
    cache_url = cache_url.rstrip("/")
    staging = (staging_root or f"{cache_url}.staging").rstrip("/")
    options = dict(settings.storage_options) or None
    work = shards.plan_shards(raws, plan.shard_size)
    n = min(plan.replicas, len(work))
    own = replicas is None
    if replicas is None:
        replicas = Replicas(settings, n, plan, worker_cls=worker_cls)
    elif len(replicas.actors) < n:
        raise InvalidInputError(f"{n} replicas asked for, {len(replicas.actors)} started")
    phases: dict[str, float] = {"start": round(replicas.start_seconds, 3) if own else 0.0}
    mark = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        phases[name] = round(now - mark, 3)
        mark = now

    try:
        info = replicas.info
        say(f"{n} replica(s) up: {info.model_id} (vocab {info.vocab_size})")
        chosen = chosen_targets(targets, shards.stored_manifest(cache_url, options), info)
        manifest = new_manifest(info, settings, info.max_k, dataset, chosen)
        committed = shards.check_target(cache_url, manifest, options)

        pool = ActorPool(replicas.actors[:n])
        scans = _gather(
            pool.map_unordered(lambda a, s: a.scan.remote(s), work),
            _bar(progress, "check", len(work)),
        )
        skips = shards.check_scans(scans, committed)
        total = len({k for s in scans for k in s.keys})
        say(f"input checked: {len(work)} shard(s), {total} sequences, {len(committed)} committed")
        lap("check")

        stage_manifest = shards.staging_manifest(manifest, cache_url)
        tasks = [
            shards.ShardTask(s, shards.staging_url(staging, s.index), skips[s.index]) for s in work
        ]
        results = _gather(
            pool.map_unordered(lambda a, t: a.score.remote(t, stage_manifest, options), tasks),
            _bar(progress, "score", len(tasks)),
        )
        lap("score")
        say(f"scored {sum(r.scored_sequences for r in results)} sequences; committing")
    finally:
        if own:
            replicas.close()
    mark = time.perf_counter()
    added = shards.commit(results, cache_url, manifest, options)
    if not plan.keep_staging:
        shards.remove_staging(staging, options)
    lap("commit")
    workers: dict[str, int] = {}
    for r in results:
        workers[r.worker] = workers.get(r.worker, 0) + 1
    return RunReport(
        cache=cache_url,
        staging=staging,
        replicas=n,
        shards=len(work),
        sequences=total,
        committed=added,
        scored_sequences=sum(r.scored_sequences for r in results),
        scored_tokens=sum(r.scored_tokens for r in results),
        seconds=time.perf_counter() - t0,
        workers=workers,
        phases=phases,
        targets=manifest.targets,
    )


def _get(refs: list[Any]) -> list[Any]:
    import ray

    with _worker_errors():
        return ray.get(refs)


def _bar(enabled: bool, what: str, shards_total: int) -> Any:
    """A tqdm bar over shards on stderr (None when disabled)."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=shards_total, desc=what, unit="shard", file=sys.stderr, dynamic_ncols=True)


def _gather(results: Any, bar: Any = None) -> list[Any]:
    """Drain an ActorPool result iterator (re-raising a worker's own exceptions), advancing bar."""
    out: list[Any] = []
    seqs = tokens = 0
    try:
        with _worker_errors():
            for r in results:
                out.append(r)
                if bar is not None:
                    if isinstance(r, shards.ShardResult):
                        seqs += r.scored_sequences
                        tokens += r.scored_tokens
                        bar.set_postfix(sequences=seqs, tokens=tokens, refresh=False)
                    bar.update(1)
        return out
    finally:
        if bar is not None:
            bar.close()


def _agreed_info(infos: list[EngineInfo]) -> EngineInfo:
    """The replicas' common engine description; DistributedError if they disagree."""
    first = infos[0]
    for other in infos[1:]:
        diff = sorted(teacher_diff(teacher_identity(other), teacher_identity(first)))
        diff += [f for f in ENGINE_LIMITS if getattr(other, f) != getattr(first, f)]
        if diff:
            raise DistributedError(f"replicas loaded different teachers (fields {diff})")
    return first


# --- CLI -----------------------------------------------------------------------------------


def _fail(code: str, message: str, detail: Any = None) -> None:
    """One JSON line on stderr (the CLI's error form)."""
    body: dict[str, Any] = {"error": code, "message": message}
    if detail is not None:
        body["detail"] = detail
    print(json.dumps(body), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; prints the :class:`RunReport` as JSON. Exit 2 on bad input or settings,
    1 on a cluster failure (one JSON line on stderr)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        args = load_distributed_settings(sys.argv[1:] if argv is None else argv)
    except ValidationError as e:
        why = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        _fail("invalid_settings", why)
        return 2
    settings = args.server_settings()
    try:  # before Ray starts: a missing/mistyped --model is one line (server/preflight.py)
        from ..preflight import PreflightError, check_model

        check_model(settings.model)
    except PreflightError as e:
        _fail("invalid_model", str(e))
        return 2
    plan = args.plan()
    import ray

    started = False  # this call started or joined a Ray cluster (and so shuts it down)
    try:
        raws = read_input(
            args.input, text_field=args.text_field, ids_field=args.ids_field, id_field=args.id_field
        )
        asked = args.sampled_targets()
        check_target_early(settings, args.cache.rstrip("/"), asked)
        if args.ray_address is None:
            cpus = args.num_cpus or max(1, int(plan.replicas * plan.cpus_per_replica))
            init_local_ray(cpus, args.num_gpus)
        else:
            ray.init(address=args.ray_address)
        started = True
        report = run_distributed(
            raws,
            args.cache,
            settings,
            plan,
            dataset=args.dataset or str(args.input.name),
            staging_root=args.staging,
            progress=args.progress,
            targets=asked,
        )
    except ServiceError as e:
        _fail(e.code, e.message, e.detail)
        return 2 if e.status < 500 else 1
    except FormatError as e:  # e.g. an existing cache made with another teacher
        _fail(type(e).__name__, str(e))
        return 2
    finally:
        if started:
            ray.shutdown()
    text = json.dumps(asdict(report), indent=2)
    if args.report is not None:
        args.report.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
