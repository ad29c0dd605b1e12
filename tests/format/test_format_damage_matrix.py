"""``validate`` never crashes and never says OK on damaged bytes (FORMAT.md R7, R9, R10).

A small store of each encoding (random_access_raw preset, id remap on) is copied and one object
at a time damaged, then put back: deleted, one bit flipped, truncated to half, or two shard objects
of equal shape swapped between arrays (a misplaced copy); plus a hypothesis test flipping any bit
of any chunk object or of the root ``zarr.json``. Every case is a finding, none a crash.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from format_support import make_manifest, make_records
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from logitcache.cache_format import CacheWriter, layout_named, validate

ENCODINGS = ["float16", "float32", "uint8"]
DAMAGES = ["delete", "flip", "truncate"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for enc in ENCODINGS:
        src = tmp_path_factory.mktemp(f"src_{enc}") / "c"
        m = make_manifest(8, 1000, logprob_dtype=enc, id_remap=True)
        with CacheWriter.open(str(src), m, layout=layout_named("random_access_raw")) as w:
            w.append(make_records(20, k=8, vocab=1000, seed=4))
        assert validate(str(src)).ok
        out[enc] = src
    return out


def _objects(src: Path) -> list[Path]:
    return sorted(
        p.relative_to(src) for p in src.rglob("*") if p.is_file() and p.name != ".logitcache.lock"
    )


def _damage(path: Path, how: str, at: float = 0.5, bit: int = 0) -> None:
    data = path.read_bytes()
    if how == "delete":
        path.unlink()
    elif how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        i = min(int(at * len(data)), len(data) - 1)
        path.write_bytes(data[:i] + bytes([data[i] ^ (1 << bit)]) + data[i + 1 :])


def _verdict_damaged(work: Path, rel: Path, how: str, at: float = 0.5, bit: int = 0) -> str:
    """The verdict on ``work`` with its object ``rel`` damaged; the object is put back after."""
    intact = (work / rel).read_bytes()
    _damage(work / rel, how, at, bit)
    try:
        return _verdict(work)
    finally:
        (work / rel).write_bytes(intact)


def _verdict(url: Path) -> str:
    try:
        report = validate(str(url))
    except Exception as e:  # noqa: BLE001 - the property under test: no exception escapes
        return f"crash: {e!r}"
    return "ok" if report.ok else "found"


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("enc", ENCODINGS)
def test_every_object_damaged_is_found(sources, tmp_path, enc, how):
    src = sources[enc]
    objects = _objects(src)
    assert len(objects) > 20
    work = tmp_path / "d"
    shutil.copytree(src, work)
    missed = {}
    for rel in objects:
        verdict = _verdict_damaged(work, rel, how)
        if verdict != "found":
            missed[str(rel)] = verdict
    assert missed == {}
    assert _verdict(work) == "ok"  # each object was put back intact


@pytest.mark.parametrize("pair", [("seq_token_start/c/0", "seq_row_start/c/0")])
def test_swapped_objects_are_found(sources, tmp_path, pair):
    """Two intact shard objects of equal shape swapped between arrays: only the shards' seals
    (FORMAT.md 4.8) tell them apart (swaps within an array: test_format_placement.py)."""
    work = tmp_path / "d"
    shutil.copytree(sources["float16"], work)
    a, b = work / pair[0], work / pair[1]
    da, db = a.read_bytes(), b.read_bytes()
    assert len(da) == len(db)
    a.write_bytes(db)
    b.write_bytes(da)
    assert _verdict(work) == "found"


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(pick=st.integers(0, 10_000), at=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_any_bit_flip_is_found(sources, tmp_path, pick, at, bit):
    src = sources["uint8"]
    objects = [
        p for p in _objects(src) if p.name != "zarr.json" or p == Path("zarr.json")
    ]  # chunk and shard objects, and the root (array documents: the table above)
    rel = objects[pick % len(objects)]
    work = tmp_path / "h"  # one copy for all examples: each puts its object back
    if not work.exists():
        shutil.copytree(src, work)
    assert _verdict_damaged(work, rel, "flip", at, bit) == "found", (rel, at, bit)


@pytest.mark.parametrize(
    "edit",
    [
        ('"zarr_format"', '"zarr_formau"'),  # a flipped bit in a field name (found by hypothesis)
        ('"node_type": "group"', '"node_type": "grouq"'),
        ('"zarr_format": 3', '"zarr_format": 2'),
    ],
)
def test_a_damaged_zarr_field_of_the_root_is_found(sources, tmp_path, edit):
    """The manifest digest covers the root's attributes; its zarr fields are checked apart: a
    reader refuses the store with a typed error, a writer neither wipes nor appends, and
    ``validate`` reports it."""
    from logitcache.cache_format import CacheReader
    from logitcache.cache_format.errors import CorruptStoreError

    work = tmp_path / "r"
    shutil.copytree(sources["uint8"], work)
    root = work / "zarr.json"
    text = root.read_text()
    assert edit[0] in text
    root.write_text(text.replace(edit[0], edit[1], 1))
    before = sorted(p.relative_to(work) for p in work.rglob("*"))
    assert _verdict(work) == "found"
    with pytest.raises(CorruptStoreError, match="root zarr.json"):
        CacheReader(str(work))
    m = make_manifest(8, 1000, logprob_dtype="uint8", id_remap=True)
    with pytest.raises(CorruptStoreError, match="root zarr.json"):
        CacheWriter.open(str(work), m, layout=layout_named("random_access_raw"))
    assert sorted(p.relative_to(work) for p in work.rglob("*")) == before
