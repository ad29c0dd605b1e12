"""A later writer of the same store in one process (the service opens one per job) takes the
arrays from the earlier writer's templates when their stored ``zarr.json`` is the template at the
committed length, without zarr's ``open_array``/``resize`` (issue #19), and the last shards that
writer left when their files are still the ones it wrote (no read-back); it writes the same
objects as a writer that opens every array through zarr. A store changed under the template is
opened through zarr again, a shard file replaced since is read back."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import zarr.api.asynchronous
from format_support import make_manifest, make_records
from logitcache.cache_format import CacheReader, CacheWriter, validate
from logitcache.cache_format import _shardwrite as shardwrite
from logitcache.cache_format import _templates as templates
from logitcache.cache_format import _writer as writer
from logitcache.cache_format.spec import DEFAULT_LAYOUT
from test_format_shardwrite import LAYOUT, files

K, VOCAB = 8, 1000
DIRECT = {"topk_ids", "topk_logprobs", "tail_mass", "input_ids", "seq_keys", "seq_lengths"}


def _reads_back(url: Path, recs) -> None:
    r = CacheReader(url)
    assert r.keys == [x.key for x in recs]
    got = r.rows(0, r.manifest.num_rows).topk_ids
    assert np.array_equal(got, np.concatenate([x.topk_ids for x in recs]))
    assert validate(url).ok


def _spy_opens(monkeypatch) -> list[str]:
    opened: list[str] = []
    real = zarr.api.asynchronous.open_array

    async def spy(*a, **kw):
        if kw.get("mode") == "r+":  # opened for writing (reading the keys opens seq_keys "r")
            opened.append(kw.get("path", ""))
        return await real(*a, **kw)

    monkeypatch.setattr(zarr.api.asynchronous, "open_array", spy)
    return opened


def _spy_readbacks(monkeypatch) -> list[str]:
    seen: list[str] = []
    real = shardwrite._existing

    def spy(lay, shard, below):
        seen.append(lay.name)
        return real(lay, shard, below)

    monkeypatch.setattr(shardwrite, "_existing", spy)
    return seen


def _writers(url: Path, recs, groups: list[list[int]], *, forget: bool) -> None:
    """One writer per group of cuts, one after the other; ``forget``: no templates between."""
    m = make_manifest(k=K, vocab_size=VOCAB)
    done = 0
    for cuts in groups:
        if forget:
            templates.TEMPLATES.clear()
        with CacheWriter.open(url, m, layout=LAYOUT) as w:
            for c in cuts:
                w.append(recs[done:c])
                done = c


def test_a_later_writer_takes_the_templates(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(templates, "TEMPLATES", templates.OrderedDict())
    monkeypatch.setattr(templates, "LAST", templates.OrderedDict())
    recs = make_records(16, k=K, vocab=VOCAB, seed=11)
    groups = [[3, 5], [9], [10, 16]]  # the later writers start inside partly filled shards
    _writers(tmp_path / "ref", recs, groups, forget=True)
    opened, read_back = _spy_opens(monkeypatch), _spy_readbacks(monkeypatch)
    _writers(tmp_path / "new", recs, groups[:1], forget=False)
    assert not DIRECT & set(opened), opened  # the creating writer keeps the arrays it made
    opened.clear()
    read_back.clear()
    _writers(tmp_path / "new", recs, groups[1:], forget=False)
    assert not DIRECT & set(opened), opened  # the later ones do not ...
    assert not DIRECT & set(read_back), read_back  # ... nor read their last shards back
    a, b = files(tmp_path / "ref"), files(tmp_path / "new")
    assert a.keys() == b.keys() and [n for n in a if a[n] != b[n]] == []
    _reads_back(tmp_path / "new", recs)


def test_a_store_changed_under_the_template_is_opened_through_zarr(
    tmp_path: Path, monkeypatch
) -> None:
    """The store is deleted and made again at the same URL with other chunks: its zarr.json
    differs from the template, so every array is opened through zarr; the rows read back."""
    monkeypatch.setattr(templates, "TEMPLATES", templates.OrderedDict())
    url, m = tmp_path / "c", make_manifest(k=K, vocab_size=VOCAB)
    recs = make_records(8, k=K, vocab=VOCAB, seed=12)
    with CacheWriter.open(url, m, layout=LAYOUT) as w:
        w.append(recs[:4])
    stale = templates.OrderedDict(templates.TEMPLATES)
    shutil.rmtree(url)
    other = replace(DEFAULT_LAYOUT, row_chunk=8, row_shard=32, token_chunk=16, token_shard=64)
    with CacheWriter.open(url, m, layout=other) as w:
        w.append(recs[:2])
    monkeypatch.setattr(templates, "TEMPLATES", stale)  # as if another process made it again
    opened = _spy_opens(monkeypatch)
    with CacheWriter.open(url, m) as w:
        w.append(recs[2:4])
    assert DIRECT <= set(opened)
    opened.clear()
    with CacheWriter.open(url, m) as w:  # the new store's own templates
        w.append(recs[4:])
    assert not DIRECT & set(opened), opened
    _reads_back(url, recs)


def test_rows_left_past_the_commit_are_opened_through_zarr(tmp_path: Path, monkeypatch) -> None:
    """A writer that died past the commit left arrays longer than the committed counts: their
    zarr.json is not the template at the committed length, so zarr opens (and shrinks) them."""
    monkeypatch.setattr(templates, "TEMPLATES", templates.OrderedDict())
    url, m = tmp_path / "c", make_manifest(k=K, vocab_size=VOCAB)
    recs = make_records(10, k=K, vocab=VOCAB, seed=13)
    with CacheWriter.open(url, m, layout=LAYOUT) as w:
        w.append(recs[:4])
        stray = writer.encode_batch(make_records(3, prefix="x"), w.manifest)
        w._write(w.manifest, stray)  # step 4 only, as a writer killed before its commit
    opened = _spy_opens(monkeypatch)
    with CacheWriter.open(url, m) as w:
        w.append(recs[4:])
    assert DIRECT <= set(opened)
    _reads_back(url, recs)


def test_a_last_shard_replaced_since_is_read_back(tmp_path: Path, monkeypatch) -> None:
    """The store is made again at the same URL by someone else (another process: this process's
    kept last shards are the old store's) with the same layout and the same counts: the
    zarr.json matches the template, but the shard files are not the ones the old writer wrote,
    so they are read back and the new store's rows are kept."""
    monkeypatch.setattr(templates, "TEMPLATES", templates.OrderedDict())
    monkeypatch.setattr(templates, "LAST", templates.OrderedDict())
    url, m = tmp_path / "c", make_manifest(k=K, vocab_size=VOCAB)
    old = make_records(4, k=K, vocab=VOCAB, seed=14, min_len=20, max_len=20, prefix="o")
    new = make_records(8, k=K, vocab=VOCAB, seed=15, min_len=20, max_len=20)
    with CacheWriter.open(url, m, layout=LAYOUT) as w:
        w.append(old)
    kept = dict(templates.LAST[str(url)])
    shutil.rmtree(url)
    with CacheWriter.open(url, m, layout=LAYOUT) as w:  # "another process"
        w.append(new[:4])
    templates.LAST[str(url)] = kept  # as this process left it
    read_back = _spy_readbacks(monkeypatch)
    with CacheWriter.open(url, m) as w:
        w.append(new[4:])
    assert {"topk_ids", "topk_logprobs"} <= set(read_back)
    _reads_back(url, new)


def test_kept_templates_and_last_shards_are_bounded(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(templates, "LAST", templates.OrderedDict())
    monkeypatch.setattr(templates, "TEMPLATES", templates.OrderedDict())
    monkeypatch.setattr(templates, "KEEP_TEMPLATES", 12)
    m = make_manifest(k=K, vocab_size=VOCAB)
    for i in range(templates.KEEP_LAST_STORES + 2):
        with CacheWriter.open(tmp_path / f"c{i}", m, layout=LAYOUT) as w:
            w.append(make_records(2, k=K, vocab=VOCAB, seed=i))
    assert list(templates.LAST) == [
        str(tmp_path / f"c{i + 2}") for i in range(templates.KEEP_LAST_STORES)
    ]
    assert len(templates.TEMPLATES) == 12  # the most recent store's arrays come last
    assert list(templates.TEMPLATES)[-1][0] == str(tmp_path / f"c{templates.KEEP_LAST_STORES + 1}")
