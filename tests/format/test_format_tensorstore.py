"""A second Zarr implementation reads a store: tensorstore decodes every numeric array to the
values zarr-python reads, and the keys through ``seq_key_bytes`` + ``seq_key_end`` (FORMAT.md
§4: tensorstore does not support zarr's variable-length ``string`` dtype of ``seq_keys``)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import zarr
from format_support import make_manifest, make_records
from logitcache.cache_format import CacheReader, CacheWriter, Layout

# imported when a test runs, not at collection (~2 CPU-s in every pytest process otherwise)
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorstore") is None, reason="tensorstore is not installed"
)

TINY = Layout(row_chunk=4, row_shard=16, token_chunk=8, token_shard=32, seq_chunk=2, seq_shard=8)


def _open(path, name):
    import tensorstore as ts

    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path / name)}}
    return ts.open(spec, read=True).result()


@pytest.mark.parametrize("dtype", ["float16", "uint8"])
def test_tensorstore_reads_every_array_and_the_keys(tmp_path, dtype):
    url = tmp_path / "c"
    recs = make_records(9, seed=6, max_len=12)
    recs[3] = type(recs[3])(
        "ключ-λ",
        *(getattr(recs[3], f) for f in ("input_ids", "topk_ids")),
        recs[3].topk_logprobs,
        recs[3].tail_mass,
    )  # non-ASCII key
    m = make_manifest(logprob_dtype=dtype, id_remap=dtype == "uint8")
    with CacheWriter.open(url, m, layout=TINY, fsync=False) as w:
        w.append(recs[:4])
        w.append(recs[4:])
    r = CacheReader(url)
    m = r.manifest
    group = zarr.open_group(url, mode="r")
    numeric = [n for n, a in group.arrays() if a.dtype.kind in "iuf"]
    assert {"topk_ids", "topk_logprobs", "tail_mass", "input_ids", "seq_key_end"} <= set(numeric)
    for name in numeric:
        want = group[name][:]
        got = _open(url, name).read().result()
        assert got.dtype == want.dtype and np.array_equal(got, want), name
    ends = _open(url, "seq_key_end")[: m.num_sequences].read().result()
    raw = _open(url, "seq_key_bytes")[: m.num_key_bytes].read().result().tobytes()
    starts = np.concatenate([[0], ends[:-1]])
    keys = [raw[a:b].decode("utf-8") for a, b in zip(starts, ends, strict=True)]
    assert keys == r.keys and keys[3] == "ключ-λ"
