"""Crash safety on a local store: a writer subprocess is SIGKILLed (at chosen points inside the
append transaction, and at random times); committed sequences must read back bit-exact, the
store must validate, and a new writer must resume without duplicates or holes."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from format_support import CHILD_K, CHILD_VOCAB, make_manifest, make_records
from logitcache.cache_format import CacheReader, CacheWriter, validate

SUPPORT = str(Path(__file__).resolve().parents[1] / "format_support.py")
N, BATCH = 30, 5
NUM_ARRAYS = 8  # float16 store: topk_ids, topk_logprobs, tail_mass, input_ids, 4 sequence arrays


def run_child(*args: object, options: dict | None = None, timeout: float = 120):
    cmd = [
        sys.executable,
        SUPPORT,
        "append",
        str(args[0]),
        json.dumps(options or {}),
        *map(str, args[1:]),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def expected(n: int = N, seed: int = 7):
    return make_records(n, k=CHILD_K, vocab=CHILD_VOCAB, seed=seed)


def check_prefix(url, recs, options=None) -> int:
    """Every committed sequence equals the expected record bit-exact (after float16 storage)."""
    r = CacheReader(url, options)
    n = r.num_sequences
    assert r.keys == [x.key for x in recs[:n]]
    for got, want in zip(r.sequences(range(n)), recs[:n], strict=True):
        assert np.array_equal(got.input_ids, want.input_ids)
        assert np.array_equal(got.topk_ids, want.topk_ids)
        lp16 = want.topk_logprobs.astype(np.float16).astype(np.float32)
        assert np.array_equal(got.topk_logprobs, lp16)
        assert np.array_equal(got.tail_mass, want.tail_mass)
    report = validate(url, options)
    assert report.ok, str(report)
    return n


def resume_and_check(url, recs, committed: int, options=None, **open_kw) -> None:
    m = make_manifest(k=CHILD_K, vocab_size=CHILD_VOCAB)
    with CacheWriter.open(url, m, options, **open_kw) as w:
        if not str(url).startswith("s3://"):  # the killed writer's temporaries are gone
            assert not list(Path(url).rglob("*.partial"))
        assert w.num_sequences == committed
        assert w.append(recs) == len(recs) - committed  # no duplicates
    assert check_prefix(url, recs, options) == len(recs)  # no holes


@pytest.mark.parametrize("crash_after", [0, 3, NUM_ARRAYS])
def test_sigkill_inside_append(tmp_path, crash_after):
    url = tmp_path / "c"
    proc = run_child(url, N, BATCH, 7, 2, crash_after)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout.split() == ["COMMITTED", "5", "COMMITTED", "10"]
    recs = expected()
    assert check_prefix(url, recs) == 10  # the killed append is not visible
    resume_and_check(url, recs, 10)


def test_sigkill_at_random_times(tmp_path):
    rng = random.Random(1234)
    recs = expected(60, seed=9)
    for trial in range(2):
        url = tmp_path / f"c{trial}"
        cmd = [sys.executable, SUPPORT, "append", str(url), "{}", "60", "2", "9"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        seen = 0
        for line in proc.stdout:  # wait for two commits, then kill at a random moment
            seen = int(line.split()[1])
            if seen >= 4:
                break
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        committed = check_prefix(url, recs)
        assert committed >= seen
        resume_and_check(url, recs, committed)


def test_reopening_for_writing_removes_a_killed_writers_temporaries(tmp_path):
    """``*.partial`` files (a write killed between its temporary file and the rename) are
    deleted when the store is next opened for writing; readers leave them alone."""
    url = tmp_path / "c"
    recs = expected()
    m = make_manifest(k=CHILD_K, vocab_size=CHILD_VOCAB)
    with CacheWriter.open(url, m) as w:
        w.append(recs[:10])
    leftovers = [
        url / "topk_ids" / "c" / "1.0.1a2b3c4d5e6f7.partial",
        url / "zarr.9f8e7d6c5b4.partial",
    ]
    for p in leftovers:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"half an object")
    assert check_prefix(url, recs) == 10
    assert all(p.exists() for p in leftovers)  # reading deletes nothing
    resume_and_check(url, recs, 10)
    assert not any(p.exists() for p in leftovers)


def test_interrupted_creation_is_recreated(tmp_path):
    """A store left between creation start and its first commit (W6) is re-created on open."""
    import zarr
    from logitcache.cache_format.layout import (
        INCOMPLETE_ATTR,
        array_defs,
        create_array,
        write_root_attrs,
    )

    url = tmp_path / "c"
    store = zarr.storage.LocalStore(url)
    m = make_manifest(k=CHILD_K, vocab_size=CHILD_VOCAB)
    write_root_attrs(store, {"format_version": 1, INCOMPLETE_ATTR: True})
    create_array(store, array_defs(m)[0], m.k)  # died after the first array
    with pytest.raises(Exception, match="no committed logitcache manifest"):
        CacheReader(url)
    recs = expected(6)
    with CacheWriter.open(url, m) as w:
        assert w.append(recs) == 6
    assert check_prefix(url, recs) == 6
