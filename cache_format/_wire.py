"""Wire codec: self-describing binary frames of sequence records (FORMAT.md §8, which fixes the
frame layout and its arrays), used by the service's block-streaming endpoints and the client.
A byte stream is a concatenation of independent frames; decoding returns float32 logprobs. A
frame of hidden records (FORMAT.md 4.10) has ``k = 0``."""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ._manifest import Manifest
from .errors import WireFormatError
from .hidden import HiddenRecord, from_bf16_bits, to_bf16_bits
from .records import SequenceRecord

MAGIC = b"LCWF"
WIRE_VERSION = 1
FLAG_ZSTD = 1
_PREFIX = struct.Struct("<4sHHIQ")
_CRC = struct.Struct("<I")
CONTENT_TYPE = "application/x-logitcache-frames"

_ALLOWED = {
    "input_ids": {"<i4"},
    "topk_ids": {"<i4"},
    "topk_logprobs": {"<f4", "<f2"},
    "tail_mass": {"<f4"},
    "loss_mask": {"|u1"},
    "entropy": {"<f2"},
    "actual_logprob": {"<f4"},
    "hidden": {"<f4"},
    "hidden_bf16": {"<u2"},
}


def exact_frame_dtype(manifest: Manifest) -> str:
    """The ``logprob_dtype`` in which a store's rows are read and sent as stored: ``bfloat16``
    for a hidden store (4.10), ``float16`` for a float16 one, else ``float32``."""
    if manifest.hidden is not None:
        return "bfloat16"
    return "float16" if manifest.logprob_dtype == "float16" else "float32"


def _mask_part(recs: Sequence[Any]) -> list[tuple[str, np.ndarray]]:
    if not any(r.loss_mask is not None for r in recs):
        return []
    masks = [np.ones(r.num_rows, np.uint8) if r.loss_mask is None else r.loss_mask for r in recs]
    return [("loss_mask", np.concatenate(masks).astype(np.uint8))]


def _hidden_parts(recs: Sequence[Any], dtype: str) -> list[tuple[str, np.ndarray]]:
    """The arrays of a frame of hidden records: float32, or bfloat16 bit patterns for
    ``dtype="bfloat16"`` (records holding bit patterns are sent as they are)."""
    if any(not isinstance(r, HiddenRecord) for r in recs):
        raise WireFormatError("a frame holds hidden records or top-k records, not both")
    if len({r.hidden.shape[1] for r in recs}) > 1:
        raise WireFormatError("hidden records in one frame must share d")
    h = np.concatenate([r.hidden for r in recs])
    if dtype == "bfloat16":
        part = ("hidden_bf16", h if h.dtype == np.uint16 else to_bf16_bits(h))
    else:
        part = ("hidden", from_bf16_bits(h) if h.dtype == np.uint16 else h.astype("<f4"))
    inp = np.concatenate([r.input_ids for r in recs]).astype("<i4")
    return [("input_ids", inp), part, *_mask_part(recs)]


#: The optional per-row arrays a frame may carry (FORMAT.md 4.9, 4.12) and their wire dtypes.
_EXTRA_DTYPES = {"entropy": "<f2", "actual_logprob": "<f4"}


def _extra_parts(recs: Sequence[Any]) -> list[tuple[str, np.ndarray]]:
    """The optional per-row arrays every record of a frame has (one some records lack is a
    :class:`WireFormatError`)."""
    parts = []
    for name, dt in _EXTRA_DTYPES.items():
        have = sum(getattr(r, name) is not None for r in recs)
        if have not in (0, len(recs)):
            raise WireFormatError(f"records in one frame must all have {name} or none")
        if have:
            parts.append((name, np.concatenate([getattr(r, name) for r in recs]).astype(dt)))
    return parts


