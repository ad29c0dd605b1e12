"""Caches: list, describe, and stream blocks to clients as wire frames.

``GET /v1/caches/{name}/sequences?start=&stop=`` streams sequences ``[start, stop)`` in storage
order; ``GET /v1/caches/{name}/rows?start=&stop=`` the whole sequences holding global rows
``[start, stop)`` (headers ``X-Logitcache-First-Sequence`` / ``-First-Row``). The body is
frames of at most ``FRAME_SEQUENCES`` sequences, each read while the previous one is sent
(``compression=zstd`` compresses each).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from fastapi import Path as PathParam
from fastapi.responses import StreamingResponse
from logitcache.cache_format import CacheReader, encode_records, exact_frame_dtype
from logitcache.protocol import (
    FRAMES_MEDIA_TYPE,
    MAX_NAME_CHARS,
    NAME_REGEX,
    CacheInfo,
    CacheLengths,
    CacheList,
    Compression,
    ErrorResponse,
)

from ..errors import (
    CacheIncompleteError,
    InvalidInputError,
    PayloadTooLargeError,
    ServiceError,
    public_value,
)
from ..serving.caches import CacheRegistry
from .deps import ServicesDep

router = APIRouter(prefix="/v1/caches", tags=["caches"])

#: Sequences per wire frame in streamed answers.
FRAME_SEQUENCES = 256

_ERROR = {"model": ErrorResponse}
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {**_ERROR, "description": "body is not parsable JSON"},
    401: {**_ERROR, "description": "missing or wrong API key"},
    404: {**_ERROR, "description": "no such cache"},
    409: {**_ERROR, "description": "the cache is broken or incomplete"},
    413: {**_ERROR, "description": "range over a limit"},
    422: {**_ERROR, "description": "invalid request"},
    503: {**_ERROR, "description": "starting or stopping"},
}
_FRAMES = {200: {"content": {FRAMES_MEDIA_TYPE: {}}, "description": "wire frames"}}

#: The ``{name}`` path parameter: a cache name (documented pattern; ``..`` is refused too).
Name = Annotated[
    str, PathParam(pattern=NAME_REGEX, max_length=MAX_NAME_CHARS, description="cache name")
]


def _link(op: str) -> dict[str, Any]:
    return {"operationId": f"caches-{op}", "parameters": {"name": "$response.body#/caches/0/name"}}


_LIST_LINKS = {
    "GetCache": _link("get_cache"),
    "GetLengths": _link("cache_lengths"),
    "GetSequences": _link("cache_sequences"),
    "GetRows": _link("cache_rows"),
}


def _listing(caches: CacheRegistry) -> list[CacheInfo]:
    """Every cache under the root; one that cannot be opened is listed with its status."""
    out = []
    names = set(caches.names())
    incomplete = caches.incomplete()
    for name in sorted(names - set(incomplete)):
        try:
            out.append(_info(name, caches.open_reader(name)))
        except CacheIncompleteError as e:
            out.append(_unusable(name, "incomplete", e.message))
        except ServiceError as e:
            out.append(_unusable(name, "broken", e.message))
    for name, reason in incomplete.items():
        out.append(_unusable(name, "incomplete", reason))
    return sorted(out, key=lambda c: c.name)


def _unusable(name: str, status: Literal["broken", "incomplete"], error: str) -> CacheInfo:
    return CacheInfo(
        name=name, manifest={}, num_sequences=0, num_rows=0, status=status, error=error
    )


def _info(name: str, reader: CacheReader) -> CacheInfo:
    return CacheInfo(
        name=name,
        manifest=public_value(reader.manifest.to_attrs()),  # no server paths (teacher_model)
        num_sequences=reader.num_sequences,
        num_rows=reader.num_rows,
    )


def _range(start: int, stop: int | None, n: int, limit: int) -> tuple[int, int]:
    """``[start, stop)`` within ``[0, n]`` (``stop`` defaults to ``start + limit``, capped)."""
    if stop is None:
        stop = min(n, start + limit)
    if not 0 <= start <= stop <= n:
        raise InvalidInputError(f"range [{start}, {stop}) is outside [0, {n}]")
    if stop - start > limit:
        raise PayloadTooLargeError(f"{stop - start} sequences exceed the limit of {limit}")
    return start, stop


def _frames(reader: CacheReader, start: int, stop: int, compression: str) -> Iterator[bytes]:
    """Frames of sequences ``[start, stop)``, ``FRAME_SEQUENCES`` each, one range read each
    (float16 and hidden caches sent as stored)."""
    dtype = exact_frame_dtype(reader.manifest)
    for a in range(start, stop, FRAME_SEQUENCES):
        records = reader.read_ranges([(a, min(stop, a + FRAME_SEQUENCES))], logprob_dtype=dtype)
        yield encode_records(records, logprob_dtype=dtype, compression=compression)


@router.get(
    "",
    response_model=CacheList,
    responses={**_ERRORS, 200: {"description": "every cache", "links": _LIST_LINKS}},
)
def list_caches(services: ServicesDep) -> CacheList:
    """Every cache; a broken or incomplete one is listed with ``status`` and ``error``."""
    return CacheList(caches=_listing(services.caches))


@router.get("/{name}", response_model=CacheInfo, responses=_ERRORS)
def get_cache(name: Name, services: ServicesDep) -> CacheInfo:
    """Manifest (teacher, tokenizer fingerprint, k, dtypes, timestamps) and committed counts."""
    return _info(name, services.caches.open_reader(name))


@router.get("/{name}/lengths", response_model=CacheLengths, responses=_ERRORS)
def cache_lengths(
    name: Name,
    services: ServicesDep,
    start: int = Query(0, ge=0),
    stop: int | None = Query(None, ge=0),
) -> CacheLengths:
    """Token counts ``L_i`` of sequences ``[start, stop)`` (default: to the end)."""
    reader = services.caches.open_reader(name)
    n = reader.num_sequences
    stop = n if stop is None else stop
    start, stop = _range(start, stop, n, max(n, 1))
    lengths = reader.index.lengths_of(start, stop).tolist()  # the blocks of the range only
    return CacheLengths(start=start, stop=stop, lengths=lengths)


@router.get("/{name}/sequences", response_class=StreamingResponse, responses={**_ERRORS, **_FRAMES})
def cache_sequences(
    name: Name,
    services: ServicesDep,
    start: int = Query(0, ge=0),
    stop: int | None = Query(None, ge=0),
    compression: Compression = "none",
) -> StreamingResponse:
    """Sequences ``[start, stop)`` as wire frames."""
    reader = services.caches.open_reader(name)
    limit = services.settings.max_stream_sequences
    start, stop = _range(start, stop, reader.num_sequences, limit)
    headers = {
        "X-Logitcache-Start": str(start),
        "X-Logitcache-Stop": str(stop),
        "X-Logitcache-Num-Sequences": str(reader.num_sequences),
    }
    return StreamingResponse(
        _frames(reader, start, stop, compression), media_type=FRAMES_MEDIA_TYPE, headers=headers
    )


@router.get("/{name}/rows", response_class=StreamingResponse, responses={**_ERRORS, **_FRAMES})
def cache_rows(
    name: Name,
    services: ServicesDep,
    start: int = Query(ge=0),
    stop: int = Query(ge=0),
    compression: Compression = "none",
) -> StreamingResponse:
    """The sequences holding global rows ``[start, stop)`` as wire frames (see module doc)."""
    reader = services.caches.open_reader(name)
    if not 0 <= start < stop <= reader.num_rows:
        raise InvalidInputError(f"row range [{start}, {stop}) is outside [0, {reader.num_rows}]")
    index = reader.index  # a binary search over the index blocks, not every length
    first = index.first_from_row(start + 1) - 1
    last = index.first_from_row(stop)
    _range(first, last, reader.num_sequences, services.settings.max_stream_sequences)
    headers = {
        "X-Logitcache-First-Sequence": str(first),
        "X-Logitcache-First-Row": str(index.row_start(first)),
        "X-Logitcache-Num-Sequences": str(last - first),
    }
    return StreamingResponse(
        _frames(reader, first, last, compression), media_type=FRAMES_MEDIA_TYPE, headers=headers
    )
