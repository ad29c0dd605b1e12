"""The ``random_access_raw`` layout preset (FORMAT.md 4.7, issue #14): the ``random_access``
chunking with every numeric array stored without a compressor (inner codecs ``bytes`` LE +
``crc32c``). Such a store is recorded as the preset, validates, and reads back bit-identically
through every read path (compiled point reads, per-chunk point reads, the range path, reader
processes, zarr's array API); a flipped byte in a raw chunk is the typed ``ChecksumError`` on
every path (its CRC32C is checked, nothing is decompressed); a job and the CLI accept the name."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from format_support import CASES, SMALL, K, ZarrReader, assert_same_record, write_small_cache
from logitcache.cache_format import CacheReader, spec, validate
from logitcache.cache_format import _fastdecode as fastdecode
from logitcache.cache_format import _shardread as shardread
from logitcache.cache_format.errors import ChecksumError
from test_fastdecode import Spy, _per_chunk

RAW = spec.layout_named("random_access_raw")
# the preset's codecs on chunks of 8 rows / 16 tokens (chunk and shard edges everywhere)
SMALL_RAW = replace(
    SMALL, id_codec="none", logprob_codec="none", other_codec="none", tail_codec="none"
)
PATHS = ("compiled", "per_chunk", "zarr")


def _reader(url, path: str, **kw) -> CacheReader:
    if path == "per_chunk":
        return _per_chunk(url, **kw)
    if path == "zarr":
        return ZarrReader(url)
    return CacheReader(url, **kw)


def test_the_preset_is_recorded_uncompressed_and_validates(tmp_path):
    assert spec.LAYOUTS["random_access_raw"] is RAW is spec.RANDOM_ACCESS_RAW_LAYOUT
    ra = spec.layout_named("random_access")
    assert (RAW.row_chunk, RAW.row_shard, RAW.token_chunk) == (64, ra.row_shard, 512)
    url = tmp_path / "c"
    recs = write_small_cache(url, RAW)
    for name in ("topk_ids", "topk_logprobs", "tail_mass", "input_ids", "seq_lengths"):
        meta = json.loads((url / name / "zarr.json").read_text())
        assert meta["attributes"][spec.LAYOUT_ATTR] == "random_access_raw"
        inner = meta["codecs"][0]["configuration"]["codecs"]
        assert [c["name"] for c in inner] == ["bytes", "crc32c"], name
    r = CacheReader(url)
    assert r.layout_name == "random_access_raw"
    assert all(
        r._opened.direct[n].raw for n in ("topk_ids", "topk_logprobs", "tail_mass", "input_ids")
    )
    got = r.sequences(range(len(recs)))
    for g, want in zip(got, recs, strict=True):
        assert g.key == want.key
        assert np.array_equal(g.topk_ids, want.topk_ids)
        assert np.array_equal(g.input_ids, want.input_ids)
    # one raw chunk stores exactly its bytes and a CRC32C: 64 rows x K int32
    shard = (url / "topk_ids" / "c" / "0" / "0").read_bytes()
    index = np.frombuffer(shard[-(16 * (RAW.row_shard // 64) + 4) : -4], "<u8").reshape(-1, 2)
    assert int(index[0, 1]) == 64 * K * 4 + 4
    assert validate(url).ok


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(kw) or "float16")
def test_every_read_path_returns_the_same_values(tmp_path, monkeypatch, kw):
    monkeypatch.setattr(fastdecode, "PARALLEL_MIN_BYTES", 1)  # tiny calls split over threads too
    url = tmp_path / "c"
    recs = write_small_cache(url, SMALL_RAW, **kw)
    assert validate(url).ok
    want = _reader(url, "zarr")
    others = [_reader(url, p) for p in PATHS[:3]] + [CacheReader(url, decode_threads=3)]
    spy = Spy(monkeypatch)
    idx = [5, 3, 5, 39, 0, 22, 21, 22, 38, 1]  # unsorted, repeated, neighbours sharing chunks
    wanted = [want.sequence(i) for i in range(len(recs))]  # stock zarr: read once, slowest path
    wanted_idx = want.sequences(idx)
    for r in others:
        for i in range(len(recs)):
            assert_same_record(r.sequence(i), wanted[i])
        for g, w in zip(r.sequences(idx), wanted_idx, strict=True):
            assert_same_record(g, w)
    assert np.array_equal(wanted[7].topk_ids, recs[7].topk_ids)
    if kw.get("logprob_dtype") != "uint8" and fastdecode.ready():
        assert spy.calls > 0 and spy.handed_back == 0  # the compiled path read raw chunks


def _first_shards(url) -> list:
    out = []
    for array in ("topk_ids", "topk_logprobs", "tail_mass", "input_ids"):
        first = url / array / "c" / "0"
        out.append(first / "0" if first.is_dir() else first)
    return out


def test_a_flipped_byte_is_a_checksum_error_on_every_path(tmp_path, monkeypatch):
    url = tmp_path / "c"
    write_small_cache(url, SMALL_RAW)
    monkeypatch.setattr("logitcache.cache_format._reader._RETRIES", 2)
    spy = Spy(monkeypatch)
    for shard in _first_shards(url):
        saved = shard.read_bytes()
        # a value byte of chunk 0 (the index is at the end)
        shard.write_bytes(saved[:20] + bytes([saved[20] ^ 1]) + saved[21:])
        for path in PATHS:
            r = _reader(url, path)
            with pytest.raises(ChecksumError if path != "zarr" else ValueError):
                r.sequence(0)  # (stock zarr: its own error)
            assert r.sequence(len(r) - 1).key  # later shards still read
        assert not validate(url).ok
        shard.write_bytes(saved)
    if fastdecode.ready():
        assert spy.handed_back >= 4  # the compiled path checked the CRC32C and handed back
    assert validate(url).ok


def test_raw_frame_checks():
    data = np.arange(24, dtype=np.int32).reshape(8, 3)
    import google_crc32c

    body = data.tobytes()
    frame = np.frombuffer(body + google_crc32c.value(body).to_bytes(4, "little"), np.uint8)
    dest = np.empty_like(data)
    assert shardread.check_decode(frame, dest, raw=True) is None
    assert np.array_equal(dest, data)
    short = np.empty((7, 3), np.int32)
    assert shardread.check_decode(frame, short, raw=True) == "raw chunk of 96 bytes, expected 84"
    bad = frame.copy()
    bad[3] ^= 0x10
    assert shardread.check_decode(bad, dest, raw=True) == "chunk fails its CRC32C"


def test_a_job_and_the_cli_accept_the_preset(tmp_path):
    import io

    from engine_support import FakeEngine, app_settings
    from logitcache.client.cli import app as format_cli
    from logitcache.client.cli import main
    from server_support import ThreadedServer
    from typer.testing import CliRunner

    settings = app_settings(tmp_path, job_batch_sequences=4)
    rows = [{"id": f"r{i}", "input_ids": [1, 2 + i, 9, 44, 3, i, 7]} for i in range(6)]
    (tmp_path / "data" / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with ThreadedServer(settings, FakeEngine()) as srv:
        out = io.StringIO()
        argv = ["jobs", "--url", srv.url, "submit", "raw", "in.jsonl", "--k", "8"]
        argv += ["--layout", "random_access_raw", "--watch", "--interval", "0.05"]
        rc = main(argv, out=out)
        assert rc == 0 and "succeeded" in out.getvalue().splitlines()[-1], out.getvalue()
        with srv.client() as c:
            assert c.get("/v1/jobs").json()["jobs"][0]["layout"] == "random_access_raw"
    url = tmp_path / "caches" / "raw"
    r = CacheReader(url)
    assert r.layout_name == "random_access_raw" and r.num_sequences == 6
    assert r._opened.direct["topk_ids"].raw
    assert [list(r.sequence(i).input_ids) for i in range(6)] == [x["input_ids"] for x in rows]
    res = CliRunner().invoke(format_cli, ["validate", str(url)])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(format_cli, ["info", str(url)])
    want = ["layout", "preset", "random_access_raw"]
    assert any(line.split() == want for line in res.output.splitlines()), res.output