def encode_records(
    records: Sequence[SequenceRecord],
    *,
    logprob_dtype: str = "float32",
    compression: str = "none",
) -> bytes:
    """One frame holding ``records`` (all with the same ``k``). ``logprob_dtype``: ``float32`` or
    ``float16`` (exact for a float16 cache's rows); ``compression``: ``none`` or ``zstd``. Tail
    masses are sent when any record has one (computed for the others)."""
    recs = list(records)
    hidden = bool(recs) and isinstance(recs[0], HiddenRecord)
    allowed = ("float32", "bfloat16") if hidden else ("float32", "float16")
    if logprob_dtype not in allowed:
        raise WireFormatError(f"logprob_dtype must be one of {allowed}, not {logprob_dtype!r}")
    if compression not in ("none", "zstd"):
        raise WireFormatError(f"compression must be 'none' or 'zstd', not {compression!r}")
    ks = {0} if hidden else {getattr(r, "k", 0) for r in recs}
    if len(ks) > 1:
        raise WireFormatError(f"records in one frame must share k, got {sorted(ks)}")
    k = ks.pop() if ks else 0
    lp_dt = "<f4" if logprob_dtype == "float32" else "<f2"
    parts: list[tuple[str, np.ndarray]] = []
    if hidden:
        parts = _hidden_parts(recs, logprob_dtype)
    elif recs:
        parts = [
            ("input_ids", np.concatenate([r.input_ids for r in recs]).astype("<i4")),
            ("topk_ids", np.concatenate([r.topk_ids for r in recs]).astype("<i4")),
            ("topk_logprobs", np.concatenate([r.topk_logprobs for r in recs]).astype(lp_dt)),
        ]
        if any(r.tail_mass is not None for r in recs):
            parts.append(
                ("tail_mass", np.concatenate([r.tail_or_computed() for r in recs]).astype("<f4"))
            )
        parts += _mask_part(recs)
        parts += _extra_parts(recs)
    payload = b"".join(np.ascontiguousarray(a).tobytes() for _, a in parts)
    raw_len = len(payload)
    flags = 0
    if compression == "zstd":
        from numcodecs import Zstd

        payload = bytes(Zstd(level=1).encode(payload))
        flags |= FLAG_ZSTD
    header = json.dumps(
        {
            "n": len(recs),
            "k": k,
            "keys": [r.key for r in recs],
            "lengths": [r.length for r in recs],
            "arrays": [{"name": n, "dtype": a.dtype.str, "shape": list(a.shape)} for n, a in parts],
            "raw_len": raw_len,
        },
        separators=(",", ":"),
    ).encode()
    body = header + payload
    return b"".join(
        [
            _PREFIX.pack(MAGIC, WIRE_VERSION, flags, len(header), len(payload)),
            body,
            _CRC.pack(zlib.crc32(body)),
        ]
    )


def _frame_size(buf: memoryview, pos: int) -> int | None:
    """Total size of the frame starting at ``pos``, or None if its prefix is incomplete."""
    if len(buf) - pos < _PREFIX.size:
        return None
    magic, version, _flags, hlen, plen = _PREFIX.unpack_from(buf, pos)
    if magic != MAGIC:
        raise WireFormatError(f"bad frame magic {bytes(magic)!r} at byte {pos}")
    if version != WIRE_VERSION:
        raise WireFormatError(f"unsupported wire version {version} (this library reads 1)")
    return _PREFIX.size + hlen + plen + _CRC.size


