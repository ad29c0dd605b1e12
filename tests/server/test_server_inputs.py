"""Server input handling and the job table, on real files and a real SQLite database."""

from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from logitcache.cache_format import content_key
from logitcache.protocol import InlineRecord, InputFile, JobState
from logitcache.server import inputs
from logitcache.server.caches import check_name
from logitcache.server.errors import (
    InvalidCacheNameError,
    InvalidInputError,
    InvalidPathError,
    NotFoundError,
    PayloadTooLargeError,
)
from logitcache.server.job_store import JobStore

LIMITS = inputs.Limits(vocab_size=100, max_seq_len=8)


def fake_tokenize(text: str) -> list[int]:
    """A deterministic stand-in tokenizer for input plumbing (the engine's is tested elsewhere)."""
    return [1] + [ord(c) % 100 for c in text]


def test_check_ids_accepts_and_rejects() -> None:
    arr = inputs.check_ids([1, 2, 99], LIMITS, "x")
    assert arr.dtype == np.int32 and arr.tolist() == [1, 2, 99]
    with pytest.raises(InvalidInputError, match="at least 2 tokens"):
        inputs.check_ids([5], LIMITS, "x")
    with pytest.raises(InvalidInputError, match="token id 100 outside"):
        inputs.check_ids([1, 100], LIMITS, "x")
    with pytest.raises(InvalidInputError, match="token id -1 outside"):
        inputs.check_ids([-1, 3], LIMITS, "x")
    with pytest.raises(InvalidInputError, match="list of integers"):
        inputs.check_ids([1, 2.5], LIMITS, "x")
    with pytest.raises(InvalidInputError, match="list of integers"):
        inputs.check_ids([True, 2], LIMITS, "x")
    with pytest.raises(PayloadTooLargeError, match="max sequence length 8"):
        inputs.check_ids(list(range(9)), LIMITS, "x")


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ".hidden", "a..b", "", "x" * 129, "a b"])
def test_bad_cache_names(name: str) -> None:
    with pytest.raises(InvalidCacheNameError):
        check_name(name)


def test_good_cache_names() -> None:
    for name in ("a", "my-cache_1.v2", "X" * 128):
        assert check_name(name) == name


def test_input_path_must_stay_in_data_dir(tmp_path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "ok.jsonl").write_text("{}\n")
    (tmp_path / "secret.jsonl").write_text("{}\n")
    os.symlink(tmp_path / "secret.jsonl", data / "link.jsonl")
    assert inputs.resolve_input_path(data, "ok.jsonl") == (data / "ok.jsonl").resolve()
    for bad in ("../secret.jsonl", str(tmp_path / "secret.jsonl"), "link.jsonl", "missing.jsonl"):
        with pytest.raises(InvalidPathError):
            inputs.resolve_input_path(data, bad)


