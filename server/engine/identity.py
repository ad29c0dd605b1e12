"""Who the teacher is, as an engine sees it: the on-disk facts a teacher's identity is built from
(a local model's revision and a content hash of its weights) and the identity of an engine.

The identity itself (its fields and :func:`~logitcache.cache_format.identity.teacher_diff`, the
only comparison) is defined once in :mod:`logitcache.cache_format.identity`, beside the manifest
that records it; :func:`teacher_identity` maps an :class:`~.protocol.EngineInfo` (or a cache
``Manifest``) to it. ``k`` is not part of it (a request's ``k`` is checked against the cache's
apart).

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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from logitcache.cache_format import Manifest
from logitcache.cache_format.identity import (
    TEACHER_EXTRA_FIELDS,
    TEACHER_FIELDS,
    teacher_of,
)

if TYPE_CHECKING:
    from .protocol import EngineInfo

__all__ = ["local_revision", "model_dir", "weights_hash", "teacher_identity"]

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


def teacher_identity(source: EngineInfo | Manifest) -> dict[str, Any]:
    """The teacher identity (:data:`~logitcache.cache_format.identity.TEACHER_FIELDS` +
    ``TEACHER_EXTRA_FIELDS``) of an engine's ``EngineInfo`` or of a cache ``Manifest``
    (:func:`~logitcache.cache_format.identity.teacher_of`)."""
    if isinstance(source, Manifest):
        return teacher_of(source)
    out = {
        f: getattr(source, _INFO_NAMES.get(f, f)) for f in (*TEACHER_FIELDS, *TEACHER_EXTRA_FIELDS)
    }
    out["teacher_revision"] = out["teacher_revision"] or "main"
    return out


#: ``EngineInfo`` attributes whose name differs from the identity field's.
_INFO_NAMES = {"teacher_model": "model_id", "teacher_revision": "revision"}
