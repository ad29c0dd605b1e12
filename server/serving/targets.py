"""The target kind of a request or job: top-k rows or sampled targets (issue #12).

A request (``/v1/score``, ``/v1/jobs``) names ``targets`` (``"topk"``, the default, or
``"sampled"``) and, for ``"sampled"``, optionally ``sampling = {draws, proposal_temperature,
seed, head}`` (FORMAT.md 4.4; the engine contract in ``server/engine/protocol.py``). Rules:

* ``sampling`` with ``targets="topk"`` is a 422; so is ``k`` with ``targets="sampled"`` (a
  sampled row has ``head + draws`` slots; ``k`` of the cache is ``head + draws``).
* ``targets="sampled"`` without ``sampling``: an existing sampled cache's own parameters, else
  :data:`DEFAULT_DRAWS` draws at proposal temperature 1 and seed 0.
* One cache holds one kind: a request whose kind or sampling parameters differ from an existing
  cache's is a 409 (``ConflictError`` from ``CacheRegistry.target_manifest``).

The kind then travels as the manifest written: :func:`targets_of` gives the engine call's
:class:`~.engine.SampledTargets` (``None`` for top-k) and :func:`score_rows` makes the call.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

from logitcache.cache_format import Manifest

from ..engine.protocol import EngineInputError, SampledTargets, check_sampled
from ..errors import InvalidInputError
from .caches import check_name

if TYPE_CHECKING:
    from ..engine import TeacherEngine, TeacherScores
    from ..inputs.records import Sequence
    from .scoring import ScoringService

#: Draws per row of a sampled request that names none (and no existing cache gives them).
DEFAULT_DRAWS = 64


def requested(targets: str | None, sampling: Any, k: int | None) -> SampledTargets | str | None:
    """What a request asks for: ``None`` (top-k), ``"sampled"`` (sampled, parameters from the
    cache or the defaults) or a :class:`SampledTargets`. 422 on a contradiction."""
    kind = targets or "topk"
    if kind == "topk":
        if sampling is not None:
            raise InvalidInputError('sampling is only allowed with targets="sampled"')
        return None
    if k is not None:
        raise InvalidInputError(
            'k does not apply to targets="sampled" (a sampled row holds sampling.draws slots)'
        )
    if sampling is None:
        return "sampled"
    return SampledTargets(
        draws=int(sampling.draws),
        proposal_temperature=float(sampling.proposal_temperature),
        seed=int(sampling.seed),
        head=int(getattr(sampling, "head", 0)),
    )


def resolve(asked: SampledTargets | str | None, stored: Manifest | None) -> SampledTargets | None:
    """The parameters to use: ``"sampled"`` takes a sampled cache's own, else the defaults."""
    if asked != "sampled":
        return asked if isinstance(asked, SampledTargets) else None
    if stored is not None and stored.targets == "sampled" and stored.sampling is not None:
        return SampledTargets.from_manifest(stored.sampling)
    return SampledTargets(draws=DEFAULT_DRAWS)


def of_request(req: Any) -> SampledTargets | str | None:
    """:func:`requested` of a ``ScoreRequest`` or ``JobCreate`` (``targets``, ``sampling``,
    ``k``; a stored job spec from before these fields reads as top-k)."""
    return requested(getattr(req, "targets", None), getattr(req, "sampling", None), req.k)


def target_manifest(
    service: ScoringService,
    cache: str,
    k: int | None,
    dataset: str,
    asked: SampledTargets | str | None,
) -> Manifest:
    """The manifest to write ``cache`` with for the asked kind (top-k:
    ``ScoringService.target_manifest``). Sampled: the parameters (:func:`resolve`, checked
    against the engine: 422), a new cache's manifest at ``k = draws``, and for an existing cache
    the 409 on any other teacher, kind or sampling parameters (``head`` included)."""
    if asked is None:
        return service.target_manifest(cache, k, dataset)
    name = check_name(cache)
    stored = service.stored_manifest(name)
    try:
        chosen = check_sampled(resolve(asked, stored), service.engine.info.vocab_size)
    except EngineInputError as e:
        raise InvalidInputError(str(e)) from None
    expected = with_targets(service.expected_manifest(None, dataset), chosen)
    return service.caches.target_manifest(name, expected, k=None)


def with_targets(expected: Manifest, targets: SampledTargets | None) -> Manifest:
    """``expected`` (a new top-k cache's manifest) for ``targets``: unchanged for top-k; for
    sampled, ``k = head + draws``, ``targets = "sampled"`` and the ``sampling`` object."""
    if targets is None:
        return expected
    doc = expected.model_dump()
    doc.update(k=targets.slots, targets="sampled", sampling=targets.manifest())
    return Manifest(**doc)


def targets_of(manifest: Manifest) -> SampledTargets | None:
    """The engine parameters of the rows a cache holds (``None``: top-k)."""
    if manifest.targets != "sampled" or manifest.sampling is None:
        return None
    return SampledTargets.from_manifest(manifest.sampling)


async def score_rows(
    engine: TeacherEngine, seqs: Seq[Sequence], k: int, targets: SampledTargets | None
) -> list[TeacherScores]:
    """One engine call: top-``k`` rows, or sampled rows seeded by each sequence's key."""
    prompts = [s.input_ids for s in seqs]  # int32 arrays: check_prompts makes the lists once
    if targets is None:
        return await engine.score(prompts, k)
    sample = getattr(engine, "score_sampled", None)
    if sample is None:
        raise EngineInputError("this engine cannot produce sampled targets (targets='sampled')")
    return await sample(prompts, [s.key for s in seqs], targets)
