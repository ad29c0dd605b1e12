"""Hidden-state targets (FORMAT.md 4.10): the bfloat16 and e4m3 codecs against torch's casts,
written and read back by every read path, the head stored once and content-hashed, validate,
the wire codec, and bad input refused with nothing written. Real zarr stores in ``tmp_path``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import zarr
from format_support import (
    hidden_manifest,
    make_head,
    make_hidden_records,
    make_manifest,
    make_records,
    reseal,
)
from logitcache.cache_format import (
    CacheReader,
    CacheWriter,
    HiddenRecord,
    Manifest,
    TargetKindError,
    decode_records,
    encode_records,
    validate,
)
from logitcache.cache_format.errors import (
    ManifestError,
    ManifestMismatchError,
    MissingDataError,
    RecordError,
    WireFormatError,
)
from logitcache.cache_format.hidden import (
    decode_rows,
    encode_e4m3,
    from_bf16_bits,
    to_bf16_bits,
    to_e4m3_bits,
)

V, D = 50, 16


def test_codecs_match_torch_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.standard_normal(50_000).astype(np.float32) * 40,
            np.linspace(-448, 448, 20_001, dtype=np.float32),
            np.array([0, -0.0, 2**-10, 3 * 2**-10, 2**-7, 447.9, 448], np.float32),
        ]
    ).clip(-448, 448)
    t = torch.from_numpy(x)
    e4m3 = t.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(to_e4m3_bits(x), e4m3)
    bf16 = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(to_bf16_bits(x), bf16)
    assert np.array_equal(from_bf16_bits(bf16), t.to(torch.bfloat16).float().numpy())
    h = rng.standard_normal((300, 64)).astype(np.float32)
    bits, scale = encode_e4m3(h)
    back = decode_rows(bits, "float8_e4m3", scale)
    assert np.abs(back - h).max() <= np.abs(h).max(axis=1).max() / 448 * 16  # 1/16 relative


@pytest.fixture(params=["bfloat16", "float8_e4m3"])
def store(request, tmp_path):
    head = make_head(V, D)
    recs = make_hidden_records(9, V, D, seed=1)
    url = tmp_path / "h.zarr"
    with CacheWriter.open(url, hidden_manifest(head, request.param), head=head) as w:
        assert w.append(recs[:5]) == 5 and w.append(recs[5:]) == 4
    return url, recs, head, request.param


def _expected(rec: HiddenRecord, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return from_bf16_bits(to_bf16_bits(rec.hidden))
    bits, scale = encode_e4m3(rec.hidden)
    return decode_rows(bits, "float8_e4m3", scale)


def test_every_read_path(store) -> None:
    url, recs, head, dtype = store
    r = CacheReader(url)
    m = r.manifest
    assert m.targets == "hidden" and m.k == 1 and m.hidden["dim"] == D
    assert m.num_rows == sum(x.num_rows for x in recs)
    want = [_expected(x, dtype) for x in recs]
    for i, x in enumerate(recs):
        got = r.sequence(i)
        assert isinstance(got, HiddenRecord) and got.key == x.key
        assert np.array_equal(got.input_ids, x.input_ids)
        assert got.hidden.dtype == np.float32 and np.array_equal(got.hidden, want[i])
    assert np.array_equal(r.get("h3").hidden, want[3])
    for got, i in zip(r.sequences([7, 0, 7]), [7, 0, 7], strict=True):
        assert np.array_equal(got.hidden, want[i])
    ranged = r.read_ranges([(2, 6), (0, 1)])
    assert [x.key for x in ranged] == ["h2", "h3", "h4", "h5", "h0"]
    assert all(np.array_equal(g.hidden, want[int(g.key[1:])]) for g in ranged)
    flat = np.concatenate(want)
    block = r.rows(3, 40)
    assert block.start == 3 and np.array_equal(block.hidden, flat[3:40])
    bits = r.rows(3, 40, logprob_dtype="bfloat16")
    assert bits.hidden.dtype == np.uint16 and np.array_equal(bits.hidden, to_bf16_bits(flat[3:40]))
    t = bits.to_torch()["hidden"]
    assert t.dtype == torch.bfloat16
    assert torch.equal(t, torch.from_numpy(flat[3:40]).to(torch.bfloat16))
    with pytest.raises(ValueError, match="decode to one of"):
        r.rows(0, 2, logprob_dtype="float16")
    got_head = r.head()
    assert got_head.digest() == head.digest() == m.hidden["head_digest"]
    assert np.array_equal(got_head.weight, head.weight) and np.array_equal(got_head.bias, head.bias)
    assert validate(url).ok


def test_hidden_store_refuses_topk_reads_and_topk_store_has_no_head(store, tmp_path) -> None:
    url = store[0]
    with pytest.raises(TargetKindError, match="no top-k rows"):
        CacheReader(url).read_spans([(slice(0, 2), None)])
    topk = tmp_path / "t.zarr"
    with CacheWriter.open(topk, make_manifest(k=4, vocab_size=V)) as w:
        w.append(make_records(2, k=4, vocab=V))
    with pytest.raises(TargetKindError, match="no head"):
        CacheReader(topk).head()


def _objects(url) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), url)
        for d, _, fs in os.walk(url)
        for f in fs
        if f != "zarr.json"
    )


def test_bad_input_writes_nothing(tmp_path) -> None:
    head = make_head(V, D)
    url = tmp_path / "h.zarr"
    w = CacheWriter.open(url, hidden_manifest(head))
    recs = make_hidden_records(2, V, D)
    with pytest.raises(ManifestError, match="needs the teacher head"):
        w.append(recs)  # first commit without the head
    w.close()
    other = make_head(V, D, seed=5)
    with pytest.raises(ManifestError, match="head_digest"):
        CacheWriter.open(url, hidden_manifest(head), head=other)
    w = CacheWriter.open(url, hidden_manifest(head), head=head)
    bad = [
        make_records(1, k=4, vocab=V)[0],  # a top-k record
        HiddenRecord("x", [1, 2, 3], np.zeros((2, D + 1), np.float32)),  # wrong d
        HiddenRecord("y", [1, 2, V], np.zeros((2, D), np.float32)),  # id outside the vocabulary
        HiddenRecord("z", [1, 2, 3], np.full((2, D), np.nan, np.float32)),  # NaN
    ]
    for b in bad:
        with pytest.raises(RecordError):
            w.append([recs[0], b])
    w.close()
    assert CacheReader(url).num_sequences == 0 and _objects(url) == []
    with pytest.raises(ManifestMismatchError, match="hidden"):
        CacheWriter.open(url, hidden_manifest(other), head=other)
    doc = hidden_manifest(head).to_attrs()
    with pytest.raises(ManifestError, match="k=1"):
        Manifest.from_attrs({**doc, "k": 2})
    with pytest.raises(ManifestError, match="go together"):
        Manifest.from_attrs({**doc, "hidden": None})
    with pytest.raises(ManifestError, match="softcap"):
        Manifest.from_attrs({**doc, "hidden": {**doc["hidden"], "softcap": -1.0}})


def test_validate_and_reads_catch_damage(store) -> None:
    url, recs, head, _dtype = store
    arr = zarr.open_array(zarr.storage.LocalStore(str(url)), path="head_weight", mode="r+")
    w = arr[:]
    w[0, 0] += 1
    arr[:] = w
    reseal(url, "head_weight")
    report = validate(url)
    assert report.codes() == {"head_digest"}
    with pytest.raises(Exception, match="hash to"):
        CacheReader(url).head()
    shard = next(p for p in _objects(url) if p.startswith("hidden/"))
    os.remove(os.path.join(url, shard))
    assert "object_missing" in validate(url).codes()
    with pytest.raises(MissingDataError):
        CacheReader(url).sequence(0)


def test_wire_round_trip(store) -> None:
    url, recs, _head, dtype = store
    got = CacheReader(url).sequences(list(range(len(recs))))
    for wire_dtype in ("float32", "bfloat16"):
        for comp in ("none", "zstd"):
            back = decode_records(encode_records(got, logprob_dtype=wire_dtype, compression=comp))
            assert [b.key for b in back] == [g.key for g in got]
            for b, g in zip(back, got, strict=True):
                assert np.array_equal(b.input_ids, g.input_ids)
                if wire_dtype == "float32":
                    assert np.array_equal(b.hidden, g.hidden)
                else:
                    assert b.hidden.dtype == np.uint16
                    assert np.array_equal(b.hidden, to_bf16_bits(g.hidden))
    with pytest.raises(WireFormatError, match="not both"):
        encode_records([got[0], make_records(1, k=4, vocab=V)[0]])
    with pytest.raises(WireFormatError, match="one of"):
        encode_records(got, logprob_dtype="float16")


def test_spec_reader_decodes_hidden_stores(store) -> None:
    """``tests/spec_reader.py`` (written from FORMAT.md alone) decodes the hidden rows and the
    head to the project reader's values and recomputes the head digest."""
    from spec_reader import SpecStore

    url, _recs, head, dtype = store
    spec = SpecStore(url).decode()
    r = CacheReader(url)
    assert np.array_equal(spec["hidden"], r.rows(0, r.num_rows).hidden)
    assert np.array_equal(spec["head_weight"], head.weight)
    assert np.array_equal(spec["head_bias"], head.bias)
    assert spec["encodings"]["hidden"] == dtype and "topk_ids" not in spec


