"""What a distributed run is asked to do, known before Ray or any engine starts: the
``logitcache-distributed`` settings, the :class:`Plan` of the cluster, the sampled-target
parameters, and the early check of an existing target cache (:func:`check_target_early`)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from logitcache.cache_format import Manifest
from logitcache.cache_format.identity import teacher_diff
from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from ..engine.identity import teacher_identity
from ..engine.protocol import MAX_DRAWS, SampledTargets
from ..errors import InvalidInputError, ServiceError
from ..serving.targets import DEFAULT_DRAWS, checked, resolve
from ..settings import ServerSettings
from . import shards

if TYPE_CHECKING:
    from ..engine import EngineInfo


@dataclass(frozen=True)
class Plan:
    """How a run is laid out on the cluster."""

    replicas: int = 2
    """Teacher replicas (Ray actors), each with its own engine."""
    shard_size: int = 1024
    """Input records per shard (the unit of work, retry and staging)."""
    cpus_per_replica: float = 1.0
    """Ray CPUs reserved per replica."""
    gpus_per_replica: float | None = None
    """Ray GPUs per replica; default tensor x pipeline parallel size if the cluster has GPUs."""
    max_restarts: int = 2
    """Times Ray restarts a dead replica (its shard is then retried)."""
    keep_staging: bool = False
    """Keep the staging caches after the commit."""


def check_asked(targets: SampledTargets | str | None) -> None:
    """:class:`InvalidInputError` for parameters out of range whatever the teacher (the
    vocabulary bound on ``draws`` is checked once the engines are up: :func:`chosen_targets`)."""
    if targets is None or targets == "sampled":
        return
    if not isinstance(targets, SampledTargets):
        raise InvalidInputError(f'targets must be None, "sampled" or SampledTargets: {targets!r}')
    checked(targets, MAX_DRAWS)


def chosen_targets(
    targets: SampledTargets | str | None, stored: Manifest | None, info: EngineInfo
) -> SampledTargets | None:
    """The run's checked sampled-target parameters (``None``: top-k; ``"sampled"``: an existing
    cache's, else the job defaults)."""
    check_asked(targets)
    return checked(resolve(targets, stored), info.vocab_size)


_SAMPLING_FIELDS = ("draws", "proposal_temperature", "sampling_seed", "head")
"""The sampled-target settings (each only with ``--targets sampled``)."""


