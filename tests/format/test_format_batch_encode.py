"""writer.encode_batch (issue #19): the whole append checked and encoded at once must store the
same bytes and refuse the same records, with the same error, as encode_record one by one; with
the compiled pass (cache_format/fastencode.py, where numba is available) and without it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from format_support import make_manifest, make_record, make_records
from logitcache.cache_format import CacheReader, CacheWriter, SequenceRecord, fastencode
from logitcache.cache_format import _encode as writer
from logitcache.cache_format.errors import RecordError

K, VOCAB = 6, 50


@pytest.fixture(autouse=True, params=[True, False], ids=["fast", "numpy"])
def _fast_encode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer, "FAST_ENCODE", request.param)
    if request.param:  # loaded now: small appends do not load the kernels (fastencode.wanted)
        fastencode.ready()


def _one_by_one(recs: list[SequenceRecord], m) -> writer.Batch:
    """The reference: the records encoded one by one (``encode_record``), concatenated."""
    enc = [writer.encode_record(r, m, i) for i, r in enumerate(recs)]
    return writer.Batch(
        [e.key for e in enc],
        np.array([len(e.input_ids) for e in enc], dtype=np.int64),
        np.concatenate([e.input_ids for e in enc]),
        {n: np.concatenate([e.arrays[n] for e in enc]) for n in enc[0].arrays},
    )


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"logprob_dtype": "uint8"},
        {"logprob_dtype": "float32", "tail_mass_dtype": "float16"},
        {"loss_mask": True},
    ],
)
@pytest.mark.parametrize("group_rows", [7, 1 << 16])  # several groups of records, or one
def test_batch_encoding_is_bit_identical_to_per_record(kw: dict, group_rows: int, monkeypatch):
    monkeypatch.setattr(writer, "ENCODE_GROUP_VALUES", group_rows * K)
    rng = np.random.default_rng(1)
    m = make_manifest(k=K, vocab_size=VOCAB, **kw)
    recs = [
        make_record(rng, int(rng.integers(2, 30)), K, VOCAB, key=f"s{i}", tail=i % 3 != 0)
        for i in range(9)
    ]
    if kw.get("loss_mask"):
        r = recs[1]
        mask = (np.arange(r.num_rows) % 2).astype(np.uint8)
        recs[1] = SequenceRecord(r.key, r.input_ids, r.topk_ids, r.topk_logprobs, None, mask)
    for batch in (recs, [r for r in recs if r.tail_mass is None], recs[1:2]):
        got, want = writer.encode_batch(batch, m), _one_by_one(batch, m)
        assert got is not None
        assert got.keys == want.keys
        assert np.array_equal(got.lengths, want.lengths)
        assert got.input_ids.tobytes() == want.input_ids.tobytes()
        assert sorted(got.arrays) == sorted(want.arrays)
        for name, a in want.arrays.items():
            assert got.arrays[name].dtype == a.dtype, name
            assert got.arrays[name].tobytes() == a.tobytes(), name
    assert writer.encode_batch([], m) is None


def _bad(kind: str, good: SequenceRecord) -> object:
    ids, lp = good.topk_ids.copy(), good.topk_logprobs.copy()
    tail, inp = good.tail_mass, good.input_ids.copy()
    if kind == "vocab":
        ids[-1, 0] = VOCAB
    elif kind == "input_vocab":
        inp[0] = -1
    elif kind == "repeat":
        ids[-1, 2] = ids[-1, 1]
    elif kind == "order":
        lp[-1, 1] = lp[-1, 0] + 0.5
    elif kind == "nan":
        lp[0, 3] = np.nan
    elif kind == "neginf":
        lp[0, -1] = -np.inf
    elif kind == "positive":
        lp[:, 0] = 0.01
    elif kind == "tail":
        tail = np.full(good.num_rows, 1.5, np.float32)
    elif kind == "k":
        return SequenceRecord(good.key, inp, ids[:, :-1], lp[:, :-1])
    elif kind == "mask":
        mask = np.ones(good.num_rows, np.uint8)
        return SequenceRecord(good.key, inp, ids, lp, tail, mask)
    elif kind == "type":
        return {"key": good.key}
    return SequenceRecord(good.key, inp, ids, lp, tail)


KINDS = [
    "vocab",
    "input_vocab",
    "repeat",
    "order",
    "nan",
    "neginf",
    "positive",
    "tail",
    "k",
    "mask",
    "type",
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("group_rows", [4, 1 << 16])
def test_a_bad_record_gets_the_per_record_error(kind: str, group_rows: int, monkeypatch) -> None:
    monkeypatch.setattr(writer, "ENCODE_GROUP_VALUES", group_rows * K)
    m = make_manifest(k=K, vocab_size=VOCAB)
    recs: list = make_records(5, k=K, vocab=VOCAB, seed=2, min_len=4)
    recs[2] = _bad(kind, recs[2])
    with pytest.raises(RecordError) as want:
        _one_by_one(recs, m)
    with pytest.raises(RecordError) as got:
        writer.encode_batch(recs, m)
    assert str(got.value) == str(want.value)
    assert got.value.index == want.value.index == 2


def test_the_first_bad_record_is_named_and_nothing_is_written(tmp_path: Path) -> None:
    m = make_manifest(k=K, vocab_size=VOCAB)
    recs: list = make_records(5, k=K, vocab=VOCAB, seed=3, min_len=4)
    recs[1], recs[3] = _bad("order", recs[1]), _bad("vocab", recs[3])
    with CacheWriter.open(tmp_path / "c", m) as w:
        with pytest.raises(RecordError, match="record 1.*not sorted"):
            w.append(recs)
        assert w.num_sequences == 0
    assert CacheReader(tmp_path / "c").num_sequences == 0


def test_committed_and_repeated_keys_are_dropped_from_the_batch(tmp_path: Path) -> None:
    """A batch whose middle records are known keys stores exactly the fresh ones (select)."""
    m = make_manifest(k=K, vocab_size=VOCAB)
    recs = make_records(8, k=K, vocab=VOCAB, seed=4)
    with CacheWriter.open(tmp_path / "c", m) as w:
        assert w.append([recs[2], recs[5]]) == 2
        assert w.append([*recs, recs[0], recs[7]]) == 6
    r = CacheReader(tmp_path / "c")
    order = [recs[2], recs[5], recs[0], recs[1], recs[3], recs[4], recs[6], recs[7]]
    assert r.keys == [x.key for x in order]
    rows = r.rows(0, r.manifest.num_rows)
    assert np.array_equal(rows.topk_ids, np.concatenate([x.topk_ids for x in order]))
    for i, want in enumerate(order):
        got = r.sequence(i)
        assert np.array_equal(got.input_ids, want.input_ids)
        assert np.array_equal(got.tail_mass, want.tail_mass)
