"""CacheDataset over a hidden cache (FORMAT.md 4.10): units carry the teacher's final hidden
states as bfloat16, locally and over real HTTP (a bare store server, and the app on a
float8_e4m3 cache); the head loaded from the cache feeds ``exact_distill_loss`` (and
``logitcache.client.hidden``'s docstring loop runs as written); top-k settings on a hidden cache
are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from client_support import collect, make_dataset, same_stream
from engine_support import FakeEngine, app_settings
from format_support import hidden_manifest, make_head, make_hidden_records
from logitcache.cache_format import CacheReader, CacheWriter, TargetKindError
from logitcache.cache_format.hidden import from_bf16_bits
from logitcache.client import CacheDataLoader, load_head
from logitcache.client.errors import ConfigError
from logitcache.client.loss import exact_distill_loss
from logitcache.client.sources import HttpSource, LocalSource
from server_support import StoreServer, ThreadedServer

V, D, DS = 50, 16, 8
SETTINGS = {"tokens_per_item": 48, "mode": "pack", "batch_size": 2, "seed": 3}


def _cache(root, name: str = "h", dtype: str = "bfloat16"):
    head = make_head(V, D, seed=2, softcap=20.0, logit_scale=0.5)
    recs = make_hidden_records(12, V, D, seed=4, max_len=30)
    with CacheWriter.open(root / name, hidden_manifest(head, dtype), head=head) as w:
        w.append(recs)
    return head, recs


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("hidden")
    head, recs = _cache(root)
    return root, head, recs


def _check_units(units: list[dict], url) -> None:
    """Every row of every unit (``collect``: bfloat16 as int16 bits) is the stored row of its
    (sequence, position)."""
    reader = CacheReader(url)
    stored = {r.input_ids.tobytes(): r.hidden for r in reader.sequences(list(range(len(reader))))}
    seen = 0
    for u in units:
        assert u["target_kind"] == "hidden" and "topk_ids" not in u and "tail_mass" not in u
        h = from_bf16_bits(u["hidden"].view(np.uint16))
        assert h.shape[-1] == D
        for b in range(h.shape[0]):
            seg, ids = u["segment_ids"][b], u["input_ids"][b]
            for s in set(seg.tolist()) - {0}:
                at = np.flatnonzero(seg == s)
                want = stored[ids[at].astype(np.int32).tobytes()]
                rows = at[: len(want)]
                assert np.array_equal(h[b, rows], want[: len(rows)])
                assert (u["labels"][b, at[len(want) :]] == -100).all()
                seen += len(rows)
    assert seen == sum(r.num_rows for r in reader.sequences(list(range(len(reader)))))


def test_local_units_hold_the_stored_rows(cache) -> None:
    root, _head, _recs = cache
    units = collect(make_dataset(str(root / "h"), **SETTINGS))
    _check_units(units, root / "h")
    with pytest.raises(ConfigError, match="topk does not apply"):
        make_dataset(str(root / "h"), topk=1, **SETTINGS)


def test_exact_loss_on_loader_units_matches_a_reference_and_trains(cache) -> None:
    """On loader units, the loss of a student head against the stored rows and the loaded
    head equals the full-softmax KL computed here in float64, and it trains."""
    root, head, _ = cache
    ds = make_dataset(str(root / "h"), **SETTINGS)
    got = load_head(ds.source, device="cpu")
    assert got["teacher_softcap"] == 20.0 and got["teacher_logit_scale"] == 0.5
    w = torch.from_numpy(head.weight)
    assert torch.equal(got["teacher_weight"], w.to(torch.bfloat16))
    assert torch.equal(load_head(ds.source, dtype=None)["teacher_weight"], w)
    assert got["teacher_bias"].dtype == torch.bfloat16
    wt, bt = got["teacher_weight"].double(), got["teacher_bias"].double()
    g = torch.Generator().manual_seed(0)
    proj = torch.nn.Linear(D, DS)
    student = torch.nn.Linear(DS, V, bias=False)
    opt = torch.optim.SGD([*proj.parameters(), *student.parameters()], lr=0.5)
    losses = []
    for _ in range(8):
        for batch in CacheDataLoader(ds, num_workers=0):
            th = batch["hidden"].float()
            h = proj(th + 0.1 * torch.randn(th.shape, generator=g))  # a stand-in student body
            mask = batch["loss_mask"]
            loss = exact_distill_loss(h, student.weight, batch["hidden"], mask=mask, **got)
            y = 20.0 * torch.tanh(0.5 * (th[mask].double() @ wt.T + bt) / 20.0)
            p = torch.log_softmax(y, -1)
            q = torch.log_softmax((h[mask] @ student.weight.T).double(), -1)
            ref = (p.exp() * (p - q)).sum(-1).mean()
            torch.testing.assert_close(loss.double(), ref, rtol=1e-3, atol=1e-4)
            losses.append(float(loss.detach()))
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert losses[-1] < 0.7 * losses[0]


def test_http_source_of_the_store_server_and_of_the_app(cache, tmp_path) -> None:
    root, head, _ = cache
    expected = collect(make_dataset(str(root / "h"), **SETTINGS))
    with StoreServer(root) as server:
        remote = HttpSource(server.url, "h")
        assert same_stream(collect(make_dataset(remote, **SETTINGS)), expected)
        w = load_head(remote, dtype=None)["teacher_weight"]
        assert torch.equal(w, torch.from_numpy(head.weight))
    app_root = tmp_path / "app"
    _cache(app_root / "caches", "h", "float8_e4m3")
    e4m3 = str(app_root / "caches" / "h")
    local = collect(make_dataset(e4m3, **SETTINGS))
    with ThreadedServer(app_settings(app_root), FakeEngine()) as server:
        remote = HttpSource(server.url, "h")
        assert same_stream(collect(make_dataset(remote, **SETTINGS)), local)


def test_load_head_of_a_topk_cache_is_refused(tmp_path) -> None:
    from client_support import build_cache, make_sequences

    build_cache(tmp_path / "t", make_sequences(3))
    with pytest.raises(TargetKindError):
        load_head(LocalSource(str(tmp_path / "t")))


def test_bf16_rows_decode_exactly(cache) -> None:
    root, _, recs = cache
    bits = CacheReader(root / "h").sequence(0, logprob_dtype="bfloat16").hidden
    assert np.array_equal(from_bf16_bits(bits), CacheReader(root / "h").sequence(0).hidden)


def test_the_module_docstring_block_runs(tmp_path) -> None:
    """The training loop of ``logitcache.client.hidden``'s docstring, executed as written on
    a hidden cache and the tiny Llama student (vocabulary 97): the student gets gradients."""
    import textwrap

    import logitcache.client.hidden as mod
    from client_support import tiny_llama
    from logitcache.client.packing import packed_hidden_states

    head = make_head(97, D, seed=1)
    with CacheWriter.open(tmp_path / "h", hidden_manifest(head), head=head) as w:
        w.append(make_hidden_records(6, 97, D, seed=2, max_len=30))
    doc = mod.__doc__ or ""
    block = doc.split("::\n\n", 1)[1].split("\n\n", 1)[0]
    ds = make_dataset(str(tmp_path / "h"), **SETTINGS)
    student = tiny_llama()
    scope = {
        "ds": ds,
        "loader": CacheDataLoader(ds, num_workers=0),
        "model": student,
        "student": student,
        "packed_hidden_states": packed_hidden_states,
        "exact_distill_loss": exact_distill_loss,
        "load_head": load_head,
    }
    exec(textwrap.dedent(block), scope)
    assert float(scope["loss"].detach()) > 0
    assert student.lm_head.weight.grad is not None and student.lm_head.weight.grad.abs().sum() > 0
