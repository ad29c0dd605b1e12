"""Keys and paths sent by clients, resolved against their root: the one place that decides
whether a name from a request may be opened.

Every route and input that takes a key or a path goes through here: the objects of a cache's
store (``GET``/``HEAD /v1/caches/{name}/store/{key}``), cache names, a job's input path under the
data directory, and the members of a dataset folder (``state.json`` entries, the ``*.parquet`` /
``*.arrow`` files found by walking it, links included). A key or path is refused when

* its text is unsafe (:class:`UnsafePathError`, 422 ``invalid_path``): empty, absolute (``/x``,
  ``\\x``), an empty segment (``a//b``, a trailing ``/``), a dot segment (``.``, ``..``), a NUL,
  another control character or a backslash, a segment over :data:`MAX_SEGMENT_BYTES` bytes or
  the whole over :data:`MAX_PATH_BYTES` bytes;
* it resolves, links followed, outside its root (:class:`PathEscapeError`, 422 ``invalid_path``).

A store key (:func:`store_key`) also follows the rules of the keys this service writes:
at most :data:`MAX_KEY_SEGMENTS` segments of ``[A-Za-z0-9_.-]``; a segment starting with a dot
(the writer's lock file, zarr v2 probes such as ``.zgroup``) is never served (404).
"""

from __future__ import annotations

import re
from pathlib import Path

from .errors import InvalidPathError, NotFoundError

#: Longest segment of a key or path, in UTF-8 bytes (a file name's limit on Linux).
MAX_SEGMENT_BYTES = 255
#: Longest key or path, in UTF-8 bytes.
MAX_PATH_BYTES = 4096
#: Most segments of a store key (the service writes at most ``array/c/i/j``).
MAX_KEY_SEGMENTS = 16

#: One segment of a store key (any leading dots are checked apart).
_KEY_SEGMENT = re.compile(r"[A-Za-z0-9_.-]{1,128}")
#: Characters no key or path may hold: controls (NUL included), DEL and the backslash.
_FORBIDDEN = re.compile(r"[\x00-\x1f\x7f\\]")


class UnsafePathError(InvalidPathError):
    """A key or path whose text is unsafe: empty, absolute, empty or dot segments, a control
    character or backslash, or over-long."""


class PathEscapeError(InvalidPathError):
    """A key or path that resolves (links followed) outside the root it is taken against."""


def segments(rel: str, what: str = "path") -> tuple[str, ...]:
    """The segments of the relative key or path ``rel``; :class:`UnsafePathError` if its text is
    unsafe (see the module docstring). ``what`` names it in the message."""
    if not isinstance(rel, str) or not rel:
        raise UnsafePathError(f"{what} is empty")
    if _FORBIDDEN.search(rel):
        raise UnsafePathError(f"{what} {rel!r} holds a control character or a backslash")
    try:
        size = len(rel.encode("utf-8"))
    except UnicodeEncodeError:
        raise UnsafePathError(f"{what} {rel!r} is not valid Unicode") from None
    if size > MAX_PATH_BYTES:
        raise UnsafePathError(f"{what} of {size} bytes exceeds {MAX_PATH_BYTES}")
    if rel.startswith("/"):
        raise UnsafePathError(f"{what} {rel!r} must be relative")
    parts = tuple(rel.split("/"))
    for part in parts:
        if not part:
            raise UnsafePathError(f"{what} {rel!r} has an empty segment")
        if part in (".", ".."):
            raise UnsafePathError(f"{what} {rel!r} has a {part!r} segment")
        if len(part.encode("utf-8")) > MAX_SEGMENT_BYTES:
            raise UnsafePathError(f"{what} has a segment of more than {MAX_SEGMENT_BYTES} bytes")
    return parts


def contained(root: Path, path: Path, what: str = "path", shown: str | None = None) -> Path:
    """``path`` resolved (links followed) if it lies inside ``root``, else
    :class:`PathEscapeError` (``shown``: how the message names it)."""
    base = root.expanduser().resolve()
    real = path.expanduser().resolve()
    if not real.is_relative_to(base):
        raise PathEscapeError(f"{what} {shown or path.name!r} leaves its root (links resolved)")
    return real


def resolve_under(root: Path, rel: str, what: str = "path", *, base: Path | None = None) -> Path:
    """``base / rel`` resolved (``base`` defaults to ``root``) after checking ``rel``'s text and
    that the result stays inside ``root``; it need not exist."""
    parts = segments(rel, what)
    start = (root if base is None else base).expanduser().resolve()
    return contained(root, start.joinpath(*parts), what, shown=rel)


def store_key(key: str) -> str:
    """``key`` if the store route serves it: :class:`UnsafePathError` if malformed,
    :class:`NotFoundError` for a segment starting with a dot."""
    if not isinstance(key, str) or not key:
        raise UnsafePathError("store key is empty")
    parts = key.split("/")
    if any(p.startswith(".") for p in parts) and all(_KEY_SEGMENT.fullmatch(p) for p in parts):
        raise NotFoundError(f"no object {key!r}")
    segments(key, "store key")
    if len(parts) > MAX_KEY_SEGMENTS or not all(_KEY_SEGMENT.fullmatch(p) for p in parts):
        raise UnsafePathError(
            f"invalid store key {key!r}: at most {MAX_KEY_SEGMENTS} segments of [A-Za-z0-9_.-]"
        )
    return key


def one_segment(name: str, pattern: re.Pattern[str], what: str) -> str:
    """``name`` if it is a single safe segment matching ``pattern`` (a cache name: one folder
    or prefix under the store root), else :class:`UnsafePathError`."""
    parts = segments(name, what)
    if len(parts) != 1 or not pattern.fullmatch(name):
        raise UnsafePathError(f"invalid {what} {name!r}")
    return name
