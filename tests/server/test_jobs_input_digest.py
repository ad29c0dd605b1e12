"""A job's submission reads its JSONL input file once: the digest that detects a changed file
is computed from the bytes the check reads (plain and gzip), equal to a separate reading's, and
a job that runs from its kept sequences reads the file no more (fake teacher, in process)."""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from engine_support import FakeEngine, app_settings, in_process
from logitcache.protocol import InputFile
from logitcache.server.inputs import records as inputs
from test_jobs_targets import _done

pytestmark = pytest.mark.fast

ROWS = [{"id": f"r{i}", "input_ids": [1, 2 + i, 9, 44, 3, i]} for i in range(8)]


def _lines() -> bytes:
    return "".join(json.dumps(r) + "\n" for r in ROWS).encode()


@pytest.mark.parametrize(
    "name,data",
    [
        ("in.jsonl", _lines() + b"\n\n"),
        ("in.jsonl.gz", gzip.compress(_lines()) + gzip.compress(b'{"input_ids": [5, 6]}\n')),
    ],
)
def test_the_digest_fed_by_the_reading_is_the_files_digest(
    tmp_path: Path, name: str, data: bytes
) -> None:
    (tmp_path / name).write_bytes(data)
    spec = InputFile(path=name)
    digest = inputs.InputDigest()
    raws = list(inputs.raw_records(file=spec, records=None, data_dir=tmp_path, digest=digest))
    assert len(raws) == len(ROWS) + name.endswith(".gz") and digest.fed
    got = digest.value(file=spec, records=None, data_dir=tmp_path)
    assert got == inputs.input_digest(file=spec, records=None, data_dir=tmp_path)
    (tmp_path / name).write_bytes(data + b"\n")  # a changed file: another digest
    assert got != inputs.input_digest(file=spec, records=None, data_dir=tmp_path)


def test_a_partial_reading_falls_back_to_reading_the_file(tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_bytes(_lines())
    spec = InputFile(path="in.jsonl")
    digest = inputs.InputDigest()
    raws = inputs.raw_records(file=spec, records=None, data_dir=tmp_path, digest=digest)
    next(raws)
    raws.close()  # stopped early: not every byte went through the digest
    assert not digest.fed
    got = digest.value(file=spec, records=None, data_dir=tmp_path)
    assert got == inputs.input_digest(file=spec, records=None, data_dir=tmp_path)


def test_a_submission_reads_its_jsonl_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "in.jsonl").write_bytes(_lines())
    opened: list[str] = []
    real_open = Path.open

    def counted(self: Path, *a: Any, **kw: Any) -> Any:
        if self.name == "in.jsonl":
            opened.append(str(self))
        return real_open(self, *a, **kw)

    monkeypatch.setattr(Path, "open", counted)

    async def go() -> None:
        async with in_process(app_settings(tmp_path), FakeEngine()) as c:
            body = {"cache": "once", "file": {"path": "in.jsonl"}, "k": 5}
            r = await c.post("/v1/jobs", json=body)
            assert r.status_code == 201, r.text
            job = await _done(c, r.json()["id"])
            assert job["state"] == "succeeded" and job["sequences_done"] == len(ROWS)

    asyncio.run(go())
    assert len(opened) == 1  # the submission's check, which also made the digest
