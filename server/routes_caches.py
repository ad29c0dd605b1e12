"""Caches: list, describe, and stream blocks to clients as wire frames.

Block streaming (``Accept`` is not needed: these answer ``application/x-logitcache-frames``):

* ``GET /v1/caches/{name}/sequences?start=&stop=``: sequences ``[start, stop)`` in storage order;
* ``GET /v1/caches/{name}/rows?start=&stop=``: the whole sequences that hold global rows
  ``[start, stop)``; headers ``X-Logitcache-First-Sequence`` and ``X-Logitcache-First-Row`` say
  where the first returned sequence starts, so a client can cut the exact rows.

The body is a concatenation of frames of at most ``FRAME_SEQUENCES`` sequences each
(``logitcache.cache_format.iter_decode`` reads it incrementally). Logprobs travel as float16 when
the cache stores float16 (exact), else float32. ``compression=zstd`` compresses each frame.
Ranges are checked against the committed snapshot at the time of the request.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import numpy as np
from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse
from logitcache.cache_format import CacheReader, encode_records

from .deps import ServicesDep
from .errors import InvalidInputError, PayloadTooLargeError
from .protocol import FRAMES_MEDIA_TYPE, CacheInfo, CacheList, ErrorResponse

router = APIRouter(prefix="/v1/caches", tags=["caches"])

#: Sequences per wire frame in streamed answers.
FRAME_SEQUENCES = 256

_ERRORS = {401: {"model": ErrorResponse}, 404: {"model": ErrorResponse}}
_FRAMES = {200: {"content": {FRAMES_MEDIA_TYPE: {}}, "description": "wire frames"}}


def _info(name: str, reader: CacheReader) -> CacheInfo:
    return CacheInfo(
        name=name,
        manifest=reader.manifest.to_attrs(),
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
    lp_dtype = "float16" if reader.manifest.logprob_dtype == "float16" else "float32"
    for a in range(start, stop, FRAME_SEQUENCES):
        records = reader.sequences(range(a, min(stop, a + FRAME_SEQUENCES)))
        yield encode_records(records, logprob_dtype=lp_dtype, compression=compression)


@router.get("", response_model=CacheList, responses=_ERRORS)
def list_caches(services: ServicesDep) -> CacheList:
    caches = services.caches
    return CacheList(caches=[_info(n, caches.reader(n)) for n in caches.names()])


@router.get("/{name}", response_model=CacheInfo, responses=_ERRORS)
def get_cache(name: str, services: ServicesDep) -> CacheInfo:
    """Manifest (teacher, tokenizer fingerprint, k, dtypes, timestamps) and committed counts."""
    return _info(name, services.caches.reader(name))


@router.get("/{name}/lengths", responses=_ERRORS)
def cache_lengths(
    name: str,
    services: ServicesDep,
    start: int = Query(0, ge=0),
    stop: int | None = Query(None, ge=0),
) -> dict[str, object]:
    """Token counts ``L_i`` of sequences ``[start, stop)`` (default: to the end)."""
    reader = services.caches.reader(name)
    n = reader.num_sequences
    stop = n if stop is None else stop
    start, stop = _range(start, stop, n, max(n, 1))
    return {"start": start, "stop": stop, "lengths": reader.lengths[start:stop].tolist()}


@router.get("/{name}/sequences", response_class=StreamingResponse, responses={**_ERRORS, **_FRAMES})
def cache_sequences(
    name: str,
    services: ServicesDep,
    start: int = Query(0, ge=0),
    stop: int | None = Query(None, ge=0),
    compression: Literal["none", "zstd"] = "none",
) -> StreamingResponse:
    """Sequences ``[start, stop)`` as wire frames."""
    reader = services.caches.reader(name)
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
    name: str,
    services: ServicesDep,
    start: int = Query(ge=0),
    stop: int = Query(ge=0),
    compression: Literal["none", "zstd"] = "none",
) -> StreamingResponse:
    """The sequences holding global rows ``[start, stop)`` as wire frames (see module doc)."""
    reader = services.caches.reader(name)
    if not 0 <= start < stop <= reader.num_rows:
        raise InvalidInputError(f"row range [{start}, {stop}) is outside [0, {reader.num_rows}]")
    row_starts = reader.row_starts
    first = int(np.searchsorted(row_starts, start, side="right")) - 1
    last = int(np.searchsorted(row_starts, stop, side="left"))
    _range(first, last, reader.num_sequences, services.settings.max_stream_sequences)
    headers = {
        "X-Logitcache-First-Sequence": str(first),
        "X-Logitcache-First-Row": str(int(row_starts[first])),
        "X-Logitcache-Num-Sequences": str(last - first),
    }
    return StreamingResponse(
        _frames(reader, first, last, compression), media_type=FRAMES_MEDIA_TYPE, headers=headers
    )