def _decode_frame(frame: memoryview) -> list[Any]:
    _magic, _version, flags, hlen, plen = _PREFIX.unpack_from(frame, 0)
    body = frame[_PREFIX.size : _PREFIX.size + hlen + plen]
    (crc,) = _CRC.unpack_from(frame, _PREFIX.size + hlen + plen)
    if zlib.crc32(body) != crc:
        raise WireFormatError("frame CRC32 mismatch (corrupted or truncated data)")
    try:
        header = json.loads(bytes(body[:hlen]))
        n, lengths, keys = int(header["n"]), header["lengths"], header["keys"]
        specs = header["arrays"]
        raw_len = int(header["raw_len"])
    except (ValueError, KeyError, TypeError) as e:
        raise WireFormatError(f"bad frame header: {e}") from e
    payload = bytes(body[hlen:])
    if flags & FLAG_ZSTD:
        from numcodecs import Zstd

        payload = bytes(Zstd().decode(payload))
    if len(payload) != raw_len or len(lengths) != n or len(keys) != n:
        raise WireFormatError("frame header disagrees with its payload")
    arrays: dict[str, np.ndarray] = {}
    pos = 0
    for s in specs:
        name, dt, shape = s.get("name"), s.get("dtype"), tuple(s.get("shape", ()))
        if name not in _ALLOWED or dt not in _ALLOWED[name]:
            raise WireFormatError(f"unexpected array {name!r} of dtype {dt!r} in frame")
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
        if pos + nbytes > len(payload):
            raise WireFormatError(f"array {name} overruns the payload")
        arrays[name] = np.frombuffer(
            payload, dtype=dt, count=nbytes // np.dtype(dt).itemsize, offset=pos
        ).reshape(shape)
        pos += nbytes
    if n == 0:
        return []
    if "hidden" in arrays or "hidden_bf16" in arrays:
        return _hidden_records(arrays, keys, lengths)
    need = {"input_ids", "topk_ids", "topk_logprobs"}
    if not need <= arrays.keys():
        raise WireFormatError(f"frame lacks arrays {sorted(need - arrays.keys())}")
    total = int(sum(lengths))
    if arrays["input_ids"].shape != (total,) or arrays["topk_ids"].shape[0] != total - n:
        raise WireFormatError("frame array shapes disagree with lengths")
    lp = arrays["topk_logprobs"].astype(np.float32)
    tail = arrays.get("tail_mass")
    mask, ent, act = (arrays.get(x) for x in ("loss_mask", "entropy", "actual_logprob"))
    for name in ("tail_mass", "loss_mask", *_EXTRA_DTYPES):
        if name in arrays and arrays[name].shape != (total - n,):
            raise WireFormatError(f"frame array {name} shape disagrees with lengths")
    out, t, r = [], 0, 0
    for key, L in zip(keys, lengths, strict=True):
        L = int(L)
        out.append(
            SequenceRecord(
                key,
                arrays["input_ids"][t : t + L].copy(),
                arrays["topk_ids"][r : r + L - 1].copy(),
                lp[r : r + L - 1].copy(),
                None if tail is None else tail[r : r + L - 1].copy(),
                None if mask is None else mask[r : r + L - 1].copy(),
                None if ent is None else ent[r : r + L - 1].astype(np.float32),
                None if act is None else act[r : r + L - 1].copy(),
            )
        )
        t, r = t + L, r + L - 1
    return out


def _hidden_records(arrays: dict[str, np.ndarray], keys: list, lengths: list) -> list[Any]:
    """The :class:`HiddenRecord` of a hidden frame (its arrays checked against ``lengths``)."""
    total, n = int(sum(lengths)), len(lengths)
    h = arrays.get("hidden", arrays.get("hidden_bf16"))
    assert h is not None
    mask = arrays.get("loss_mask")
    if (
        "input_ids" not in arrays
        or arrays["input_ids"].shape != (total,)
        or h.ndim != 2
        or h.shape[0] != total - n
        or (mask is not None and mask.shape != (total - n,))
        or not {"topk_ids", "topk_logprobs", "tail_mass"}.isdisjoint(arrays)
    ):
        raise WireFormatError("hidden frame's arrays disagree with its lengths")
    out: list[Any] = []
    t = r = 0
    for key, L in zip(keys, lengths, strict=True):
        L = int(L)
        if not isinstance(key, str) or not key or L < 2:
            raise WireFormatError(f"bad record in hidden frame: key {key!r}, length {L}")
        m = None if mask is None else mask[r : r + L - 1].copy()
        ids = arrays["input_ids"][t : t + L].astype(np.int32)
        out.append(HiddenRecord.trusted(key, ids, h[r : r + L - 1].copy(), m))
        t, r = t + L, r + L - 1
    return out


class FrameDecoder:
    """Incremental decoder of a byte stream of frames: ``feed(chunk)`` returns the records of every
    frame ``chunk`` completes; ``close()`` raises :class:`WireFormatError` on a partial frame."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> list[SequenceRecord]:
        self._buf += chunk
        out: list[SequenceRecord] = []
        pos = 0
        view = memoryview(self._buf)
        try:
            while True:
                size = _frame_size(view, pos)
                if size is None or len(view) - pos < size:
                    break
                out.extend(_decode_frame(view[pos : pos + size]))
                pos += size
        finally:
            view.release()
        del self._buf[:pos]
        return out

    def close(self) -> None:
        if self._buf:
            raise WireFormatError(f"stream ended inside a frame ({len(self._buf)} bytes left)")


def decode_records(data: bytes | bytearray | memoryview) -> list[SequenceRecord]:
    """Records of every frame in ``data`` (one frame or several concatenated)."""
    dec = FrameDecoder()
    out = dec.feed(bytes(data))
    dec.close()
    return out


def iter_decode(chunks: Iterable[bytes]) -> Iterable[SequenceRecord]:
    """Yield records from an iterable of byte chunks (frames may span chunks)."""
    dec = FrameDecoder()
    for chunk in chunks:
        yield from dec.feed(chunk)
    dec.close()
