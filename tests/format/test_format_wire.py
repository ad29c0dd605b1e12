"""Wire codec frames: exact round trip, streaming decode across chunk borders, typed errors."""

from __future__ import annotations

import numpy as np
import pytest
from format_support import make_records
from logitcache.cache_format import (
    FrameDecoder,
    WireFormatError,
    decode_records,
    encode_records,
    iter_decode,
)


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_roundtrip_exact(compression):
    recs = make_records(7, seed=5)
    blob = encode_records(recs, compression=compression)
    out = decode_records(blob)
    assert len(out) == 7 and all(a.equals(b) for a, b in zip(out, recs, strict=True))
    raw = sum(
        r.input_ids.nbytes + r.topk_ids.nbytes + r.topk_logprobs.nbytes + r.tail_mass.nbytes
        for r in recs
    )
    if compression == "none":
        assert raw < len(blob) < raw + 2000  # binary, small self-describing header
    else:
        assert len(blob) < raw


def test_float16_and_no_tail():
    recs = [
        r.__class__(r.key, r.input_ids, r.topk_ids, r.topk_logprobs, None)
        for r in make_records(3, seed=6)
    ]
    out = decode_records(encode_records(recs, logprob_dtype="float16"))
    assert all(o.tail_mass is None for o in out)
    for o, r in zip(out, recs, strict=True):
        np.testing.assert_array_equal(
            o.topk_logprobs, r.topk_logprobs.astype(np.float16).astype(np.float32)
        )
    assert decode_records(encode_records([])) == []


def test_stream_of_frames_split_anywhere():
    recs = make_records(9, seed=7)
    blob = b"".join(encode_records(recs[i : i + 3]) for i in range(0, 9, 3))
    chunks = [blob[i : i + 97] for i in range(0, len(blob), 97)]
    out = list(iter_decode(chunks))
    assert [r.key for r in out] == [r.key for r in recs]
    dec = FrameDecoder()
    assert dec.feed(blob[:50]) == []
    with pytest.raises(WireFormatError, match="inside a frame"):
        dec.close()


def test_corrupt_frames_rejected():
    blob = bytearray(encode_records(make_records(2, seed=8)))
    with pytest.raises(WireFormatError, match="magic"):
        decode_records(b"XXXX" + bytes(blob[4:]))
    bumped = bytearray(blob)
    bumped[4] = 9
    with pytest.raises(WireFormatError, match="version"):
        decode_records(bytes(bumped))
    flipped = bytearray(blob)
    flipped[-10] ^= 1
    with pytest.raises(WireFormatError, match="CRC"):
        decode_records(bytes(flipped))
    with pytest.raises(WireFormatError, match="inside a frame"):
        decode_records(bytes(blob[:-1]))
    with pytest.raises(WireFormatError, match="share k"):
        encode_records(make_records(1, k=4) + make_records(1, k=5))
