"""A new store's arrays made from this process's creation templates (issue #19): after the first
store of a layout, ``CacheWriter.open`` writes each empty array's ``zarr.json`` from the bytes
zarr wrote for that layout and ``k``, without zarr's ``create_array``, and the first append
writes into those arrays without opening them through zarr. The stores are byte-identical to
zarr's; what lay at an array's path is removed as zarr's ``overwrite=True`` removes it; a writer
SIGKILLed inside such a creation leaves a store that readers refuse and the next writer makes
again."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from format_support import make_manifest, make_records, zarr_writes
from logitcache.cache_format import CacheReader, CacheWriter, StoreNeedsRepairError, validate
from logitcache.cache_format import _templates as templates
from logitcache.cache_format import _writer as writer
from logitcache.cache_format.layout import INCOMPLETE_ATTR, write_root_attrs
from test_format_shardwrite import LAYOUT, RAW, files
from test_format_writer_reopen import _spy_opens

K, VOCAB = 8, 1000


def _spy_creates(monkeypatch) -> list[str]:
    made: list[str] = []
    real = writer.create_array

    def spy(store, d, k, version):
        made.append(d.name)
        return real(store, d, k, version)

    monkeypatch.setattr(writer, "create_array", spy)
    return made


def _make(url: Path, recs, cuts: list[int], *, k: int = K, layout=LAYOUT) -> None:
    with CacheWriter.open(url, make_manifest(k=k, vocab_size=VOCAB), layout=layout) as w:
        for a, b in zip([0, *cuts], [*cuts, len(recs)], strict=True):
            w.append(recs[a:b])


@pytest.mark.parametrize("layout", [LAYOUT, RAW], ids=["blosc", "raw"])
def test_a_store_made_from_templates_has_zarrs_bytes(tmp_path: Path, monkeypatch, layout) -> None:
    monkeypatch.setattr(templates, "CREATED", {})
    recs = make_records(12, k=K, vocab=VOCAB, seed=21)
    cuts = [3, 7]
    with zarr_writes():  # the reference: zarr alone
        _make(tmp_path / "zarr", recs, cuts, layout=layout)
    made, opened = _spy_creates(monkeypatch), _spy_opens(monkeypatch)
    _make(tmp_path / "first", recs, cuts, layout=layout)
    assert len(made) >= 8 and not opened, (made, opened)  # zarr creates; nothing reopened
    assert len(templates.CREATED) == len(made)  # every array's bytes became a template
    made.clear()
    _make(tmp_path / "second", recs, cuts, layout=layout)
    assert made == [] and opened == [], (made, opened)  # no zarr at all for the second store
    ref = files(tmp_path / "zarr")
    for name in ("first", "second"):
        got = files(tmp_path / name)
        assert got.keys() == ref.keys() and [n for n in ref if ref[n] != got[n]] == []
        r = CacheReader(tmp_path / name)
        assert r.keys == [x.key for x in recs]
        for seq, want in zip(r.sequences(range(len(recs))), recs, strict=True):
            assert np.array_equal(seq.topk_ids, want.topk_ids)
        assert validate(tmp_path / name).ok


def test_templates_are_kept_per_k_and_layout(tmp_path: Path, monkeypatch) -> None:
    """Stores of other ``k`` and layouts made in turn each get zarr's own empty arrays."""
    monkeypatch.setattr(templates, "CREATED", {})
    cases = [(8, LAYOUT), (16, LAYOUT), (8, RAW), (8, LAYOUT), (16, LAYOUT)]
    for i, (k, layout) in enumerate(cases):
        m = make_manifest(k=k, vocab_size=VOCAB)
        with zarr_writes():
            CacheWriter.open(tmp_path / f"zarr{i}", m, layout=layout).close()
        CacheWriter.open(tmp_path / f"tpl{i}", m, layout=layout).close()
        a, b = files(tmp_path / f"zarr{i}"), files(tmp_path / f"tpl{i}")
        assert a.keys() == b.keys() and [n for n in a if a[n] != b[n]] == [], (k, i)
        recs = make_records(3, k=k, vocab=VOCAB, seed=i)
        with CacheWriter.open(tmp_path / f"tpl{i}", m) as w:
            assert w.append(recs) == 3
        assert validate(tmp_path / f"tpl{i}").ok
    assert len({key[:2] for key in templates.CREATED}) == 2  # (version, k): two ks