def test_info_command_reports_a_hidden_store(store) -> None:
    """``logitcache info`` and ``export`` (``cache_format/cli.py``) on a hidden store: row bytes
    are the ``hidden`` array's, raw bytes per position FORMAT.md 4.10's, no tail summary; JSON
    lines carry the hidden rows."""
    import json as _json

    from logitcache.client.cli import app
    from typer.testing import CliRunner

    url, _recs, _head, dtype = store
    out = CliRunner().invoke(app, ["info", str(url), "--json"])
    assert out.exit_code == 0, out.output
    doc = _json.loads(out.output)
    assert doc["raw_bytes_per_position"] == (2 * D if dtype == "bfloat16" else D + 4)
    assert doc["tail_mass"] is None and "head_weight" in doc["bytes_by_array"]
    hidden_bytes = doc["bytes_by_array"]["hidden"] + doc["bytes_by_array"].get("hidden_scale", 0)
    assert doc["bytes_per_position"] * CacheReader(url).num_rows == pytest.approx(
        hidden_bytes, 1e-3
    )


@pytest.mark.parametrize("fail", ["head_weight", "hidden"])
def test_a_failed_append_loses_nothing_committed(tmp_path, monkeypatch, fail) -> None:
    """W3-W5 for hidden stores: an append whose array writes fail (the head's, at the first
    commit, or the rows') commits nothing; the committed rows read back bit-exact and the next
    writer appends as if the failed append never happened."""
    from logitcache.cache_format import _writer

    head = make_head(V, D)
    recs = make_hidden_records(8, V, D, seed=9)
    url = tmp_path / "h.zarr"
    first = recs[:3] if fail == "hidden" else []
    with CacheWriter.open(url, hidden_manifest(head), head=head) as w:
        if first:
            w.append(first)
    before = [r.hidden.copy() for r in CacheReader(url).sequences(list(range(len(first))))]
    real = _writer.CacheWriter._put

    def broken(self, objects):
        real(self, objects)
        if any(key.startswith(f"{fail}/") for key, _ in objects):  # written past the commit,
            raise OSError("disk gone")  # then the append dies

    monkeypatch.setattr(_writer.CacheWriter, "_put", broken)
    with CacheWriter.open(url, hidden_manifest(head), head=head) as w, pytest.raises(OSError):
        w.append(recs[3:])
    monkeypatch.undo()
    r = CacheReader(url)
    assert r.num_sequences == len(first)
    assert all(
        np.array_equal(a.hidden, b)
        for a, b in zip(r.sequences(list(range(len(first)))), before, strict=True)
    )
    with CacheWriter.open(url, hidden_manifest(head), head=head) as w:
        assert w.append(recs[3:]) == 5
    r = CacheReader(url)
    assert r.num_sequences == len(first) + 5 and validate(url).ok
    assert r.head().digest() == head.digest()
    want = [_expected(x, "bfloat16") for x in [*first, *recs[3:]]]
    got = r.sequences(list(range(r.num_sequences)))
    assert all(np.array_equal(g.hidden, w_) for g, w_ in zip(got, want, strict=True))


def test_peer_format_export_refuses_a_hidden_cache(store, tmp_path) -> None:
    from logitcache.client.interop import InteropError, export_axolotl

    with pytest.raises(InteropError, match="holds hidden rows"):
        export_axolotl(str(store[0]), tmp_path / "out")
