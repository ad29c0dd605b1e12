"""SequenceBatch, the columnar append: bad input is a typed error naming the sequence at fault
and writes nothing; a batch's sequences read back as appended; records given to the writer get
back the tail it computed for them. (Bytes: test_format_append_golden.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from format_support import make_manifest, make_records
from logitcache.cache_format import (
    CacheReader,
    CacheWriter,
    RecordError,
    SequenceBatch,
    SequenceRecord,
    content_key,
    known_tail,
)

K, VOCAB = 4, 100


def _batch(n: int = 12, seed: int = 0, **kw: object) -> dict:
    recs = make_records(n, k=K, vocab=VOCAB, seed=seed, max_len=6)
    fields = dict(
        input_ids=np.concatenate([r.input_ids for r in recs]),
        offsets=np.concatenate([[0], np.cumsum([r.length for r in recs])]),
        topk_ids=np.concatenate([r.topk_ids for r in recs]),
        topk_logprobs=np.concatenate([r.topk_logprobs for r in recs]),
        keys=[r.key for r in recs],
    )
    fields.update(kw)
    return fields


def _files(url) -> dict[str, bytes]:
    return {p.relative_to(url).as_posix(): p.read_bytes() for p in url.rglob("*") if p.is_file()}


def _stamped(name: str) -> bool:
    """Objects holding the commit's time (the root's attributes, and the key index runs that
    record them): the only ones two writes of the same rows may differ in."""
    return name.endswith("zarr.json") or name.startswith("seq_keys/index/")


def test_a_batch_reads_back_and_content_keys_match(tmp_path):
    f = _batch()
    url = tmp_path / "c"
    with CacheWriter.open(url, make_manifest(k=K, vocab_size=VOCAB)) as w:
        assert w.append(SequenceBatch(**f)) == 12
        assert w.append(SequenceBatch(**{**f, "keys": None})) == 12  # content keys: new
        assert w.append(SequenceBatch(**{**f, "keys": None})) == 0
    r = CacheReader(url)
    off, rows = f["offsets"], f["offsets"] - np.arange(len(f["offsets"]))
    for i in range(12):
        toks = f["input_ids"][off[i] : off[i + 1]]
        got, again = r.sequence(i), r.sequence(12 + i)
        assert got.key == f["keys"][i] and again.key == content_key(toks)
        assert np.array_equal(got.input_ids, toks) and np.array_equal(again.input_ids, toks)
        assert np.array_equal(got.topk_ids, f["topk_ids"][rows[i] : rows[i + 1]])


@pytest.mark.parametrize(
    ("field", "at", "value", "words"),
    [
        ("topk_ids", (9, 1), VOCAB, "outside vocab"),
        ("topk_ids", (12, 2), -3, "outside vocab"),
        ("topk_logprobs", (5, 0), np.nan, "NaN"),
        ("topk_logprobs", (14, 1), 0.5, "> 0"),
        ("input_ids", 17, -1, "outside vocab"),
        ("keys", 4, "", "non-empty str"),
        ("keys", 6, 7, "non-empty str"),
    ],
)
def test_bad_values_name_the_sequence_and_write_nothing(tmp_path, field, at, value, words):
    f = _batch()
    f[field] = f[field].copy()
    f[field][at] = value
    off = f["offsets"]
    if field == "keys":
        want = at
    elif field == "input_ids":
        want = int(np.searchsorted(off, at, "right")) - 1
    else:
        want = int(np.searchsorted(off - np.arange(len(off)), at[0], "right")) - 1
    url = tmp_path / "c"
    with CacheWriter.open(url, make_manifest(k=K, vocab_size=VOCAB)) as w:
        w.append(SequenceBatch(**_batch(seed=1, keys=[f"old{i}" for i in range(12)])))
        before = _files(url)
        with pytest.raises(RecordError, match=words) as e:
            w.append(SequenceBatch(**f))
        assert w.num_sequences == 12
    assert _files(url) == before
    assert e.value.index == want


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"offsets": np.array([1, 5])}, "offsets must run from 0"),
        ({"offsets": np.array([0, 2, 3, 7])}, "L >= 2"),
        ({"keys": ["a", "b"]}, "keys must be"),
        ({"topk_logprobs": np.zeros((3, K), np.float32)}, "shape"),
        ({"tail_mass": np.zeros(3, np.float32)}, "tail_mass must be"),
        ({"loss_mask": np.full(3, 2, np.uint8)}, "loss_mask"),
    ],
)
def test_malformed_batches_are_record_errors(kw: dict, words: str):
    f = {
        "input_ids": np.arange(7, dtype=np.int32),
        "offsets": np.array([0, 2, 4, 7]),
        "topk_ids": np.zeros((4, K), np.int32),
        "topk_logprobs": np.zeros((4, K), np.float32),
    }
    f.update(kw)
    with pytest.raises(RecordError, match=words):
        SequenceBatch(**f)


def test_store_and_batch_must_agree_on_k_and_optional_arrays(tmp_path):
    f = _batch()
    rows = len(f["topk_ids"])
    with CacheWriter.open(tmp_path / "c", make_manifest(k=K, vocab_size=VOCAB)) as w:
        with pytest.raises(RecordError, match="loss_mask"):
            w.append(SequenceBatch(**f, loss_mask=np.ones(rows, np.uint8)))
        with pytest.raises(RecordError, match="entropy"):
            w.append(SequenceBatch(**f, entropy=np.ones(rows, np.float32)))
        wide = {**f, "topk_ids": np.repeat(f["topk_ids"], 2, axis=1)}
        wide["topk_logprobs"] = np.repeat(f["topk_logprobs"], 2, axis=1)
        with pytest.raises(RecordError, match="k mismatch"):
            w.append(SequenceBatch(**wide))
        assert w.num_sequences == 0


def test_records_get_the_tail_the_writer_computed(tmp_path):
    recs = make_records(5, k=K, vocab=VOCAB, seed=3)
    bare = [SequenceRecord(r.key, r.input_ids, r.topk_ids, r.topk_logprobs) for r in recs]
    with CacheWriter.open(tmp_path / "c", make_manifest(k=K, vocab_size=VOCAB)) as w:
        assert w.append(bare) == 5
    fresh = [SequenceRecord(r.key, r.input_ids, r.topk_ids, r.topk_logprobs) for r in recs]
    for r, again in zip(bare, fresh, strict=True):
        assert known_tail(r) is not None
        assert known_tail(r).tobytes() == again.tail_or_computed().tobytes()


def _parts(f: dict, cuts: list[int]) -> list[SequenceBatch]:
    """``f``'s sequences cut before the sequences ``cuts`` into batches whose top-k rows are
    views of ``f``'s arrays (an engine's buffers), without tail masses."""
    off, edges = f["offsets"], [0, *cuts, len(f["keys"])]
    rows = off - np.arange(len(off))
    return [
        SequenceBatch(
            input_ids=f["input_ids"][off[a] : off[b]],
            offsets=off[a : b + 1] - off[a],
            topk_ids=f["topk_ids"][rows[a] : rows[b]],
            topk_logprobs=f["topk_logprobs"][rows[a] : rows[b]],
            keys=f["keys"][a:b],
        )
        for a, b in zip(edges[:-1], edges[1:], strict=True)
    ]


@pytest.mark.parametrize("compiled", [True, False])
def test_parts_store_the_bytes_of_one_batch_and_of_records(tmp_path, monkeypatch, compiled):
    """A list of SequenceBatch parts is one append: every object the same bytes as the append
    of one batch of their sequences and of their records; each part gets its computed tail."""
    from logitcache.cache_format import _encode, fastencode
    from logitcache.cache_format.records import tail_from_logprobs

    monkeypatch.setattr(_encode, "FAST_ENCODE", compiled)
    if compiled:
        fastencode.ready()  # the kernels load now, not after a process's first values
    f = _batch(n=12, seed=5)
    recs = make_records(12, k=K, vocab=VOCAB, seed=5, max_len=6)
    bare = [SequenceRecord(r.key, r.input_ids, r.topk_ids, r.topk_logprobs) for r in recs]
    m = make_manifest(k=K, vocab_size=VOCAB)
    parts = _parts(f, [1, 5, 6])
    for name, rows in (("one", SequenceBatch(**f)), ("records", bare), ("parts", parts)):
        with CacheWriter.open(tmp_path / name, m) as w:
            assert w.append(rows) == 12
    want = _files(tmp_path / "one")
    for name in ("records", "parts"):
        got = _files(tmp_path / name)
        assert got.keys() == want.keys()
        differ = [n for n in want if got[n] != want[n] and not _stamped(n)]
        assert differ == [], name
    if compiled and _encode._compiled(m, 1):  # the parts' rows went straight into the outputs
        joined: list[int] = []  # sizes of the arrays the encode concatenates
        real = np.concatenate
        counted = lambda xs, **kw: joined.append(sum(np.size(x) for x in xs)) or real(xs, **kw)  # noqa: E731
        monkeypatch.setattr(np, "concatenate", counted)
        with fastencode.outputs() as out:
            got = _encode.encode_batch(parts, m, out)
            assert max(joined) < len(f["topk_ids"]) * K  # no top-k rows joined
            ids, stored = out.take(sum(p.num_rows for p in parts), K)
            assert np.shares_memory(got.arrays["topk_ids"], ids)
            assert np.shares_memory(got.arrays["topk_logprobs"], stored)
    for p in parts:  # given the tail the encode computed, as records are
        assert known_tail(p).tobytes() == tail_from_logprobs(p.topk_logprobs).tobytes()


def test_a_bad_part_names_its_sequence_in_the_append_and_writes_nothing(tmp_path):
    f = _batch(n=12, seed=6)
    rows = f["offsets"] - np.arange(len(f["offsets"]))
    ids = f["topk_ids"].copy()
    ids[rows[8], 1] = VOCAB  # sequence 8: in the third part
    parts = _parts({**f, "topk_ids": ids}, [3, 7])
    with CacheWriter.open(tmp_path / "c", make_manifest(k=K, vocab_size=VOCAB)) as w:
        with pytest.raises(RecordError, match="outside vocab") as e:
            w.append(parts)
        assert e.value.index == 8
        with pytest.raises(RecordError, match="SequenceBatch parts got SequenceRecord"):
            w.append([*_parts(f, [3]), make_records(1, k=K, vocab=VOCAB)[0]])
        assert w.num_sequences == 0
