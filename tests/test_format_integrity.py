"""No silent wrong data (issue #11): float16 output clipping, committed-count bounds, missing
objects as typed errors, and the writer lock invisible to stock zarr."""

from __future__ import annotations

import numpy as np
import pytest
from format_support import make_manifest, make_records
from logitcache.cache_format import CacheReader, CacheWriter, SequenceRecord


@pytest.mark.parametrize("dtype", ["float32", "uint8", "uint16", "float16"])
def test_float16_output_clips_to_finite_range(tmp_path, dtype):
    """rows/sequence(logprob_dtype="float16") never return -inf (FORMAT.md D3): values below
    -65504 come back as -65504, the others as the float32 decode rounded to float16."""
    rec = make_records(1, seed=3, min_len=6, max_len=6)[0]
    lp = rec.topk_logprobs.copy()
    lp[:, -1] = -1.0e5
    lp[2, -2:] = [-7.0e4, -9.0e4]
    rec = SequenceRecord("x", rec.input_ids, rec.topk_ids, lp, rec.tail_mass)
    with CacheWriter.open(tmp_path / "c", make_manifest(logprob_dtype=dtype), fsync=False) as w:
        w.append([rec])
    r = CacheReader(tmp_path / "c")
    f32 = r.rows(0, 5).topk_logprobs
    assert r.rows(0, 5, logprob_dtype="float16").topk_logprobs.dtype == np.float16
    for got in (
        r.rows(0, 5, logprob_dtype="float16").topk_logprobs,
        r.sequence(0, logprob_dtype="float16").topk_logprobs,  # a record holds float32
    ):
        assert np.isfinite(got).all()
        assert got[:, -1].tolist() == [-65504.0] * 5
        want = np.clip(f32, -65504, 0).astype(np.float16)
        assert np.array_equal(got, want)