class DistributedSettings(ServerSettings):
    """``logitcache-distributed``'s settings: every :class:`ServerSettings` field plus the run's
    own below, read exactly like the server's."""

    model_config = SettingsConfigDict(
        **{**ServerSettings.model_config, "cli_prog_name": "logitcache-distributed"}
    )

    input: Path
    """Input: a JSONL or Parquet file (the job input format)."""
    cache: str
    """The final cache: a directory or URL (``s3://bucket/name``)."""
    replicas: int = Field(Plan.replicas, ge=1)
    """Teacher replicas (Ray actors), each with its own engine."""
    shard_size: int = Field(Plan.shard_size, ge=1)
    """Input records per shard (the unit of work, retry and staging)."""
    cpus_per_replica: float = Field(Plan.cpus_per_replica, ge=0)
    """Ray CPUs reserved per replica."""
    gpus_per_replica: float | None = Field(None, ge=0)
    """Ray GPUs per replica (default: tensor x pipeline parallel size if the cluster has GPUs)."""
    max_restarts: int = Field(Plan.max_restarts, ge=0)
    """Times Ray restarts a dead replica (its shard is then retried)."""
    staging: str | None = None
    """Staging root (default ``<cache>.staging``)."""
    keep_staging: bool = False
    """Keep the staging caches after the commit."""
    dataset: str = ""
    """Dataset description for the manifest (default: the input file's name)."""
    report: Path | None = None
    """Also write the JSON report here."""
    text_field: str = "text"
    """Input field holding a record's text."""
    ids_field: str = "input_ids"
    """Input field holding a record's token ids."""
    id_field: str = "id"
    """Input field holding a record's explicit id."""
    ray_address: str | None = None
    """An existing Ray cluster (``auto`` or ``host:port``); default: a local one on 127.0.0.1."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs of the local cluster (default: replicas x cpus per replica)."""
    num_gpus: int | None = Field(None, ge=0)
    """GPUs of the local cluster."""
    progress: bool = True
    """Progress bars (tqdm, on stderr) while the shards are checked and scored."""
    targets: Literal["topk", "sampled"] = "topk"
    """What the cache holds: top-k rows (``-k``), or sampled targets (FORMAT.md 4.4)."""
    draws: int | None = Field(None, ge=1, le=MAX_DRAWS)
    """Sampled targets: draws per row (default: an existing sampled cache's, else 64)."""
    proposal_temperature: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Sampled targets: tau of the proposal q ∝ p^(1/tau) (default: the cache's, else 1)."""
    sampling_seed: int | None = Field(None, ge=0, lt=2**63)
    """Sampled targets: seed of every sequence's draws (default: the cache's, else 0)."""
    head: int | None = Field(None, ge=0, lt=MAX_DRAWS)
    """Sampled targets: the teacher's top ``head`` ids kept exactly, the draws from the rest
    (a row holds head + draws slots; default: the cache's, else 0)."""

    @model_validator(mode="after")
    def _sampling_needs_sampled(self) -> DistributedSettings:
        given = [
            f"--{f.replace('_', '-')}" for f in _SAMPLING_FIELDS if getattr(self, f) is not None
        ]
        if given and self.targets != "sampled":
            raise ValueError(f"{', '.join(given)} only apply with --targets sampled")
        return self

    def sampled_targets(self) -> SampledTargets | str | None:
        """``None`` (top-k), ``"sampled"`` (no parameter given: the cache's own, else the
        defaults) or the :class:`~.engine.SampledTargets` asked for (defaults for the rest)."""
        if self.targets == "topk":
            return None
        if all(getattr(self, f) is None for f in _SAMPLING_FIELDS):
            return "sampled"
        return SampledTargets(
            draws=DEFAULT_DRAWS if self.draws is None else self.draws,
            proposal_temperature=1.0
            if self.proposal_temperature is None
            else self.proposal_temperature,
            seed=0 if self.sampling_seed is None else self.sampling_seed,
            head=0 if self.head is None else self.head,
        )

    def plan(self) -> Plan:
        return Plan(**{f.name: getattr(self, f.name) for f in fields(Plan)})

    def server_settings(self) -> ServerSettings:
        """The :class:`ServerSettings` part (what the replicas' engines are built from)."""
        return ServerSettings.model_construct(
            **{f: getattr(self, f) for f in ServerSettings.model_fields}
        )


def load_distributed_settings(argv: list[str]) -> DistributedSettings:
    """Settings from ``argv`` (CLI flags) over the environment, ``.env`` and defaults."""
    return DistributedSettings(_cli_parse_args=argv)  # type: ignore[call-arg]


class TargetMismatchError(ServiceError, status=409, code="conflict"):
    """The target cache holds another teacher, k, target kind or sampling parameters (found
    before any engine loads)."""


def check_target_early(
    settings: ServerSettings, cache_url: str, targets: SampledTargets | str | None = None
) -> None:
    """Fail before any engine loads when the cache at ``cache_url`` exists with another teacher,
    k, target kind or sampling parameters (:class:`TargetMismatchError`), from the model's files
    only (:func:`~.engine.config.planned_info`); the full check still runs before any write."""
    from ..engine.config import engine_config, planned_info

    check_asked(targets)
    stored = shards.stored_manifest(cache_url, settings.storage_options or None)
    if stored is None:
        return
    info = planned_info(engine_config(settings))
    want = teacher_identity(info)
    if info.dtype == "auto":  # resolved only when the weights load: not compared here
        want["dtype"] = teacher_identity(stored)["dtype"]
    diff = {f: f"cache {a!r}, this run {b!r}" for f, (a, b) in
            teacher_diff(teacher_identity(stored), want).items()}  # fmt: skip
    chosen = chosen_targets(targets, stored, info)
    run: dict[str, Any] = {"targets": "topk", "sampling": None, "k": info.max_k}
    if chosen is not None:
        run = {"targets": "sampled", "sampling": chosen.manifest(), "k": chosen.slots}
    run["entropy"] = settings.entropy  # the rows' entropy (FORMAT.md 4.9): kept or not
    for f, value in run.items():
        if getattr(stored, f) != value:
            diff[f] = f"cache {getattr(stored, f)!r}, this run {value!r}"
    if diff:
        fields = "; ".join(f"{f}: {v}" for f, v in sorted(diff.items()))
        raise TargetMismatchError(
            f"cache {cache_url} holds another teacher configuration ({fields}); "
            "use another --cache, or the settings it was made with",
            detail=sorted(diff),
        )
