"""The target kind of a request or job: top-k rows or sampled targets.

A request names ``targets`` (``"topk"`` or ``"sampled"``) and optionally ``sampling`` (FORMAT.md
4.4); without it a sampled request takes an existing sampled cache's parameters, else the
defaults (:data:`DEFAULT_DRAWS`). One cache holds one kind (409 otherwise). :func:`targets_of`
gives a manifest's engine call parameters (``None`` for top-k).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from logitcache.cache_format import Manifest
from logitcache.protocol import SamplingOptions

from ..engine.protocol import EngineInputError, SampledTargets, check_sampled
from ..errors import InvalidInputError
from .caches import expected_manifest

if TYPE_CHECKING:
    from ..engine import EngineInfo
    from ..settings import ServerSettings

#: Draws per row of a sampled request that names none (and no existing cache gives them).
DEFAULT_DRAWS = 64

HIDDEN_JOBS_ONLY = (
    'targets="hidden" caches are written by jobs (POST /v1/jobs); /v1/score and the protocol '
    "routes answer with top-k or sampled rows"
)


def resolve(asked: SampledTargets | str | None, stored: Manifest | None) -> SampledTargets | None:
    """The parameters to use: ``"sampled"`` takes a sampled cache's own, else the defaults
    (``"hidden"`` has none: a :class:`InvalidInputError` where sampled parameters are asked)."""
    if asked == "hidden":
        raise InvalidInputError(HIDDEN_JOBS_ONLY)
    if asked != "sampled":
        return asked if isinstance(asked, SampledTargets) else None
    return cache_or_default(stored)


def checked(chosen: SampledTargets | None, vocab_size: int) -> SampledTargets | None:
    """``chosen`` range-checked for a vocabulary of ``vocab_size`` ids (``None`` passes); a
    :class:`InvalidInputError` (422) otherwise."""
    try:
        return None if chosen is None else check_sampled(chosen, vocab_size)
    except EngineInputError as e:
        raise InvalidInputError(str(e)) from None


def cache_or_default(stored: Manifest | None) -> SampledTargets:
    """A sampled cache's own parameters, else :data:`DEFAULT_DRAWS` draws at proposal
    temperature 1 and seed 0."""
    if stored is not None and stored.targets == "sampled" and stored.sampling is not None:
        return SampledTargets.from_manifest(stored.sampling)
    return SampledTargets(draws=DEFAULT_DRAWS)


class Asks(Protocol):
    """What :func:`of_request` reads of a ``ScoreRequest`` or ``JobCreate``."""

    @property
    def targets(self) -> str: ...
    @property
    def sampling(self) -> SamplingOptions | None: ...


def of_request(req: Asks) -> SampledTargets | str | None:
    """What a validated ``ScoreRequest`` or ``JobCreate`` asks for: ``None`` (top-k),
    ``"hidden"``, ``"sampled"`` or a :class:`SampledTargets`."""
    if req.targets != "sampled":
        return None if req.targets == "topk" else req.targets
    s = req.sampling
    if s is None:
        return "sampled"
    return SampledTargets(
        draws=s.draws, proposal_temperature=float(s.proposal_temperature), seed=s.seed, head=s.head
    )


def with_targets(expected: Manifest, targets: SampledTargets | None) -> Manifest:
    """``expected`` (a new top-k cache's manifest) for ``targets``: unchanged for top-k; for
    sampled, ``k = head + draws``, ``targets = "sampled"`` and the ``sampling`` object."""
    if targets is None:
        return expected
    doc = expected.model_dump()
    doc.update(k=targets.slots, targets="sampled", sampling=targets.manifest())
    return Manifest(**doc)


def new_manifest(
    info: EngineInfo,
    settings: ServerSettings,
    k: int,
    dataset: str = "",
    targets: SampledTargets | None = None,
) -> Manifest:
    """The manifest of a new cache of the engine ``info`` under ``settings``: top-``k`` or
    ``targets``' sampled rows, with the ``actual_logprob`` and ``entropy`` settings."""
    top = expected_manifest(info, k=k, logprob_dtype=settings.logprob_dtype, dataset=dataset)
    flags = {"entropy": settings.entropy, "actual_logprob": settings.actual_logprob and not targets}
    return with_targets(top.model_copy(update=flags), targets)


def targets_of(manifest: Manifest) -> SampledTargets | None:
    """The engine parameters of the rows a cache holds (``None``: top-k)."""
    if manifest.targets != "sampled" or manifest.sampling is None:
        return None
    return SampledTargets.from_manifest(manifest.sampling)
