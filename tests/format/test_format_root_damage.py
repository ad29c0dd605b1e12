"""A writer never deletes committed data it cannot account for (issue #38).

The root ``zarr.json`` holds the manifest and is the commit point. When it is deleted, replaced by
the creation marker, or damaged (not JSON, truncated, another zarr node) while the arrays hold
committed rows, :meth:`CacheWriter.open` raises :class:`StoreNeedsRepairError` and leaves every
object as it was (locally and on the moto S3 server). A store that never committed a row is
still (re)created.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from format_support import make_manifest, make_records, s3_client
from logitcache.cache_format import (
    FORMAT_VERSION,
    CacheReader,
    CacheWriter,
    ChecksumError,
    StoreNeedsRepairError,
    validate,
)
from logitcache.cache_format.layout import INCOMPLETE_ATTR
from spec_reader import SpecError, SpecStore

K, VOCAB = 8, 1000


def _root_edits() -> dict[str, Callable[[bytes | None], bytes | None]]:
    """Each damage of the root document: old bytes -> new bytes (``None``: deleted)."""

    def marker(old: bytes | None) -> bytes:
        doc = json.loads(old or b"{}")
        attrs = {"format_version": doc["attributes"]["format_version"], INCOMPLETE_ATTR: True}
        return json.dumps({"zarr_format": 3, "node_type": "group", "attributes": attrs}).encode()

    return {
        "deleted": lambda old: None,
        "creation_marker": marker,
        "truncated": lambda old: (old or b"")[: len(old or b"") // 2],
        "garbage": lambda old: b"\x00\xffnot json",
        "empty": lambda old: b"",
        "array_node": lambda old: json.dumps({"zarr_format": 3, "node_type": "array"}).encode(),
    }


EDITS = _root_edits()


class _Objects:
    """Get, put, delete and list the objects of a local or S3 store by key."""

    def __init__(self, url: str, opts: dict):
        self.url, self.opts = url, opts
        self.s3 = s3_client(opts["endpoint_url"]) if url.startswith("s3://") else None
        if self.s3 is not None:
            self.bucket, self.prefix = url[len("s3://") :].split("/", 1)

    def get(self, key: str) -> bytes | None:
        if self.s3 is None:
            p = Path(self.url) / key
            return p.read_bytes() if p.exists() else None
        try:
            return self.s3.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")["Body"].read()
        except self.s3.exceptions.NoSuchKey:
            return None

    def put(self, key: str, data: bytes | None) -> None:
        if self.s3 is None:
            p = Path(self.url) / key
            if data is None:
                p.unlink()
            else:
                p.write_bytes(data)
        elif data is None:
            self.s3.delete_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")
        else:
            self.s3.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}", Body=data)

    def listing(self) -> dict[str, bytes]:
        if self.s3 is None:
            root = Path(self.url)
            return {
                str(p.relative_to(root)): p.read_bytes()
                for p in root.rglob("*")
                if p.is_file() and p.name != ".logitcache.lock"
            }
        out = {}
        pages = self.s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + "/"
        )
        for page in pages:
            for o in page.get("Contents", []):
                key = o["Key"][len(self.prefix) + 1 :]
                if not key.endswith(".logitcache.lock"):
                    out[key] = self.get(key) or b""
        return out


#: Where the store lies; the S3 case asks for the moto server at run time, so its mark keeps it
#: out of the fast tier (which sees only the fixtures a test names).
WHERE = ["local", pytest.param("s3", marks=pytest.mark.s3)]


def _where(request, tmp_path, where: str) -> tuple[str, dict]:
    if where == "s3":
        return request.getfixturevalue("s3_store")
    return str(tmp_path / "c"), {}


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_writer_refuses_store_with_damaged_root_and_data(request, tmp_path, where, edit):
    url, opts = _where(request, tmp_path, where)
    recs = make_records(3, k=K, vocab=VOCAB, seed=1)
    with CacheWriter.open(url, make_manifest(K, VOCAB), opts) as w:
        w.append(recs)
    objs = _Objects(url, opts)
    good = objs.get("zarr.json")
    objs.put("zarr.json", EDITS[edit](good))
    before = objs.listing()
    with pytest.raises(StoreNeedsRepairError, match="logitcache repair .* restore the root"):
        CacheWriter.open(url, make_manifest(K, VOCAB), opts)
    assert objs.listing() == before  # nothing deleted, nothing rewritten
    objs.put("zarr.json", good)  # a repair the error names: every committed row reads again
    with CacheWriter.open(url, make_manifest(K, VOCAB), opts) as w:
        assert w.manifest.num_sequences == 3
    assert CacheReader(url, opts).keys == [r.key for r in recs]
    assert validate(url, opts).ok


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("edit", ["deleted", "creation_marker", "garbage"])
def test_store_without_rows_is_recreated(request, tmp_path, where, edit):
    """A root lost before any row was committed (creation crashed, or an empty store): the
    arrays hold metadata only, nothing is lost by creating the store again."""
    url, opts = _where(request, tmp_path, where)
    CacheWriter.open(url, make_manifest(K, VOCAB), opts).close()
    objs = _Objects(url, opts)
    objs.put("zarr.json", EDITS[edit](objs.get("zarr.json")))
    recs = make_records(2, k=K, vocab=VOCAB, seed=2)
    with CacheWriter.open(url, make_manifest(K, VOCAB), opts) as w:
        w.append(recs)
    assert CacheReader(url, opts).keys == [r.key for r in recs]


def _flip_char(s: str) -> str:
    return s[:3] + ("x" if s[3] != "x" else "y") + s[4:]


MANIFEST_EDITS: dict[str, Callable[[dict], None]] = {
    "tokenizer_fingerprint": lambda m: m.update(
        tokenizer_fingerprint=_flip_char(m["tokenizer_fingerprint"])
    ),
    "id_remap": lambda m: m.update(id_remap=not m["id_remap"]),
    "loss_mask": lambda m: m.update(loss_mask=not m.get("loss_mask", False)),
    "temperature": lambda m: m.update(temperature=m["temperature"] * 2),
    "teacher_model": lambda m: m.update(teacher_model=m["teacher_model"] + "-other"),
    "num_sequences": lambda m: m.update(num_sequences=m["num_sequences"] - 1),
}


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("field", sorted(MANIFEST_EDITS))
def test_manifest_edit_fails_its_digest(request, tmp_path, where, field):
    """FORMAT.md 2.2: every reader, writer and ``validate`` checks the root digest (version 3)."""
    url, opts = _where(request, tmp_path, where)
    with CacheWriter.open(url, make_manifest(K, VOCAB), opts) as w:
        w.append(make_records(3, k=K, vocab=VOCAB, seed=1))
    objs = _Objects(url, opts)
    doc = json.loads(objs.get("zarr.json") or b"")
    assert doc["attributes"]["format_version"] == FORMAT_VERSION == 4
    MANIFEST_EDITS[field](doc["attributes"]["logitcache"])
    objs.put("zarr.json", json.dumps(doc).encode())
    with pytest.raises(ChecksumError, match="digest"):
        CacheReader(url, opts)
    with pytest.raises(ChecksumError, match="digest"):
        CacheWriter.open(url, make_manifest(K, VOCAB), opts)
    report = validate(url, opts)
    assert not report.ok and "digest" in str(report.problems)
    if where == "local":
        with pytest.raises(SpecError, match="2.2"):
            SpecStore(url)


def test_version_2_store_without_digest_still_reads(tmp_path):
    """A version-2 store has no digest (its manifest is not covered) and keeps reading and
    appending at version 2."""
    url = str(tmp_path / "c")
    recs = make_records(4, k=K, vocab=VOCAB, seed=3)
    with CacheWriter.open(url, make_manifest(K, VOCAB, format_version=2)) as w:
        w.append(recs[:2])
    with CacheWriter.open(url, make_manifest(K, VOCAB, format_version=2)) as w:
        w.append(recs[2:])
    doc = json.loads((Path(url) / "zarr.json").read_bytes())
    assert doc["attributes"]["format_version"] == 2 and "logitcache_digest" not in doc["attributes"]
    assert CacheReader(url).keys == [r.key for r in recs]
    assert validate(url).ok