def test_jsonl_and_parquet_give_the_same_sequences(tmp_path) -> None:
    rows = [
        {"id": "a", "text": "hello"},
        {"input_ids": [1, 2, 3]},
        {"id": 7, "input_ids": [4, 5]},
        {"input_ids": [1, 2, 3]},  # same content as row 1: deduplicated
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    table = pa.table(
        {
            "id": ["a", None, "7", None],
            "text": ["hello", None, None, None],
            "input_ids": [None, [1, 2, 3], [4, 5], [1, 2, 3]],
        }
    )
    pq.write_table(table, tmp_path / "in.parquet")
    got = {}
    for name in ("in.jsonl", "in.parquet"):
        raws = inputs.raw_records(file=InputFile(path=name), records=None, data_dir=tmp_path)
        got[name] = [
            (s.key, s.input_ids.tolist()) for s in inputs.sequences(raws, fake_tokenize, LIMITS)
        ]
    assert got["in.jsonl"] == got["in.parquet"]
    assert got["in.jsonl"] == [
        ("a", fake_tokenize("hello")),
        (content_key(np.array([1, 2, 3])), [1, 2, 3]),
        ("7", [4, 5]),
    ]


def test_scan_lists_every_bad_record_and_counts(tmp_path) -> None:
    recs = [
        InlineRecord(text="ok"),
        InlineRecord(input_ids=[1]),
        InlineRecord(input_ids=[1, 500]),
        InlineRecord(id="d", text="x", input_ids=[1, 2]),
        InlineRecord(id="d", input_ids=[1, 2]),
        InlineRecord(id="d", input_ids=[1, 3]),
    ]
    with pytest.raises(InvalidInputError) as e:
        inputs.scan(
            inputs.raw_records(file=None, records=recs, data_dir=tmp_path), fake_tokenize, LIMITS
        )
    detail = e.value.detail
    assert len(detail) == 4, detail
    assert "records[1]" in detail[0] and "records[2]" in detail[1]
    assert "exactly one" in detail[2] and "more than once" in detail[3]
    good = [InlineRecord(text="ok"), InlineRecord(input_ids=[1, 2, 3]), InlineRecord(text="ok")]
    s = inputs.scan(
        inputs.raw_records(file=None, records=good, data_dir=tmp_path), fake_tokenize, LIMITS
    )
    assert (s.sequences, s.tokens) == (2, 6)
    with pytest.raises(InvalidInputError, match="no sequence"):
        (tmp_path / "empty.jsonl").write_text("\n")
        inputs.scan(
            inputs.raw_records(file=InputFile(path="empty.jsonl"), records=None, data_dir=tmp_path),
            fake_tokenize,
            LIMITS,
        )


def test_bad_json_line_is_reported_with_its_line(tmp_path) -> None:
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{not json\n')
    raws = inputs.raw_records(file=InputFile(path="bad.jsonl"), records=None, data_dir=tmp_path)
    with pytest.raises(InvalidInputError, match=r"bad.jsonl:2: invalid JSON"):
        inputs.scan(raws, fake_tokenize, LIMITS)


def test_batches_are_a_pure_function_of_the_input() -> None:
    rng = np.random.default_rng(0)
    seqs = [
        inputs.Sequence(key=str(i), input_ids=np.zeros(int(n), np.int32))
        for i, n in enumerate(rng.integers(2, 50, size=200))
    ]
    a = [[s.key for s in b] for b in inputs.batches(seqs, max_sequences=16, max_tokens=200)]
    b = [[s.key for s in b] for b in inputs.batches(seqs, max_sequences=16, max_tokens=200)]
    assert a == b
    assert [k for batch in a for k in batch] == [s.key for s in seqs]
    lengths = {s.key: s.length for s in seqs}
    for batch in a:
        assert len(batch) <= 16
        assert len(batch) == 1 or sum(lengths[k] for k in batch) <= 200


def test_job_store_transitions_survive_reopen(tmp_path) -> None:
    db = tmp_path / "jobs.sqlite"
    store = JobStore(db)
    job = store.create(
        cache="c", k=4, spec={"cache": "c"}, input_digest="d", sequences_total=10, tokens_total=100
    )
    assert job.state == JobState.queued and store.next_queued().id == job.id
    assert store.start(job.id)
    assert not store.start(job.id)  # no longer queued
    store.progress(job.id, sequences_done=3, tokens_done=30)
    store.close()
    store = JobStore(db)  # a restart: the running job is queued again, progress kept
    assert store.requeue_interrupted() == 1
    again = store.get(job.id)
    assert (again.state, again.sequences_done, again.tokens_done) == (JobState.queued, 3, 30)
    cancelled = store.request_cancel(job.id)
    assert cancelled.state == JobState.cancelled and cancelled.cancel_requested
    assert not store.start(job.id)
    other = store.create(
        cache="c", k=4, spec={}, input_digest="d", sequences_total=1, tokens_total=2
    )
    store.start(other.id)
    store.finish(other.id, JobState.failed, "boom")
    assert store.get(other.id).errors == ["boom"]
    assert store.request_cancel(other.id).state == JobState.failed  # terminal: unchanged
    with pytest.raises(NotFoundError):
        store.get("nope")
    store.close()
