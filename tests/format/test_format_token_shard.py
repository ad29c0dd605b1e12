"""The default ``input_ids`` / ``seq_key_bytes`` shard is 65,536 tokens (issue #19, was
1,048,576): new stores get it, stores created with the old shard keep theirs on append."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
from format_support import make_manifest, make_records
from logitcache.cache_format import CacheReader, CacheWriter, spec, validate

OLD = replace(spec.DEFAULT_LAYOUT, token_shard=1_048_576)


def _shard(url: Path, name: str) -> int:
    """The array's shard length (zarr v3: the chunk grid of a sharded array)."""
    meta = json.loads((url / name / "zarr.json").read_text())
    return meta["chunk_grid"]["configuration"]["chunk_shape"][0]


def test_new_default_and_old_stores_keep_their_token_shard(tmp_path: Path) -> None:
    assert spec.DEFAULT_LAYOUT.token_shard == 65_536
    assert spec.DEFAULT_LAYOUT.token_shard % spec.DEFAULT_LAYOUT.token_chunk == 0
    recs = make_records(12, k=4, vocab=100, seed=1)
    m = make_manifest(k=4, vocab_size=100)
    for name, layout in (("new", None), ("old", OLD)):
        url = tmp_path / name
        with CacheWriter.open(url, m, layout=layout) as w:
            w.append(recs[:5])
        with CacheWriter.open(url, m) as w:  # a later writer, default layout: the store's own
            w.append(recs[5:])
        want = 1_048_576 if name == "old" else 65_536
        for arr in (spec.INPUT_IDS, spec.SEQ_KEY_BYTES):
            assert _shard(url, arr) == want, (name, arr)
        r = CacheReader(url)
        assert r.layout_name == "default"
        assert r.keys == [x.key for x in recs]
        for i, x in enumerate(recs):
            assert np.array_equal(r.sequence(i).input_ids, x.input_ids)
        assert validate(url).ok