def test_creation_over_an_incomplete_store_removes_what_lay_there(tmp_path: Path) -> None:
    """A creation that died left arrays (one damaged): remade from templates. A chunk object
    under the creation marker is data no commit accounts for: the writer refuses to wipe it."""
    m = make_manifest(k=K, vocab_size=VOCAB)
    CacheWriter.open(tmp_path / "warm", m, layout=LAYOUT).close()  # the templates exist
    url = tmp_path / "c"
    CacheWriter.open(url, m, layout=LAYOUT).close()
    import zarr

    write_root_attrs(zarr.storage.LocalStore(url), {"format_version": 2, INCOMPLETE_ATTR: True})
    stray = url / "topk_ids" / "c" / "9" / "0"  # a shard past anything the append writes
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"junk from a dead writer")
    (url / "tail_mass" / "zarr.json").write_text("{}")  # a damaged array document
    with pytest.raises(Exception, match="no committed logitcache manifest"):
        CacheReader(url)
    with pytest.raises(StoreNeedsRepairError, match="topk_ids/c/9/0"):  # data: never wiped
        CacheWriter.open(url, m, layout=LAYOUT)
    assert stray.read_bytes() == b"junk from a dead writer"
    stray.unlink()  # metadata only now: a creation that died, remade
    recs = make_records(5, k=K, vocab=VOCAB, seed=5, min_len=3, max_len=4)
    with CacheWriter.open(url, m, layout=LAYOUT) as w:
        assert w.append(recs) == 5
    r = CacheReader(url)
    for seq, want in zip(r.sequences(range(5)), recs, strict=True):
        assert np.array_equal(seq.topk_ids, want.topk_ids)
    assert validate(url).ok


CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from format_support import make_manifest
    from logitcache.cache_format import CacheWriter, _templates as templates, _writer as writer
    m = make_manifest(k=8, vocab_size=1000)
    CacheWriter.open({warm!r}, m).close()  # the templates exist: the next creation uses them
    assert templates.CREATED
    real, count = writer.CacheWriter._keep_direct, [0]
    def keep(self, name, direct):
        real(self, name, direct)
        count[0] += 1
        if count[0] == {after}:
            os.kill(os.getpid(), signal.SIGKILL)
    writer.CacheWriter._keep_direct = keep
    CacheWriter.open({url!r}, m)
    """
)


@pytest.mark.subprocess
@pytest.mark.parametrize("after", [1, 4])
def test_sigkill_inside_a_creation_from_templates(tmp_path: Path, after: int) -> None:
    url = tmp_path / "c"
    code = CHILD.format(
        tests=str(Path(__file__).resolve().parents[1]),
        warm=str(tmp_path / "warm"),
        url=str(url),
        after=after,
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (url / "zarr.json").exists()  # it had begun: the root says "incomplete"
    with pytest.raises(Exception, match="no committed logitcache manifest"):
        CacheReader(url)
    m = make_manifest(k=8, vocab_size=1000)
    recs = make_records(6, k=8, vocab=1000, seed=6)
    with CacheWriter.open(url, m) as w:
        assert w.num_sequences == 0
        assert w.append(recs) == 6
    r = CacheReader(url)
    assert r.keys == [x.key for x in recs]
    for seq, want in zip(r.sequences(range(6)), recs, strict=True):
        assert np.array_equal(seq.topk_ids, want.topk_ids)
    assert validate(url).ok


def test_stores_made_by_concurrent_writers_have_zarrs_bytes(tmp_path: Path, monkeypatch) -> None:
    """Four threads make four stores of one layout at once (the service runs jobs into new
    caches side by side), from an empty template table: whichever thread records the templates,
    every store is zarr's bytes and reads back."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(templates, "CREATED", {})
    recs = make_records(6, k=K, vocab=VOCAB, seed=31)
    with zarr_writes():
        _make(tmp_path / "zarr", recs, [2])
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: _make(tmp_path / f"t{i}", recs, [2]), range(4)))
    ref = files(tmp_path / "zarr")
    for i in range(4):
        got = files(tmp_path / f"t{i}")
        assert got.keys() == ref.keys() and [n for n in ref if ref[n] != got[n]] == [], i
        assert CacheReader(tmp_path / f"t{i}").keys == [x.key for x in recs]
    assert templates.CREATED  # recorded once the first creations were read back
