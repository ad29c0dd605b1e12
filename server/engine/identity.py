"""Who the teacher is: the one definition of a teacher's identity, the one comparison, and the
on-disk facts it is built from (a local model's revision and a content hash of its weights).

Teacher identity (:func:`teacher_identity`): the manifest fields :data:`MANIFEST_FIELDS`
(model id, revision, tokenizer fingerprint, vocabulary size, temperature, logprob mode) plus
:data:`EXTRA_FIELDS` (the weights' content hash and the engine's dtype), which a manifest keeps
under ``extra["teacher"]``. An :class:`~.protocol.EngineInfo` and a cache ``Manifest`` both map
to it; :func:`teacher_diff` is the only comparison (the server's 409, the Ray replicas' check).
``k`` is not part of it (a request's ``k`` is checked against the cache's apart).

``weights_hash(model)``: ``"sha256:<hex>"`` over every weight file (``*.safetensors``, ``*.bin``,
``*.pt``; sorted by name) of a local model directory (or a hub id already in the local hub
cache): its name, its size, and :data:`SAMPLES` blocks of :data:`BLOCK` bytes at evenly spaced
offsets covering the first and last bytes (for ``.safetensors`` the whole JSON header is hashed
too, which names every tensor, dtype and offset). Re-training, re-quantising or replacing the
weights changes essentially every byte, so this detects a replaced teacher while reading only a
few MiB per file, whatever the model's size; it is not a tamper check (a single edited byte
between two samples goes unseen — set an explicit ``--revision`` for that). Results are cached
in-process by ``(path, size, mtime_ns)`` of every file, so a server computes it once.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: Manifest fields that name the teacher distribution a cache holds.
MANIFEST_FIELDS: tuple[str, ...] = (
    "teacher_model",
    "teacher_revision",
    "tokenizer_fingerprint",
    "vocab_size",
    "temperature",
    "logprob_mode",
)
#: Identity kept under a manifest's ``extra["teacher"]``: the weights' content hash and dtype.
EXTRA_FIELDS: tuple[str, ...] = ("weights_hash", "dtype")
#: Key of :data:`EXTRA_FIELDS` in ``Manifest.extra``.
EXTRA_KEY = "teacher"

#: Blocks read per weight file, and their size in bytes.
SAMPLES = 64
BLOCK = 1 << 16

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")

_cache: dict[tuple[tuple[str, int, int], ...], str] = {}
_cache_lock = threading.Lock()


def local_revision(model: str, revision: str | None) -> str | None:
    """The given revision, else for a local model directory a short content hash of its
    ``config.json`` and weight-file sizes and safetensors headers (``local-<12 hex>``)."""
    if revision:
        return revision
    path = Path(model)
    if not path.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(path.iterdir()):
        if f.suffix in {".json", ".safetensors", ".bin"} and f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}".encode())
            if f.name == "config.json":
                h.update(f.read_bytes())
            elif f.suffix == ".safetensors":  # the header names every tensor and its offsets
                with f.open("rb") as fh:
                    n = int.from_bytes(fh.read(8), "little")
                    h.update(fh.read(min(n, 1 << 20)))
    return "local-" + h.hexdigest()[:12]


def model_dir(model: str, revision: str | None = None) -> Path | None:
    """``model`` as a local directory: itself, or its snapshot in the local hub cache; None if
    neither exists (nothing is downloaded)."""
    path = Path(model)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # not cached, not a repo id, or no huggingface_hub
        return None


def _file_digest(path: Path, size: int) -> bytes:
    h = hashlib.sha256(f"{path.name}:{size}".encode())
    with path.open("rb") as fh:
        if path.suffix == ".safetensors" and size >= 8:
            n = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(min(n, size - 8)))
        if size <= SAMPLES * BLOCK:
            fh.seek(0)
            h.update(fh.read())
        else:
            step = (size - BLOCK) / (SAMPLES - 1)
            for i in range(SAMPLES):
                fh.seek(int(i * step))
                h.update(fh.read(BLOCK))
    return h.digest()


def weights_hash(model: str, revision: str | None = None) -> str | None:
    """The content hash of ``model``'s weight files (see the module docstring); None when the
    model is not on this machine or has no weight files."""
    root = model_dir(model, revision)
    if root is None:
        return None
    files = sorted(p for p in root.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if not files:
        return None
    stats = []
    for p in files:
        st = os.stat(p)  # follows hub-cache symlinks to the blobs
        stats.append((str(p.resolve()), st.st_size, st.st_mtime_ns))
    key = tuple(stats)
    with _cache_lock:
        hit = _cache.get(key)
    if hit is not None:
        return hit
    h = hashlib.sha256()
    for p, (_, size, _) in zip(files, stats, strict=True):
        h.update(_file_digest(p, size))
    value = "sha256:" + h.hexdigest()
    with _cache_lock:
        _cache[key] = value
    return value


# ------------------------------------------------------------------------------ identity


def teacher_identity(source: Any) -> dict[str, Any]:
    """The teacher identity (:data:`MANIFEST_FIELDS` + :data:`EXTRA_FIELDS`) of an
    ``EngineInfo`` or a cache ``Manifest``. A manifest written before the extra fields were
    recorded has ``None`` for them."""
    if hasattr(source, "teacher_model"):  # a Manifest
        out = {f: getattr(source, f) for f in MANIFEST_FIELDS}
        extra = (getattr(source, "extra", None) or {}).get(EXTRA_KEY) or {}
        out.update({f: extra.get(f) if isinstance(extra, Mapping) else None for f in EXTRA_FIELDS})
        return out
    return {
        "teacher_model": source.model_id,
        "teacher_revision": source.revision or "main",
        "tokenizer_fingerprint": source.tokenizer_fingerprint,
        "vocab_size": source.vocab_size,
        "temperature": source.temperature,
        "logprob_mode": source.logprob_mode,
        "weights_hash": source.weights_hash,
        "dtype": source.dtype,
    }


def manifest_extra(identity: Mapping[str, Any]) -> dict[str, Any]:
    """The ``Manifest.extra`` entry that records ``identity``'s :data:`EXTRA_FIELDS`."""
    return {EXTRA_KEY: {f: identity[f] for f in EXTRA_FIELDS}}


def teacher_diff(have: Mapping[str, Any], want: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{field: (have, want)}`` for every identity field that differs; empty when the same
    teacher. An :data:`EXTRA_FIELDS` value missing (``None``) on the ``have`` side (a cache made
    before it was recorded) is not compared; every other difference counts."""
    diff: dict[str, tuple[Any, Any]] = {}
    for f in (*MANIFEST_FIELDS, *EXTRA_FIELDS):
        a, b = have.get(f), want.get(f)
        if f in EXTRA_FIELDS and a is None:
            continue
        if a != b:
            diff[f] = (a, b)
    return diff
