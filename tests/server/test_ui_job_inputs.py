"""Job inputs as real datasets come (server/input_files.py through server/inputs.py): gzip JSONL,
Hugging Face ``datasets`` directories (``save_to_disk`` Arrow, Parquet shards), Arrow files; a
DatasetDict is refused with its splits; the input digest covers every file of a directory.

The readers and checks run without an engine: a character tokenizer stands in for the teacher's.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from logitcache.protocol import InputFile
from logitcache.server import inputs
from logitcache.server.errors import InvalidInputError

TEXTS = [f"record number {i} says hello" for i in range(10)]
LIMITS = inputs.Limits(vocab_size=256, max_seq_len=512)


def tok(text: str) -> list[int]:
    return [ord(c) % 256 for c in text]


def _read(data: Path, rel: str, **kw) -> list[inputs.RawRecord]:
    spec = InputFile(path=rel, **kw)
    return list(inputs.raw_records(file=spec, records=None, data_dir=data))


def _texts(raws: list[inputs.RawRecord]) -> list[str]:
    return [r.text for r in raws]


def test_jsonl_gz(tmp_path: Path) -> None:
    lines = [json.dumps({"id": f"r{i}", "text": t}) for i, t in enumerate(TEXTS)]
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        f.write("\n".join(lines) + "\n")
    raws = _read(tmp_path, "c.jsonl.gz")
    assert _texts(raws) == TEXTS and raws[3].id == "r3" and raws[3].where == "c.jsonl.gz:4"
    assert inputs.scan(raws, tok, LIMITS).sequences == 10


def test_datasets_save_to_disk_and_parquet_shards(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": TEXTS, "id": [f"d{i}" for i in range(10)]})
    ds.save_to_disk(str(tmp_path / "saved"), num_shards=3)
    raws = _read(tmp_path, "saved")
    assert _texts(raws) == TEXTS and [r.id for r in raws] == [f"d{i}" for i in range(10)]
    assert raws[0].where.startswith("saved/data-00000-of-00003.arrow row 0")
    shards = tmp_path / "hub" / "data"
    shards.mkdir(parents=True)
    for i in range(2):
        ds.shard(2, i, contiguous=True).to_parquet(str(shards / f"train-0000{i}-of-00002.parquet"))
    raws = _read(tmp_path, "hub")
    assert _texts(raws) == TEXTS
    assert raws[5].where == "hub/data/train-00001-of-00002.parquet row 0"
    # one Arrow file too
    ds.to_pandas().to_feather(tmp_path / "one.arrow")
    assert _texts(_read(tmp_path, "one.arrow")) == TEXTS
    # a DatasetDict names its splits
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(InvalidInputError, match=r"DatasetDict: give one split's directory"):
        _read(tmp_path, "dd")
    assert _texts(_read(tmp_path, "dd/test")) == TEXTS


def test_directory_errors_and_digest(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidInputError, match="holds no .parquet or .arrow files"):
        _read(tmp_path, "empty")
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "a.parquet").write_bytes(b"not parquet")
    with pytest.raises(InvalidInputError, match="not a readable Parquet file"):
        _read(tmp_path, "j")
    spec = InputFile(path="j")
    d1 = inputs.input_digest(file=spec, records=None, data_dir=tmp_path)
    (tmp_path / "j" / "b.parquet").write_bytes(b"more")
    d2 = inputs.input_digest(file=spec, records=None, data_dir=tmp_path)
    assert d1 != d2  # a file added to a directory changes the digest


# --- on_long and duplicate counts (server/long_inputs.py) ------------------------------------


def _raw(i: int, ids: list[int], rid: str | None = None) -> inputs.RawRecord:
    return inputs.RawRecord(where=f"records[{i}]", id=rid, text=None, input_ids=ids)


@pytest.mark.parametrize("n,m,o", [(10, 4, 1), (11, 4, 1), (50, 16, 1), (50, 16, 5), (17, 16, 15)])
def test_split_windows_cover_every_target(n: int, m: int, o: int) -> None:
    from logitcache.server.long_inputs import windows

    spans = windows(n, m, o)
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(2 <= b - a <= m for a, b in spans)
    starts = [a for a, _ in spans]
    assert all(b - a == m - o for a, b in zip(starts, starts[1:], strict=False))
    predicted = [t for a, b in spans for t in range(a + 1, b)]  # targets of each window's rows
    assert sorted(set(predicted)) == list(range(1, n))  # every position predicted
    if o == 1:
        assert predicted == list(range(1, n))  # exactly once, in order: rows concatenate


def test_on_long_policies_and_counts() -> None:
    limits = inputs.Limits(vocab_size=100, max_seq_len=8)
    long_ids = list(range(1, 21))  # 20 tokens
    raws = [
        _raw(0, [1, 2, 3]),
        _raw(1, long_ids, "L"),
        _raw(2, [1, 2, 3]),  # duplicate of records[0] (no id): dropped and counted
        _raw(3, list(range(30, 50))),  # long, no id
    ]
    with pytest.raises(InvalidInputError, match=r"2 invalid record\(s\).*20 tokens exceed"):
        inputs.scan(raws, tok, limits)  # reject: the default
    skip = inputs.scan(raws, tok, inputs.job_limits(limits, "skip", 1))
    assert (skip.sequences, skip.counts.skipped, skip.counts.duplicates) == (1, 2, 1)
    trunc = list(inputs.sequences(raws, tok, inputs.job_limits(limits, "truncate", 1)))
    assert [s.length for s in trunc] == [3, 8, 8] and trunc[1].key == "L"
    counts = inputs.long_inputs.InputCounts()
    split = list(inputs.sequences(raws, tok, inputs.job_limits(limits, "split", 1), counts))
    keys = [s.key for s in split]
    assert keys[1:4] == ["L#w0", "L#w1", "L#w2"] and keys[4].endswith("#w0")
    rebuilt = [t for s in split[1:4] for t in s.input_ids[1:].tolist()]
    assert rebuilt == long_ids[1:]  # the windows' targets are the record's, in order
    assert (counts.split, counts.windows, counts.duplicates) == (2, 6, 1)
    summary = inputs.scan(raws, tok, inputs.job_limits(limits, "split", 1))
    assert summary.counts.as_dict() == {
        "records": 4,
        "sequences": 7,
        "duplicates": 1,
        "skipped": 0,
        "truncated": 0,
        "split": 2,
        "windows": 6,
    }
    with pytest.raises(InvalidInputError, match="split_overlap must be in"):
        inputs.job_limits(limits, "split", 8)
    only_long = [_raw(0, long_ids)]
    with pytest.raises(InvalidInputError, match=r"no sequence \(1 skipped as too long\)"):
        inputs.scan(only_long, tok, inputs.job_limits(limits, "skip", 1))


# --- chat records (server/chat.py) -----------------------------------------------------------

TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def test_chat_records_need_a_template_and_render_with_it(tiny_tokenizer, tmp_path: Path) -> None:
    from logitcache.server.chat import ChatTokenize

    msgs = [{"role": "user", "content": "Add two numbers."}, {"role": "assistant", "content": "ok"}]
    (tmp_path / "chat.jsonl").write_text(
        json.dumps({"id": "c1", "messages": msgs}) + "\n" + json.dumps({"text": "plain"}) + "\n"
    )
    raws = _read(tmp_path, "chat.jsonl")
    assert raws[0].messages == msgs and raws[1].messages is None

    def tokenize(t: str) -> list[int]:
        return list(tiny_tokenizer(t)["input_ids"])

    limits = _tiny_limits(tiny_tokenizer)
    assert not getattr(tiny_tokenizer, "chat_template", None)  # the fixture has none
    with pytest.raises(InvalidInputError, match="chat.jsonl:1: a chat record.*needs a chat"):
        inputs.scan(raws, ChatTokenize(tokenize, tiny_tokenizer), limits)
    with pytest.raises(InvalidInputError, match="accepted by jobs only"):
        inputs.scan(raws, tokenize, limits)
    chat_tok = ChatTokenize(tokenize, tiny_tokenizer, TEMPLATE)
    seqs = list(inputs.sequences(raws, chat_tok, limits))
    text = "<s>user: Add two numbers.\n<s>assistant: ok\n"
    assert chat_tok.render(msgs, "x") == text
    want = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert seqs[0].key == "c1" and seqs[0].input_ids.tolist() == want
    assert want.count(tiny_tokenizer.bos_token_id) == 2  # the template's BOS, none added on top
    bad = [inputs.RawRecord("r", None, None, None, messages=[{"role": "robot", "content": "x"}])]
    with pytest.raises(InvalidInputError, match=r"messages\[0\].role must be one of"):
        inputs.scan(bad, chat_tok, limits)
    both = [inputs.RawRecord("r", None, "t", None, messages=msgs)]
    with pytest.raises(InvalidInputError, match="exactly one of text, token ids or messages"):
        inputs.scan(both, chat_tok, limits)


def _tiny_limits(tokenizer) -> inputs.Limits:
    """Job limits of the tiny teacher: its vocabulary (from its tokenizer), 512 tokens."""
    return inputs.Limits(vocab_size=len(tokenizer), max_seq_len=512)


CHATML = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_chat_loss_mask_follows_split_and_truncate(tiny_tokenizer) -> None:
    """The row mask of a chat record (loss_mask job) is cut with its tokens: split windows with
    overlap 1 concatenate to the whole record's mask, truncate keeps its first rows."""
    from dataclasses import replace

    from logitcache.server.chat import ChatTokenize

    def tokenize(text: str) -> list[int]:
        return list(tiny_tokenizer(text)["input_ids"])

    chat_tok = ChatTokenize(tokenize, tiny_tokenizer, CHATML, loss_mask=True)
    limits = _tiny_limits(tiny_tokenizer)
    msgs = [
        {"role": "user", "content": "count to five please"},
        {"role": "assistant", "content": "one two three four five"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "one two three"},
    ]
    raw = inputs.RawRecord("r", "c", None, None, messages=msgs)
    whole = inputs.to_sequence(raw, chat_tok, limits)
    mask = whole.loss_mask
    assert mask is not None and mask.shape == (whole.length - 1,)
    assert 0 < int(mask.sum()) < len(mask)
    m = whole.length // 3
    lim = replace(limits, max_seq_len=m, on_long="split")
    split = inputs.fit_sequences(raw, chat_tok, lim)
    assert len(split) > 1
    assert np.array_equal(np.concatenate([s.loss_mask for s in split]), mask)
    trunc = inputs.fit_sequences(raw, chat_tok, replace(limits, max_seq_len=m, on_long="truncate"))
    assert np.array_equal(trunc[0].loss_mask, mask[: m - 1])
    plain = ChatTokenize(tokenize, tiny_tokenizer, CHATML)  # a job without loss_mask
    assert inputs.to_sequence(raw, plain, limits).loss_mask is None
