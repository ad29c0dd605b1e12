"""Job inputs as real datasets come (server/input_files.py through server/inputs.py): gzip JSONL,
Hugging Face ``datasets`` directories (``save_to_disk`` Arrow, Parquet shards), Arrow files; a
DatasetDict is refused with its splits; the input digest covers every file of a directory.

The readers and checks run without an engine: a character tokenizer stands in for the teacher's.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from logitcache.server import inputs
from logitcache.server.errors import InvalidInputError
from logitcache.server.protocol import InputFile

TEXTS = [f"record number {i} says hello" for i in range(10)]
LIMITS = inputs.Limits(vocab_size=256, max_len=512)


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
