"""Compatibility: every golden cache of every format version (tests/golden/v*/) still reads.

The golden caches were written by the library at their version (tests/golden/make_golden.py)
and are never rebuilt; ``*.expected.npz`` holds what the reader of that version returned. Today's
reader must return exactly these values on every read path (direct shard read and zarr), and
``validate`` must pass them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from logitcache.cache_format import CacheReader, validate

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
CACHES = sorted(p for p in GOLDEN.glob("v*/*") if p.is_dir())


def test_golden_caches_exist():
    assert {p.name for p in CACHES} >= {"float16", "float32_remap_tiny", "uint8_f16tail_tiny"}
    assert sum(f.stat().st_size for f in GOLDEN.rglob("*") if f.is_file()) < 200_000


@pytest.fixture(params=CACHES, ids=lambda p: f"{p.parent.name}/{p.name}")
def golden(request, tmp_path) -> tuple[Path, dict]:
    """A copy of one golden cache (reading must not need write access, but never risk the
    committed bytes) and its expected values."""
    src: Path = request.param
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    exp = np.load(src.parent / f"{src.name}.expected.npz")
    return dst, {n: exp[n] for n in exp.files}


@pytest.mark.parametrize("direct", [True, False])
def test_golden_reads_bit_exact(golden, direct):
    path, exp = golden
    r = CacheReader(path, direct=direct)
    assert r.keys == [str(x) for x in exp["keys"]]
    assert np.array_equal(r.lengths, exp["lengths"])
    tok = np.concatenate([[0], np.cumsum(exp["lengths"])])
    row = np.concatenate([[0], np.cumsum(exp["lengths"] - 1)])
    seqs = r.sequences(range(r.num_sequences))
    for i, s in enumerate(seqs):
        assert s.key == exp["keys"][i]
        assert np.array_equal(s.input_ids, exp["input_ids"][tok[i] : tok[i + 1]])
        assert np.array_equal(s.topk_ids, exp["topk_ids"][row[i] : row[i + 1]])
        assert np.array_equal(s.topk_logprobs, exp["topk_logprobs"][row[i] : row[i + 1]])
        assert np.array_equal(s.tail_mass, exp["tail_mass"][row[i] : row[i + 1]])
        assert r.get(s.key).key == s.key
    block = r.rows(0, r.num_rows)
    assert np.array_equal(block.topk_ids, exp["topk_ids"])
    assert np.array_equal(block.topk_logprobs, exp["topk_logprobs"])
    assert np.array_equal(block.tail_mass, exp["tail_mass"])
    assert np.array_equal(r.tokens(0, r.num_tokens), exp["input_ids"])
    f16 = r.rows(0, r.num_rows, logprob_dtype="float16").topk_logprobs
    assert f16.dtype == np.float16 and np.isfinite(f16).all()


def test_golden_validate_ok(golden):
    path, _ = golden
    report = validate(path)
    assert report.ok, str(report)
