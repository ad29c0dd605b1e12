"""Read-only access to the stored objects of a cache: ``GET /v1/caches/{name}/store/{key}``.

The object ``key`` of the cache's Zarr store is sent as stored (a ``Range`` header answers 206
with those bytes; a missing object 404), so a client opens the cache with the format's own
reader over this URL. Keys are checked by :func:`..paths.store_key` and resolved inside the
store root; a ``zarr.json`` is served without server paths (:func:`public_metadata`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import Response
from logitcache.cache_format import get_object, object_size, resealed_root_attrs
from logitcache.protocol import ErrorResponse
from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest

from .. import paths
from ..errors import NotFoundError, ServiceError, public_value
from ..serving.caches import check_name, is_url
from .deps import ServicesDep

router = APIRouter(prefix="/v1/caches", tags=["caches"])

#: A single ``bytes`` range; offsets of at most 18 digits (a larger one is past any object).
_RANGE = re.compile(r"bytes=(\d{0,18})-(\d{0,18})")

_ERROR = {"model": ErrorResponse}
_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {**_ERROR, "description": "missing or wrong API key"},
    404: {**_ERROR, "description": "no such cache or object"},
    416: {**_ERROR, "description": "unsupported or unsatisfiable Range"},
    422: {**_ERROR, "description": "invalid cache name or key"},
}


class RangeNotSatisfiableError(ServiceError, status=416, code="range_not_satisfiable"):
    """A ``Range`` header this route does not serve (several ranges, bad syntax, past the end)."""


def parse_range(header: str | None) -> Any:
    """The zarr byte request of a single-range ``Range`` header (``None``: whole object)."""
    if header is None:
        return None
    m = _RANGE.fullmatch(header.strip())
    if m is None or (not m[1] and not m[2]):
        raise RangeNotSatisfiableError(f"unsupported Range {header!r} (one bytes range only)")
    if not m[1]:
        return SuffixByteRequest(int(m[2]))
    start = int(m[1])
    if not m[2]:
        return OffsetByteRequest(start)
    stop = int(m[2]) + 1
    if stop <= start:
        raise RangeNotSatisfiableError(f"empty Range {header!r}")
    return RangeByteRequest(start, stop)


def public_metadata(raw: bytes) -> bytes:
    """A ``zarr.json`` document as served: attributes through
    :func:`~logitcache.server.errors.public_value` (no server paths) and a valid manifest digest
    recomputed over them; the stored bytes when nothing changed."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return raw
    if not isinstance(doc, dict) or not isinstance(doc.get("attributes"), dict):
        return raw
    public = public_value(doc["attributes"])
    if public == doc["attributes"]:
        return raw
    public = resealed_root_attrs(doc["attributes"], public)
    return json.dumps({**doc, "attributes": public}, indent=2).encode()


def clamp_range(byte_range: Any, size: int, header: str | None) -> RangeByteRequest:
    """``byte_range`` as the bytes ``[start, stop)`` it names within an object of ``size``
    bytes (416 if none: a start at or past the end, an empty suffix)."""
    if isinstance(byte_range, SuffixByteRequest):
        start, stop = size - min(byte_range.suffix, size), size
    elif isinstance(byte_range, OffsetByteRequest):
        start, stop = byte_range.offset, size
    else:
        start, stop = byte_range.start, min(byte_range.end, size)
    if start >= stop:
        raise RangeNotSatisfiableError(f"Range {header!r} selects no byte of the object")
    return RangeByteRequest(start, stop)


def store_object(
    name: str,
    key: str,
    request: Request,
    services: ServicesDep,
    range_: str | None = Header(None, alias="Range"),
) -> Response:
    """Object ``key`` of cache ``name``'s store, as stored (see the module docstring)."""
    check_name(name)
    paths.store_key(key)
    byte_range = parse_range(range_)
    root = services.caches.root
    if not is_url(root):  # links followed: the object must lie inside the store root
        paths.resolve_under(Path(root), f"{name}/{key}", "store key")
    metadata = key.rsplit("/", 1)[-1] == "zarr.json"  # read whole, served without paths
    try:
        store = services.caches.store(name)
        if byte_range is not None and not metadata:  # cut to the object: no read past its end
            byte_range = clamp_range(byte_range, object_size(store, key), range_)
        got = byte_range if not metadata else None
        body = get_object(store, key, got)
    except FileNotFoundError:  # no such cache folder or object
        raise NotFoundError(f"cache {name!r} has no object {key!r}") from None
    if body is None:
        raise NotFoundError(f"cache {name!r} has no object {key!r}")
    if metadata:
        body = public_metadata(body)
        if byte_range is not None:
            byte_range = clamp_range(byte_range, len(body), range_)
            body = body[byte_range.start : byte_range.end]
    headers = {"Cache-Control": "no-store", "Accept-Ranges": "bytes"}
    status = 200
    if byte_range is not None:
        status = 206
        first = byte_range.start if isinstance(byte_range, RangeByteRequest) else 0
        headers["Content-Range"] = f"bytes {first}-{first + len(body) - 1}/*"
    if request.method == "HEAD":
        headers["Content-Length"] = str(len(body))
        return Response(status_code=status, headers=headers)
    return Response(
        body, status_code=status, media_type="application/octet-stream", headers=headers
    )


_STORE_PATH = "/{name}/store/{key:path}"
_STORE_RESPONSES: dict[int | str, dict[str, Any]] = {
    **_ERRORS,
    200: {"content": {"application/octet-stream": {}}, "description": "the object"},
    206: {"content": {"application/octet-stream": {}}, "description": "the byte range"},
}
# One handler, two operations: GET and HEAD each get their own OpenAPI operation id
# (``caches-store_object`` / ``caches-store_object_head``); one route with both methods would
# give both the same id (FastAPI warns "Duplicate Operation ID").
for _method, _name in (("GET", "store_object"), ("HEAD", "store_object_head")):
    router.add_api_route(
        _STORE_PATH,
        store_object,
        methods=[_method],
        name=_name,
        response_class=Response,
        responses=_STORE_RESPONSES,
    )
