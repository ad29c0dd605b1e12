"""The manifest: the store's self-description, kept in the root group's attributes.

The manifest is also the commit point: ``num_sequences``/``num_rows``/``num_tokens`` and
``generation`` say how much of the arrays is committed. Readers never look past these counts.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ._keyruns import RunRef, parse_runs
from .errors import ManifestError, ManifestMismatchError
from .identity import TEACHER_FIELDS
from .spec import FORMAT_VERSION, LogprobDtype, TailDtype

IDENTITY_FIELDS: tuple[str, ...] = (
    *TEACHER_FIELDS,
    "k",
    "logprob_dtype",
    "tail_mass_dtype",
    "targets",
    "sampling",
    "hidden",
)
"""Fields that must match between a resuming writer and the store (else ManifestMismatchError):
the teacher (:data:`~.identity.TEACHER_FIELDS`) and what of its distribution is stored."""


def utcnow() -> str:
    """Current UTC time as an ISO-8601 string with a ``Z`` suffix."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Manifest(BaseModel):
    """Self-description of a cache (FORMAT.md "Manifest"): identity fields
    (:data:`IDENTITY_FIELDS`), description (``dataset``, ``extra``) and the writer's bookkeeping
    (timestamps, counts, generation), which callers building a new cache leave at its defaults."""

    model_config = ConfigDict(extra="forbid", frozen=False, validate_assignment=True)

    format_version: int = FORMAT_VERSION
    teacher_model: str = Field(min_length=1)
    teacher_revision: str = "main"
    tokenizer_fingerprint: str = Field(min_length=1)
    vocab_size: int = Field(gt=0, lt=2**31)
    k: int = Field(gt=0)
    temperature: float = Field(default=1.0, gt=0)
    logprob_mode: str = "raw_logprobs"
    logprob_dtype: LogprobDtype = "float16"
    tail_mass_dtype: TailDtype = "float32"
    id_remap: bool = False
    dataset: str | dict[str, Any] = ""
    extra: dict[str, Any] = Field(default_factory=dict)
    created: str = Field(default_factory=utcnow)
    updated: str = Field(default_factory=utcnow)
    num_sequences: int = Field(default=0, ge=0)
    num_rows: int = Field(default=0, ge=0)
    num_tokens: int = Field(default=0, ge=0)
    num_key_bytes: int = Field(default=0, ge=0)
    generation: int = Field(default=0, ge=0)
    targets: Literal["topk", "sampled", "hidden"] = "topk"
    """What the rows hold: top-k logprobs, sampled ids with log importance weights (FORMAT.md
    4.4), or the teacher's final hidden states and its head (4.10); one kind per cache."""
    sampling: dict[str, Any] | None = None
    """``targets="sampled"`` only: ``{"method", "draws", "proposal_temperature", "seed"}`` and,
    for the head + residual estimator, ``"head"`` (``> 0``; absent means 0, and a ``head`` of 0
    is dropped, so both spellings are one identity)."""
    hidden: dict[str, Any] | None = None
    """``targets="hidden"`` only: ``{"dim", "dtype", "head_dtype", "head_digest", "bias",
    "logit_scale", "softcap"}`` (FORMAT.md 4.10, checked by :func:`._hidden.check_spec`)."""
    loss_mask: bool = False
    """The store has the row-aligned ``loss_mask`` array (FORMAT.md 4.6); set at creation."""
    entropy: bool = False
    """The store has the row-aligned ``entropy`` array (nats, FORMAT.md 4.9); set at creation."""
    actual_logprob: bool = False
    """The store has the row-aligned ``actual_logprob`` array (FORMAT.md 4.12); set at
    creation."""
    key_index: list[dict[str, Any]] | None = None
    """The runs of the on-disk key index (FORMAT.md 4.11), tiling ``[0, num_sequences)``;
    ``None``: the store has none."""

    @model_validator(mode="after")
    def _runs_tile_sequences(self) -> Manifest:
        if self.key_index is not None:
            parse_runs(self.key_index, self.num_sequences)
        return self

    def runs(self) -> list[RunRef] | None:
        """:attr:`key_index` as runs (``None``: no on-disk key index)."""
        if self.key_index is None:
            return None
        return parse_runs(self.key_index, self.num_sequences)

    @model_validator(mode="after")
    def _sampling_matches_targets(self) -> Manifest:
        targets, v = self.targets, self.sampling
        if targets != "sampled" and v is not None:
            raise ValueError('sampling is only allowed with targets="sampled"')
        if (targets == "hidden") != (self.hidden is not None):
            raise ValueError('targets="hidden" and the hidden description go together')
        if targets == "hidden":
            from .hidden import check_spec

            check_spec(self.hidden, self.k)
            for flag in ("entropy", "actual_logprob"):  # the rows rebuild the distribution
                if getattr(self, flag):
                    raise ValueError(f'{flag} is for targets "topk" and "sampled", not "hidden"')
        if targets == "sampled":
            need = {"method", "draws", "proposal_temperature", "seed"}
            if not isinstance(v, dict) or not need <= set(v) <= need | {"head"}:
                raise ValueError(
                    f'targets="sampled" needs sampling with exactly {sorted(need)} '
                    '(and optionally "head")'
                )
            if not (isinstance(v["draws"], int) and v["draws"] >= 1):
                raise ValueError(f"sampling.draws must be an int >= 1, got {v['draws']!r}")
            t = v["proposal_temperature"]
            if not (isinstance(t, int | float) and t > 0):
                raise ValueError(f"sampling.proposal_temperature must be > 0, got {t!r}")
            if not isinstance(v["seed"], int):
                raise ValueError(f"sampling.seed must be an int, got {v['seed']!r}")
            head = v.get("head", 0)
            if isinstance(head, bool) or not isinstance(head, int) or head < 0:
                raise ValueError(f"sampling.head must be an int >= 0, got {head!r}")
            if head and self.k != head + v["draws"]:
                raise ValueError(
                    f"k={self.k} must be sampling.head + sampling.draws = "
                    f"{head + v['draws']} (a row holds the head and the draws)"
                )
        return self

    @field_validator("sampling")
    @classmethod
    def _head_zero_is_absent(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if isinstance(v, dict) and "head" in v and type(v["head"]) is int and v["head"] == 0:
            return {n: x for n, x in v.items() if n != "head"}
        return v

    @field_validator("k")
    @classmethod
    def _k_le_vocab(cls, v: int, info: ValidationInfo) -> int:
        vocab = info.data.get("vocab_size")
        if vocab is not None and v > vocab:
            raise ValueError(f"k={v} exceeds vocab_size={vocab}")
        return v

    @classmethod
    def from_attrs(cls, data: Any) -> Manifest:
        """Parse the root attribute; a typed :class:`ManifestError` on anything invalid."""
        if not isinstance(data, dict):
            raise ManifestError(f"manifest attribute is {type(data).__name__}, expected an object")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise ManifestError(f"invalid manifest: {e}") from e

    def to_attrs(self) -> dict[str, Any]:
        """JSON-ready dict stored as the root attribute (a version-1 manifest without the fields
        version 1 did not have, so that version-1 readers still accept it)."""
        absent = {  # fields a store without them never wrote: its manifest stays as it was
            "targets": self.targets == "topk",
            "sampling": self.targets == "topk",
            "hidden": self.hidden is None,
            "num_key_bytes": self.format_version < 2,
            "loss_mask": not self.loss_mask,
            "entropy": not self.entropy,
            "actual_logprob": not self.actual_logprob,
            "key_index": self.key_index is None,
        }
        return {n: v for n, v in self.model_dump(mode="json").items() if not absent.get(n)}

    def identity(self) -> dict[str, Any]:
        """The identity fields only."""
        return {name: getattr(self, name) for name in IDENTITY_FIELDS}

    def check_compatible(self, other: Manifest) -> None:
        """Raise :class:`ManifestMismatchError` listing every identity field that differs."""
        diff = {
            n: (getattr(self, n), getattr(other, n))
            for n in IDENTITY_FIELDS
            if getattr(self, n) != getattr(other, n)
        }
        if diff:
            raise ManifestMismatchError(diff)
