"""Hidden-state capture (FORMAT.md 4.10) on the real transformers engine and the tiny teacher:
the stored hidden states and head rebuild the engine's own top-k rows; backends that do not
capture them say so with a typed error."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from engine_support import FakeEngine
from format_support import hidden_manifest
from logitcache.cache_format import CacheReader, CacheWriter, HiddenRecord, validate
from logitcache.server.engine.base import BaseEngine
from logitcache.server.engine.hidden import head_of
from logitcache.server.engine.protocol import EngineInputError

K = 20


@pytest.fixture(scope="module")
def captured(hf_engine, heldout_sequences):
    prompts = heldout_sequences[:8]
    hidden = asyncio.run(hf_engine.score_hidden(prompts))
    rows = asyncio.run(hf_engine.score(prompts, K))
    return prompts, hidden, rows, hf_engine.teacher_head()


def _top(lp: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    t = torch.topk(torch.from_numpy(lp), k, dim=-1)
    return t.indices.numpy(), t.values.numpy()


def test_rebuilt_logits_reproduce_the_topk_rows(captured) -> None:
    prompts, hidden, rows, head = captured
    assert head.dtype == "float32" and head.bias is None and head.softcap is None
    for p, h, r in zip(prompts, hidden, rows, strict=True):
        assert h.dtype == np.float32 and h.shape == (len(p) - 1, head.dim)
        ids, lp = _top(head.logprobs(h), K)
        assert np.array_equal(ids, r.topk_ids)
        np.testing.assert_allclose(lp, r.topk_logprobs, atol=1e-4)


def _stored_error(tmp_path, captured, dtype: str) -> tuple[float, float]:
    """(max |logprob error| on the engine's top-5 ids, fraction of rows with the same top-1)
    of the logits rebuilt from a ``dtype`` cache."""
    prompts, hidden, rows, head = captured
    url = tmp_path / f"{dtype}.zarr"
    with CacheWriter.open(url, hidden_manifest(head, dtype), head=head) as w:
        w.append([HiddenRecord(None, p, h) for p, h in zip(prompts, hidden, strict=True)])
    assert validate(url).ok
    reader = CacheReader(url)
    stored = reader.head()
    err, same, n = 0.0, 0, 0
    for i, r in enumerate(rows):
        lp = stored.logprobs(reader.sequence(i).hidden)
        got = np.take_along_axis(lp, r.topk_ids[:, :5].astype(np.int64), axis=1)
        err = max(err, float(np.abs(got - r.topk_logprobs[:, :5]).max()))
        same += int((lp.argmax(axis=1) == r.topk_ids[:, 0]).sum())
        n += r.num_rows
    return err, same / n


def test_stored_hidden_states_error(tmp_path, captured) -> None:
    """The bounds FORMAT.md 4.10 states for the tiny teacher."""
    bf16 = _stored_error(tmp_path, captured, "bfloat16")
    e4m3 = _stored_error(tmp_path, captured, "float8_e4m3")
    print(f"rows {sum(r.num_rows for r in captured[2])}, bfloat16: {bf16}, e4m3: {e4m3}")
    assert bf16[0] <= 0.03 and bf16[1] >= 0.99
    assert e4m3[0] <= 0.3 and e4m3[1] >= 0.95


def test_backends_without_capture_say_so() -> None:
    engine = FakeEngine()  # BaseEngine's answer (both real backends capture)
    assert type(engine)._generate_hidden is BaseEngine._generate_hidden
    with pytest.raises(EngineInputError, match="does not capture hidden states yet"):
        asyncio.run(engine.score_hidden([[1, 2, 3]]))
    with pytest.raises(EngineInputError, match="does not capture hidden states yet"):
        engine.teacher_head()


def test_head_of_reads_softcap_and_logit_scale() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 8, generator=g).to(torch.bfloat16)
    config = SimpleNamespace(final_logit_softcapping=30.0, logit_scale=0.0625)
    head = head_of(w, None, config)
    assert head.dtype == "bfloat16" and head.softcap == 30.0 and head.logit_scale == 0.0625
    h = torch.randn(5, 8, generator=g) * 50
    want = 30.0 * torch.tanh(0.0625 * (h @ w.float().T) / 30.0)
    np.testing.assert_allclose(head.logits(h.numpy()), want.numpy(), rtol=1e-5, atol=1e-5)
    plain = head_of(w.float(), torch.ones(40), SimpleNamespace())
    assert plain.dtype == "float32" and plain.softcap is None and plain.logit_scale == 1.0
    assert plain.bias is not None and plain.spec()["bias"] is True


def test_hidden_job_over_http_rebuilds_the_engine_rows(hf_engine, captured, tmp_path) -> None:
    """A ``targets="hidden"`` job on the real server (uvicorn, the tiny teacher): the cache's
    rows and head rebuild the engine's own top-k rows; status says what the job wrote."""
    from engine_support import app_settings
    from logitcache.client.cli.jobs import targets_label
    from server_support import ThreadedServer, tree_snapshot, wait_job

    prompts, _hidden, rows, head = captured
    settings = app_settings(tmp_path, k=8)
    records = [{"id": f"r{i}", "input_ids": list(map(int, p))} for i, p in enumerate(prompts)]
    caches = tmp_path / "caches"
    with ThreadedServer(settings, hf_engine) as server, server.client() as c:
        bad = [
            ("/v1/jobs", {"cache": "h", "records": records, "targets": "hidden", "k": 5}),
            ("/v1/score", {"input_ids": [prompts[0]], "targets": "hidden"}),
            ("/v1/score", {"input_ids": [prompts[0]], "targets": "hidden", "cache": "h"}),
        ]
        for path, body in bad:
            r = c.post(path, json=body)
            assert r.status_code == 422, r.text
        assert "written by jobs" in r.json()["error"]["message"]
        assert tree_snapshot(caches) == {}
        r = c.post("/v1/jobs", json={"cache": "h", "records": records, "targets": "hidden"})
        assert r.status_code == 201, r.text
        job = wait_job(c, r.json()["id"])
        assert job["state"] == "succeeded", job
        assert job["targets"] == "hidden" and targets_label(job) == "hidden states"
        r = c.post("/v1/jobs", json={"cache": "h", "records": records[:1], "k": 4})
        assert r.status_code == 409, r.text  # one cache, one kind
    reader = CacheReader(caches / "h")
    assert reader.manifest.hidden == head.spec("bfloat16") and validate(caches / "h").ok
    stored = reader.head()
    for i, r in enumerate(rows):
        rec = reader.get(f"r{i}")
        lp = stored.logprobs(rec.hidden)
        assert (lp.argmax(axis=1) == r.topk_ids[:, 0]).mean() >= 0.99
        got = np.take_along_axis(lp, r.topk_ids[:, :5].astype(np.int64), axis=1)
        assert np.abs(got - r.topk_logprobs[:, :5]).max() <= 0.03


def test_cli_target_fields_of_hidden() -> None:
    from logitcache.client.cli.jobs import CliError, target_fields

    none = {"draws": None, "proposal_temperature": None, "seed": None, "head": None}
    assert target_fields("hidden", None, none) == {"targets": "hidden"}
    with pytest.raises(CliError, match="do not apply to --targets hidden"):
        target_fields("hidden", 5, none)


def test_hidden_job_on_an_engine_without_capture_is_refused(tmp_path) -> None:
    from engine_support import app_settings, in_process
    from server_support import tree_snapshot

    async def submit() -> Any:
        async with in_process(app_settings(tmp_path), FakeEngine()) as c:
            body = {"cache": "h", "records": [{"input_ids": [1, 2, 3]}], "targets": "hidden"}
            return await c.post("/v1/jobs", json=body)

    r = asyncio.run(submit())
    assert r.status_code == 422 and "does not capture hidden states yet" in r.text
    assert tree_snapshot(tmp_path / "caches") == {}


@pytest.mark.vllm
def test_vllm_captures_hidden_states(vllm_engine, captured) -> None:
    """The vLLM backend's worker hook gives the hidden states its own top-k pass turns into
    logits, and its head (read from the checkpoint) is the transformers engine's."""
    from engine_support import assert_rows_close

    prompts, _hidden, _rows, head = captured
    assert vllm_engine.teacher_head().digest() == head.digest()
    states = asyncio.run(vllm_engine.score_hidden(prompts))
    rows = asyncio.run(vllm_engine.score(prompts, K))
    for p, h, r in zip(prompts, states, rows, strict=True):
        assert h.dtype == np.float32 and h.shape == (len(p) - 1, head.dim)
        assert_rows_close(_top(head.logprobs(h), K), r, atol=1e-3)
