"""The spec and the bytes agree: ``tests/spec_reader.py`` (written from FORMAT.md alone, importing
nothing from the project or zarr) decodes every array of caches of every encoding, and of the
golden version-1 caches, to exactly the project reader's values; and it refuses, as R9 says, a
version-2 store with a lost shard."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from format_support import make_manifest, make_records
from logitcache.cache_format import CacheReader, CacheWriter, Layout, SequenceRecord
from spec_reader import SpecError, SpecStore

TINY = Layout(row_chunk=4, row_shard=16, token_chunk=8, token_shard=32, seq_chunk=2, seq_shard=8)
GOLDEN = sorted(
    p for p in (Path(__file__).resolve().parents[1] / "golden").glob("v*/*") if p.is_dir()
)
CASES = {
    "float16-default-layout": (dict(), None),
    "float32-tiny": (dict(logprob_dtype="float32", tail_mass_dtype="float16"), TINY),
    "uint8-remap-tiny": (dict(logprob_dtype="uint8", id_remap=True), TINY),
    "uint16-tiny": (dict(logprob_dtype="uint16"), TINY),
    "float16-entropy-tiny": (dict(entropy=True), TINY),
    "float16-actual-tiny": (dict(actual_logprob=True), TINY),
}


def _records() -> list[SequenceRecord]:
    recs = make_records(11, k=5, vocab=300, seed=12, max_len=14)
    r = recs[4]  # a tie row (step = 0), a value below -65504 and a non-ASCII key
    lp = r.topk_logprobs.copy()
    lp[0, :] = lp[0, 0]
    lp[1, -1] = -8.0e4
    recs[4] = SequenceRecord("ключ-λ", r.input_ids, r.topk_ids, lp, None)
    return recs


def _compare(path: Path) -> dict:
    spec = SpecStore(path).decode()
    r = CacheReader(path)
    assert spec["keys"] == r.keys
    assert np.array_equal(spec["lengths"], r.lengths)
    assert np.array_equal(spec["row_start"], r.row_starts)
    block = r.rows(0, r.num_rows)
    assert np.array_equal(spec["topk_ids"], block.topk_ids)
    assert np.array_equal(
        spec["topk_logprobs"].view(np.uint32), block.topk_logprobs.view(np.uint32)
    )
    assert np.array_equal(spec["tail_mass"].view(np.uint32), block.tail_mass.view(np.uint32))
    if block.entropy is not None:  # FORMAT.md 4.9
        assert np.array_equal(spec["entropy"].view(np.uint16), block.entropy.view(np.uint16))
    if block.actual_logprob is not None:  # FORMAT.md 4.12
        got = block.actual_logprob.view(np.uint32)
        assert np.array_equal(spec["actual_logprob"].view(np.uint32), got)
    assert np.array_equal(spec["input_ids"], r.tokens(0, r.num_tokens))
    for i in (0, r.num_sequences - 1):
        s = r.sequence(i)
        t0 = int(spec["token_start"][i])
        assert np.array_equal(spec["input_ids"][t0 : t0 + len(s.input_ids)], s.input_ids)
    return spec


@pytest.mark.parametrize("case", sorted(CASES))
def test_spec_reader_matches_project_reader(tmp_path, case):
    over, layout = CASES[case]
    url = tmp_path / "c"
    recs = _records()
    if over.get("entropy"):
        rng = np.random.default_rng(3)
        recs = [replace(r, entropy=rng.uniform(0, 5, r.num_rows)) for r in recs]
    if over.get("actual_logprob"):
        rng = np.random.default_rng(4)
        recs = [replace(r, actual_logprob=-rng.uniform(0, 9, r.num_rows)) for r in recs]
    with CacheWriter.open(url, make_manifest(k=5, vocab_size=300, **over), layout=layout) as w:
        w.append(recs[:6])
        w.append(recs[6:])
    spec = _compare(url)
    assert spec["key_bytes_keys"] == spec["keys"] and "ключ-λ" in spec["keys"]
    assert spec["key_index"] is not None and len(spec["key_index"]) == len(recs)  # 4.11 checked
    lp_dtype = over.get("logprob_dtype", "float16")
    assert spec["encodings"]["topk_logprobs"] == f"{lp_dtype}_row_delta"
    assert spec["encodings"]["topk_ids"] == ("id_rank" if over.get("id_remap") else "id")
    assert set(spec["encodings"]) >= {"seq_keys", "seq_key_bytes", "seq_key_end", "input_ids"}


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_spec_reader_reads_golden_caches(path):
    _compare(path)


def test_spec_reader_refuses_a_lost_shard(tmp_path):
    url = tmp_path / "c"
    with CacheWriter.open(url, make_manifest(k=5, vocab_size=300), layout=TINY) as w:
        w.append(_records())
    (url / "tail_mass" / "c" / "0").unlink()
    with pytest.raises(SpecError, match="R9"):
        SpecStore(url).decode()
