"""The teacher identity: which teacher distribution a cache holds, defined once beside the manifest
that records it, so the server and the client read the same definition.

It is the manifest fields :data:`TEACHER_FIELDS` plus :data:`TEACHER_EXTRA_FIELDS` (the weights'
content hash and the engine's dtype, kept under ``extra[TEACHER_EXTRA_KEY]``);
:func:`teacher_diff` is the only comparison. ``k``, the logprob encoding and the target kind are
the rest of a cache's identity (:data:`~._manifest.IDENTITY_FIELDS`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

__all__ = [
    "TEACHER_FIELDS",
    "TEACHER_EXTRA_FIELDS",
    "TEACHER_EXTRA_KEY",
    "teacher_of",
    "teacher_extra",
    "teacher_diff",
]

#: Manifest fields that name the teacher distribution a cache holds.
TEACHER_FIELDS: tuple[str, ...] = (
    "teacher_model",
    "teacher_revision",
    "tokenizer_fingerprint",
    "vocab_size",
    "temperature",
    "logprob_mode",
)
#: Identity kept under a manifest's ``extra[TEACHER_EXTRA_KEY]``: the weights' content hash and
#: the engine's dtype (``None`` in caches written before they were recorded).
TEACHER_EXTRA_FIELDS: tuple[str, ...] = ("weights_hash", "dtype")
#: Key of :data:`TEACHER_EXTRA_FIELDS` in ``Manifest.extra``.
TEACHER_EXTRA_KEY = "teacher"


class Described(Protocol):
    """What :func:`teacher_of` reads of a manifest (:class:`~._manifest.Manifest`)."""

    extra: dict[str, Any]


def teacher_of(manifest: Described) -> dict[str, Any]:
    """The teacher identity (:data:`TEACHER_FIELDS` + :data:`TEACHER_EXTRA_FIELDS`) a manifest
    records; an extra field the manifest does not record is ``None``."""
    out = {f: getattr(manifest, f) for f in TEACHER_FIELDS}
    extra = manifest.extra.get(TEACHER_EXTRA_KEY)
    recorded: Mapping[str, Any] = extra if isinstance(extra, Mapping) else {}
    out.update({f: recorded.get(f) for f in TEACHER_EXTRA_FIELDS})
    return out


def teacher_extra(identity: Mapping[str, Any]) -> dict[str, Any]:
    """The ``Manifest.extra`` entry that records ``identity``'s :data:`TEACHER_EXTRA_FIELDS`."""
    return {TEACHER_EXTRA_KEY: {f: identity[f] for f in TEACHER_EXTRA_FIELDS}}


def teacher_diff(have: Mapping[str, Any], want: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{field: (have, want)}`` for every identity field that differs; empty when the same
    teacher. A :data:`TEACHER_EXTRA_FIELDS` value missing (``None``) on the ``have`` side (a
    cache made before it was recorded) is not compared; every other difference counts."""
    diff: dict[str, tuple[Any, Any]] = {}
    for f in (*TEACHER_FIELDS, *TEACHER_EXTRA_FIELDS):
        a, b = have.get(f), want.get(f)
        if f in TEACHER_EXTRA_FIELDS and a is None:
            continue
        if a != b:
            diff[f] = (a, b)
    return diff
