"""Who the teacher is, as an engine sees it: a local model's revision, a content hash of its
weights, and :func:`teacher_identity` of an engine (the fields and their comparison live in
:mod:`logitcache.cache_format.identity`).

``weights_hash(model)``: ``"sha256:<hex>"`` over every weight file's name, size and content. A
file's digest is kept by its identity on disk ``(device, inode, size, mtime_ns, ctime_ns)``, in
process and in a JSON file shared on the machine (:func:`digest_cache_path`), so a restart does
not rehash a checkpoint and any write is hashed again.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
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

__all__ = [
    "content_digest",
    "digest_cache_path",
    "local_revision",
    "model_dir",
    "teacher_identity",
    "weights_hash",
]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")

#: Bytes read per ``read`` while hashing (large reads: sha256 releases the GIL on each update).
READ_BLOCK = 8 << 20
#: Entries kept in the shared digest cache file (the newest).
CACHE_ENTRIES = 512

_cache: dict[str, str] = {}  # file identity -> sha256 hex of its content
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


def digest_cache_path() -> Path:
    """The shared digest cache: ``$XDG_CACHE_HOME/logitcache/weights-digests.json`` (default
    ``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "logitcache" / "weights-digests.json"


def _file_key(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _read_cache_file(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # absent, unreadable or torn: hash again
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)}


def _write_cache_file(path: Path, new: dict[str, str]) -> None:
    """Merge ``new`` into the cache file (atomic replace; best effort: a read-only home only
    costs a rehash at the next start)."""
    try:
        merged = {**_read_cache_file(path), **new}
        keep = dict(list(merged.items())[-CACHE_ENTRIES:])
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".weights-digests.", dir=path.parent)
        with os.fdopen(fd, "w") as fh:
            json.dump(keep, fh)
        os.replace(tmp, path)
    except OSError:
        pass


def content_digest(path: Path) -> str:
    """The sha256 hex digest of a file's whole content, read in :data:`READ_BLOCK` pieces."""
    h = hashlib.sha256()
    buf = bytearray(READ_BLOCK)
    view = memoryview(buf)
    with path.open("rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def weights_hash(
    model: str, revision: str | None = None, *, cache_path: Path | None = None
) -> str | None:
    """The content hash of ``model``'s weight files (module doc); None when the model is not on
    this machine or has none."""
    root = model_dir(model, revision)
    if root is None:
        return None
    files = sorted(p for p in root.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if not files:
        return None
    shared = digest_cache_path() if cache_path is None else cache_path
    stored: dict[str, str] | None = None
    computed: dict[str, str] = {}
    h = hashlib.sha256()
    for p in files:
        st = os.stat(p)  # follows hub-cache symlinks to the blobs
        key = _file_key(st)
        with _cache_lock:
            digest = _cache.get(key)
        if digest is None:
            if stored is None:
                stored = _read_cache_file(shared)
            digest = stored.get(key)
        if digest is None:
            digest = computed[key] = content_digest(p)
            if _file_key(os.stat(p)) != key:  # written while being read: not a stable value
                raise OSError(f"{p} changed while its content hash was computed")
        with _cache_lock:
            _cache[key] = digest
        h.update(f"{p.name}:{st.st_size}:{digest}\n".encode())
    if computed:
        _write_cache_file(shared, computed)
    return "sha256:" + h.hexdigest()


# ------------------------------------------------------------------------------ identity


def teacher_identity(source: EngineInfo | Manifest) -> dict[str, Any]:
    """The teacher identity of an engine's ``EngineInfo`` or of a cache ``Manifest``."""
    if isinstance(source, Manifest):
        return teacher_of(source)
    out = {
        f: getattr(source, _INFO_NAMES.get(f, f)) for f in (*TEACHER_FIELDS, *TEACHER_EXTRA_FIELDS)
    }
    out["teacher_revision"] = out["teacher_revision"] or "main"
    return out


#: ``EngineInfo`` attributes whose name differs from the identity field's.
_INFO_NAMES = {"teacher_model": "model_id", "teacher_revision": "revision"}
