"""Options shared by every implementation of the top-k distillation loss, and its typed errors."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

LOSS_KINDS: tuple[str, ...] = ("forward_kl", "renormalized_kl", "reverse_kl", "jsd")
REDUCTIONS: tuple[str, ...] = ("mean", "sum", "none")
#: What the teacher columns hold: the teacher's top-k logprobs ("topk") or the log importance
#: weights of a random-sampling KD row ("sampled", see :class:`LossSpec`).
TARGET_KINDS: tuple[str, ...] = ("topk", "sampled")
#: Which code runs the two full-vocabulary passes (see ``topk_distill_loss``'s ``kernels``).
KERNELS: tuple[str, ...] = ("auto", "torch", "triton")
#: Where the lm-head gradient is accumulated chunk by chunk (see ``topk_distill_loss``).
GRAD_WEIGHT_DTYPES: tuple[str, ...] = ("auto", "float32", "weight")
IMPLS: tuple[str, ...] = (
    "auto",
    "dense",
    "forward_chunked",
    "fused_chunked",
    "fused_chunked_recompute",
    "small_vocab",
)

#: Floor for the log of a bucket probability (student outside-top-k mass, teacher tail): log(1e-30).
#: It keeps ``tau * log(tau / Q_out)`` and ``Q_out * log(Q_out / tau)`` finite on underflow.
LOG_FLOOR: float = math.log(1e-30)


class LossInputError(ValueError):
    """Bad arguments to the distillation loss (shape, dtype, range, duplicate ids, option)."""


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    """A typed error unless option ``name`` is one of ``choices``."""
    if value not in choices:
        raise LossInputError(f"{name} must be one of {choices}, got {value!r}")


def given(value: T | None, what: str) -> T:
    """``value``, which validation guarantees when this is called; a typed error if missing."""
    if value is None:
        raise LossInputError(f"{what} missing where validation guarantees it")
    return value


@dataclass(frozen=True)
class LossSpec:
    """The objective, independent of how it is computed (the formulas:
    :func:`~.api.topk_distill_loss`)."""

    loss: str = "forward_kl"
    beta: float = 0.5
    temperature: float = 1.0
    ce_weight: float = 0.0
    has_tail: bool = False
    targets: str = "topk"

    def __post_init__(self) -> None:
        if self.targets not in TARGET_KINDS:
            raise LossInputError(f"targets must be one of {TARGET_KINDS}, got {self.targets!r}")
        if self.targets == "sampled" and (self.loss != "forward_kl" or self.has_tail):
            raise LossInputError(
                'targets="sampled" needs loss="forward_kl" and tail_mass=None (the importance '
                f"weights already sum to 1), got loss={self.loss!r}, "
                f"tail_mass given: {self.has_tail}"
            )
        if self.loss not in LOSS_KINDS:
            raise LossInputError(f"loss must be one of {LOSS_KINDS}, got {self.loss!r}")
        if self.loss == "jsd" and not 0.0 < self.beta < 1.0:
            raise LossInputError(f"jsd needs 0 < beta < 1, got beta={self.beta}")
        if not (math.isfinite(self.temperature) and self.temperature > 0.0):
            raise LossInputError(f"temperature must be finite and > 0, got {self.temperature}")
        if not (math.isfinite(self.ce_weight) and self.ce_weight >= 0.0):
            raise LossInputError(f"ce_weight must be finite and >= 0, got {self.ce_weight}")

    @property
    def inv_temperature(self) -> float:
        return 1.0 / self.temperature

    @property
    def uses_tail_bucket(self) -> bool:
        """Whether the coarsened distributions carry a tail bucket (outside the top-k ids)."""
        if self.loss == "renormalized_kl":
            return False
        if self.loss == "forward_kl":
            return self.has_tail
        return True  # reverse KL and JSD are only divergences with the tail bucket

    @property
    def separate_ce_softmax(self) -> bool:
        """Whether the CE term needs its own (un-tempered) softmax, distinct from the KD one."""
        return self.ce_weight > 0.0 and self.temperature != 1.0
