"""server/jsonids.py (issue #19): JSONL input lines read with the ids straight to int32 give
what the json reading gives: the same records, the same errors, the same messages."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from logitcache.protocol import InputFile
from logitcache.server import inputs, jsonids
from logitcache.server.errors import InvalidInputError, PayloadTooLargeError

pytestmark = pytest.mark.skipif(not jsonids.ready(), reason="msgspec or numba not available")

LIMITS = inputs.Limits(vocab_size=1000, max_seq_len=64)

LINES = [
    b'{"id": "a", "input_ids": [1, 2, 3]}',
    b'  {"input_ids" : [ 0 ,999 ] , "id": 7, "extra": {"x": [1.5, null]}}  \r',
    b'{"id": "dup", "input_ids": [5, 6], "input_ids": [7, 8, 9]}',  # the last one counts
    b'{"input_ids": [-0, 3]}',
    b'{"id": "\\u00e9t\\u00e9", "input_ids": [1, 2]}',
    b'{"text": "hello", "id": "t"}',
    b'{"input_ids": [1.0, 2]}',  # floats: json decides (not a list of integers)
    b'{"input_ids": [1e2, 2]}',
    b'{"input_ids": [true, 2]}',
    b'{"input_ids": ["1", 2]}',
    b'{"input_ids": [[1, 2]]}',
    b'{"input_ids": [2147483648, 1]}',  # past int32
    b'{"input_ids": [-2147483649, 1]}',
    b'{"input_ids": [1000, 1]}',  # past the vocabulary
    b'{"input_ids": [-1, 1]}',
    b'{"input_ids": [1]}',  # too short
    b'{"input_ids": []}',
    b'{"input_ids": [' + b", ".join(b"1" for _ in range(65)) + b"]}",  # too long
    b'{"input_ids": {"a": 1}}',
    b'{"input_ids": null, "text": null}',
    b'{"input_ids": [1, 2], "id": true}',
    b'{"input_ids": [1, 2], "id": ""}',
    b'{"input_ids": [1, 2], "id": "\\ud800"}',  # a lone surrogate: msgspec refuses, json not
    b'{"input_ids": [1, 2], "n": NaN}',
    b'{"input_ids": [01, 2]}',
    b'{"input_ids": [1, 2,]}',
    b"[1, 2]",
    b'{"input_ids": [1, 2]} x',
    b'{"input_ids": [1, 2], "id": "\xff"}',  # not UTF-8
    b'{"input_ids": [' * 3000 + b"]" * 3000 + b"}",
]


def _read(tmp_path: Path, lines: list[bytes], fast: bool, monkeypatch) -> list:
    """Each line's outcome through inputs' JSONL reader: the sequence, or the error."""
    monkeypatch.setattr(jsonids, "_state", "ready" if fast else "off")
    out = []
    for i, line in enumerate(lines):
        (tmp_path / "in.jsonl").write_bytes(line + b"\n")
        raws = inputs.raw_records(file=InputFile(path="in.jsonl"), records=None, data_dir=tmp_path)
        try:
            seqs = [inputs.to_sequence(r, lambda t: [1, 2, 3], LIMITS) for r in raws]
            out.append([(s.key, s.input_ids.dtype.str, s.input_ids.tolist()) for s in seqs])
        except (InvalidInputError, PayloadTooLargeError) as e:
            out.append((type(e).__name__, e.message.replace(f":{i + 1}", "")))
    return out


def test_the_fast_reading_gives_what_json_gives(tmp_path: Path, monkeypatch) -> None:
    taken = []
    real = jsonids.int_list
    monkeypatch.setattr(jsonids, "int_list", lambda raw: taken.append(1) or real(raw))
    fast = _read(tmp_path, LINES, True, monkeypatch)
    assert len(taken) > 10  # the fast path ran
    slow = _read(tmp_path, LINES, False, monkeypatch)
    assert [i for i, (a, b) in enumerate(zip(fast, slow, strict=True)) if a != b] == []
    assert fast[0] == [("a", "<i4", [1, 2, 3])] and fast[2] == [("dup", "<i4", [7, 8, 9])]
    assert sum(isinstance(o, tuple) for o in fast) > 15  # most lines are refused


def test_random_integer_lists_parse_as_json(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        vals = rng.integers(-(2**31), 2**31, rng.integers(0, 40)).tolist()
        seps = [
            " " * int(rng.integers(0, 3)) + "," + "\n\t "[: int(rng.integers(0, 4))] for _ in vals
        ]
        text = (
            "[" + "".join(f"{v}{s}" for v, s in zip(vals, seps, strict=True)).rstrip(", \n\t") + "]"
        )
        got = jsonids.fields(('{"i": ' + text + "}").encode(), ("i",), "i")
        assert got is not None and got["i"].dtype == np.int32
        assert got["i"].tolist() == json.loads(text), text
