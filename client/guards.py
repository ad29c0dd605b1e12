"""Refuse a cache built for another tokenizer or vocabulary than the student's.

The cached ``topk_ids`` index the student's logits and ``input_ids`` are its inputs, so the
manifest's ``tokenizer_fingerprint`` (``logitcache.cache_format.tokenizer_fingerprint``) and
``vocab_size`` must be the student's. Every mismatch is reported at once in
:class:`IncompatibleCacheError`, or with ``allow_mismatch=True`` logged as a warning and returned.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .errors import ConfigError, IncompatibleCacheError

if TYPE_CHECKING:
    from logitcache.cache_format import Manifest

__all__ = ["check_compatible", "student_vocab_size", "student_fingerprint"]

log = logging.getLogger(__name__)


def student_fingerprint(tokenizer: object) -> str:
    """Fingerprint of ``tokenizer`` (a string is taken as a fingerprint already)."""
    if isinstance(tokenizer, str):
        return tokenizer
    from logitcache.cache_format import tokenizer_fingerprint

    return str(tokenizer_fingerprint(tokenizer))


def student_vocab_size(model_or_config: Any) -> int:
    """Vocabulary size from an int, a config with ``vocab_size`` or a model with ``.config``."""
    if isinstance(model_or_config, bool):
        raise ConfigError("vocab size must be an int or a config, got a bool")
    if isinstance(model_or_config, int):
        return model_or_config
    for obj in (model_or_config, getattr(model_or_config, "config", None)):
        size = getattr(obj, "vocab_size", None)
        if isinstance(size, int) and not isinstance(size, bool):
            return size
    if hasattr(model_or_config, "get_output_embeddings"):
        emb = model_or_config.get_output_embeddings()
        if emb is not None and hasattr(emb, "weight"):
            return int(emb.weight.shape[0])
    raise ConfigError(
        f"cannot read a vocab size from {type(model_or_config).__name__}: "
        "pass an int, a config with vocab_size, or a model with .config"
    )


def check_compatible(
    manifest: Manifest,
    *,
    tokenizer: object = None,
    vocab_size: object = None,
    allow_mismatch: bool = False,
) -> list[str]:
    """Check a cache manifest against the student; return the mismatches found (empty if none).

    Raises :class:`IncompatibleCacheError` listing every mismatch unless ``allow_mismatch``.
    Checks are skipped for the arguments left ``None``.
    """
    reasons: list[str] = []
    if tokenizer is not None:
        want = student_fingerprint(tokenizer)
        have = getattr(manifest, "tokenizer_fingerprint", None)
        if have != want:
            reasons.append(
                f"tokenizer fingerprint differs: cache has {have!r}, student tokenizer is {want!r}"
            )
    if vocab_size is not None:
        want_v = student_vocab_size(vocab_size)
        have_v = getattr(manifest, "vocab_size", None)
        if have_v != want_v:
            reasons.append(f"vocab size differs: cache has {have_v}, student has {want_v}")
    if reasons and not allow_mismatch:
        raise IncompatibleCacheError(reasons)
    for reason in reasons:
        log.warning("using an incompatible cache (allow_mismatch=True): %s", reason)
    return reasons
