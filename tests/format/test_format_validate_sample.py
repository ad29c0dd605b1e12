"""``validate(sample=...)`` / ``logitcache validate --sample``: the rows and tokens of a seeded
sample of sequences, the whole sequence index and metadata always (FORMAT.md 7)."""

from __future__ import annotations

import numpy as np
import pytest
from format_support import SMALL, make_manifest, make_records
from logitcache.cache_format import CacheWriter, validate
from logitcache.client.cli import app
from typer.testing import CliRunner


@pytest.fixture
def store(tmp_path):
    url = tmp_path / "c"
    recs = make_records(60, k=6, vocab=300, seed=3, min_len=2, max_len=30)
    with CacheWriter.open(str(url), make_manifest(k=6, vocab_size=300), layout=SMALL) as w:
        w.append(recs)
    return url, recs


def test_sample_checks_a_seeded_subset(store):
    url, recs = store
    full = validate(str(url))
    assert full.ok and full.checked_rows == sum(r.length - 1 for r in recs)
    a = validate(str(url), sample=0.25, seed=1)
    b = validate(str(url), sample=0.25, seed=1)
    assert a.ok and a.checked_sequences == 60
    assert 0 < a.checked_rows < full.checked_rows and a.checked_rows == b.checked_rows
    assert validate(str(url), sample=60).checked_rows == full.checked_rows
    with pytest.raises(ValueError):
        validate(str(url), sample=0)


def test_sample_finds_damage_in_a_sampled_sequence(store):
    """Every sequence sampled (count = all) finds a flipped byte in any row shard; a sample of
    one sequence finds it exactly when that sequence's rows lie in the damaged chunk."""
    url, recs = store
    shard = url / "topk_ids" / "c" / "1" / "0"  # rows 32..63 (SMALL: shards of 32 rows)
    data = bytearray(shard.read_bytes())
    data[20] ^= 0x40  # inside chunk 0 of the shard: rows 32..39
    shard.write_bytes(bytes(data))
    assert not validate(str(url), sample=60).ok
    starts = np.concatenate([[0], np.cumsum([r.length - 1 for r in recs])])

    def hit(seed: int) -> bool:  # the one sampled sequence has rows in 32..39
        pick = np.random.default_rng(seed).choice(60, size=1, replace=False)[0]
        return bool(starts[pick] < 40 and starts[pick + 1] > 32)

    seeds = [next(x for x in range(1000) if hit(x) == want) for want in (True, False)]
    assert not validate(str(url), sample=1, seed=seeds[0]).ok
    assert validate(str(url), sample=1, seed=seeds[1]).ok


def test_cli_sample(store):
    url, _ = store
    res = CliRunner().invoke(app, ["validate", str(url), "--sample", "0.5", "--seed", "2"])
    assert res.exit_code == 0, res.output
    assert "OK" in res.output
    assert CliRunner().invoke(app, ["validate", str(url), "--sample", "-1"]).exit_code != 0
