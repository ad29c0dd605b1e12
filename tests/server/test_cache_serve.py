"""Serving from the cache (issue #17): ``/v1/score`` hits/misses/k folding, the vLLM-compatible
``/v1/completions`` and ``/v1/models`` (real ``openai`` client and raw httpx), cache metrics.

Real parts: the suite's in-process vLLM engine on the tiny teacher, the real app under real
uvicorn (``ThreadedServer``), real zarr caches. "No engine work" is read from the engine's own
counter ``logitcache_tokens_scored_total{source="score",teacher=...}``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from logitcache.client import StreamConfig, open_source
from logitcache.server.metrics import scraped_total
from server_support import ThreadedServer, server_settings

pytestmark = pytest.mark.vllm

API_KEY = "cache-serve-key"
K = 8


@pytest.fixture(scope="module")
def server(vllm_engine, tiny, tmp_path_factory):
    work = tmp_path_factory.mktemp("cache-serve")
    settings = server_settings(work, str(tiny.teacher_dir), k=K, api_key=API_KEY)
    with ThreadedServer(settings, vllm_engine, api_key=API_KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def seqs(heldout_sequences):
    return [s[:40] for s in heldout_sequences if len(s) >= 12][:5]


def metric(client, name: str, **labels: str) -> float:
    return scraped_total(client.get("/metrics").text, name, **labels)


def engine_tokens(client) -> float:
    return metric(client, "logitcache_tokens_scored_total", source="score")


def test_score_hits_misses_and_identical_answers(client, seqs) -> None:
    first = client.post("/v1/score", json={"input_ids": seqs[:3], "cache": "s1"})
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["hits"] == 0 and body["stored"] == 3
    assert [s["cached"] for s in body["sequences"]] == [False] * 3
    assert first.headers["x-logitcache-hits"] == "0"

    t0, h0 = engine_tokens(client), metric(client, "logitcache_cache_hits_total")
    saved0 = metric(client, "logitcache_cache_tokens_saved_total")
    again = client.post("/v1/score", json={"input_ids": seqs[:3], "cache": "s1"})
    assert again.status_code == 200
    b2 = again.json()
    assert b2["hits"] == 3 and b2["stored"] == 0
    assert [s["cached"] for s in b2["sequences"]] == [True] * 3
    assert engine_tokens(client) == t0, "a full hit must not reach the engine"
    assert metric(client, "logitcache_cache_hits_total") == h0 + 3
    assert metric(client, "logitcache_cache_tokens_saved_total") == saved0 + sum(
        len(s) for s in seqs[:3]
    )
    assert metric(client, "logitcache_cache_bytes_served_total") > 0
    for a, b in zip(body["sequences"], b2["sequences"], strict=True):
        a.pop("cached"), b.pop("cached")
        assert a == b  # the miss was answered exactly as the cache answers it now

    # mixed: only the new sequence is scored
    mixed = client.post("/v1/score", json={"input_ids": [seqs[3], seqs[0]], "cache": "s1"})
    bm = mixed.json()
    assert [s["cached"] for s in bm["sequences"]] == [False, True] and bm["stored"] == 1
    assert engine_tokens(client) == t0 + len(seqs[3])

    # an explicit key stored with other tokens is not a hit: scored, answered, not overwritten
    client.post("/v1/score", json={"input_ids": [seqs[4]], "cache": "s1", "keys": ["kx"]})
    other = client.post("/v1/score", json={"input_ids": [seqs[1]], "cache": "s1", "keys": ["kx"]})
    bo = other.json()
    assert bo["hits"] == 0 and bo["stored"] == 0
    assert bo["sequences"][0]["input_ids"] == seqs[1]
    assert bo["sequences"][0]["topk_ids"] == body["sequences"][1]["topk_ids"]


def test_smaller_k_is_folded_from_the_cache_larger_k_is_a_miss(client, seqs) -> None:
    full = client.post("/v1/score", json={"input_ids": seqs[:2], "cache": "s2"}).json()
    assert full["k"] == K
    t0 = engine_tokens(client)
    small = client.post("/v1/score", json={"input_ids": seqs[:2], "cache": "s2", "k": 3})
    assert small.status_code == 200, small.text
    bs = small.json()
    assert bs["k"] == 3 and bs["hits"] == 2 and engine_tokens(client) == t0
    for f, s in zip(full["sequences"], bs["sequences"], strict=True):
        lp = np.asarray(f["topk_logprobs"], dtype=np.float64)
        assert s["topk_ids"] == [row[:3] for row in f["topk_ids"]]
        assert s["topk_logprobs"] == [row[:3] for row in f["topk_logprobs"]]
        want = np.clip(np.asarray(f["tail_mass"]) + np.exp(lp[:, 3:]).sum(1), 0, 1)
        np.testing.assert_allclose(s["tail_mass"], want, rtol=1e-6, atol=1e-7)
    # the folded answer agrees with the engine scoring at k=3 directly (float16 storage)
    direct = client.post("/v1/score", json={"input_ids": seqs[:2], "k": 3}).json()
    for d, s in zip(direct["sequences"], bs["sequences"], strict=True):
        assert d["topk_ids"] == s["topk_ids"]
        np.testing.assert_allclose(d["topk_logprobs"], s["topk_logprobs"], atol=2e-2)
        np.testing.assert_allclose(d["tail_mass"], s["tail_mass"], atol=2e-3)
    # a larger k than the cache's: a miss, scored by the engine at that k, returned, not stored
    m0, t1 = metric(client, "logitcache_cache_misses_total"), engine_tokens(client)
    big = client.post("/v1/score", json={"input_ids": seqs[:1], "cache": "s2", "k": K + 1})
    assert big.status_code == 200, big.text
    bb = big.json()
    assert bb["k"] == K + 1 and bb["hits"] == 0 and bb["stored"] == 0
    assert big.headers["x-logitcache-k"] == str(K + 1)
    assert [s["cached"] for s in bb["sequences"]] == [False]
    assert len(bb["sequences"][0]["topk_ids"][0]) == K + 1
    assert engine_tokens(client) == t1 + len(seqs[0])
    assert metric(client, "logitcache_cache_misses_total") == m0 + 1
    direct_big = client.post("/v1/score", json={"input_ids": seqs[:1], "k": K + 1}).json()
    assert bb["sequences"][0]["topk_ids"] == direct_big["sequences"][0]["topk_ids"]
    np.testing.assert_allclose(
        bb["sequences"][0]["topk_logprobs"], direct_big["sequences"][0]["topk_logprobs"], atol=1e-5
    )
    info = client.get("/v1/caches/s2").json()
    assert info["manifest"]["k"] == K and info["num_sequences"] == 2, info  # kept k, nothing added
    again = client.post("/v1/score", json={"input_ids": seqs[:1], "cache": "s2", "k": K + 1})
    assert again.json()["hits"] == 0, "a larger k is never served from a smaller-k cache"
    assert math.isfinite(metric(client, "logitcache_cache_misses_total"))


def test_status_page_shows_cache_counters(client) -> None:
    client.post("/v1/score", json={"input_ids": [[1, 2, 3, 4]], "cache": "s3"})
    client.post("/v1/score", json={"input_ids": [[1, 2, 3, 4]], "cache": "s3"})
    hits = int(metric(client, "logitcache_cache_hits_total"))
    misses = int(metric(client, "logitcache_cache_misses_total"))
    assert hits >= 1 and misses >= 1
    page = client.get("/")
    assert page.status_code == 200
    assert f"{hits} hits / {misses} misses" in page.text


def test_openai_client_completions_served_from_the_cache(server, client, seqs, tiny) -> None:
    from openai import OpenAI

    oa = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    model = oa.models.list().data[0].id
    assert model == tiny.teacher_dir.name

    def ask():
        return oa.completions.create(
            model=model,
            prompt=seqs[:2],
            max_tokens=0,
            echo=True,
            extra_body={"prompt_logprobs": 5, "cache": "oa"},
        ).model_dump()

    t0 = engine_tokens(client)
    first = ask()
    assert engine_tokens(client) == t0 + sum(len(s) for s in seqs[:2])
    t1, h1 = engine_tokens(client), metric(client, "logitcache_cache_hits_total")
    second = ask()
    assert engine_tokens(client) == t1, "a repeated request must not reach the engine"
    assert metric(client, "logitcache_cache_hits_total") == h1 + 2
    assert [c["cached"] for c in first["choices"]] == [False, False]
    assert [c["cached"] for c in second["choices"]] == [True, True]
    for a, b in zip(first["choices"], second["choices"], strict=True):
        assert a["prompt_logprobs"] == b["prompt_logprobs"]  # identical numbers
    assert first["usage"]["prompt_tokens"] == sum(len(s) for s in seqs[:2])
    assert first["usage"]["completion_tokens"] == 0

    # the same numbers as /v1/score on that cache (top 5 of its k, in order, ranks 1..5), and
    # first, as vLLM puts it, the actual prompt token: its top-k rank, or its rank beyond them
    ref = client.post("/v1/score", json={"input_ids": seqs[:2], "cache": "oa", "k": 5}).json()
    assert ref["hits"] == 2
    outside = 0
    for choice, seq, want in zip(first["choices"], seqs[:2], ref["sequences"], strict=True):
        plp = choice["prompt_logprobs"]
        assert len(plp) == len(seq) and plp[0] is None
        assert choice["text"] and isinstance(choice["text"], str)  # echo: the decoded prompt
        rows = zip(plp[1:], seq[1:], want["topk_ids"], want["topk_logprobs"], strict=True)
        for pos, tok, ids, lps in rows:
            assert next(iter(pos)) == str(tok)  # the actual token first
            top = sorted((v["rank"], t, v["logprob"]) for t, v in pos.items() if v["rank"] <= 5)
            assert [t for _, t, _ in top] == [str(t) for t in ids]
            assert [lp for _, _, lp in top] == lps
            assert [r for r, _, _ in top] == [1, 2, 3, 4, 5]
            assert len(pos) == 5 + (tok not in ids)
            if tok not in ids:
                outside += 1
                # its rank in the cache's top-8 row, else 9 (vLLM: the exact rank)
                assert (
                    6 <= pos[str(tok)]["rank"] <= 9 and pos[str(tok)]["logprob"] <= lps[-1] + 1e-3
                )
            assert all(isinstance(v["decoded_token"], str) for v in pos.values())
    assert outside > 0  # the case vLLM adds an entry for is exercised


def test_raw_vllm_request_shape_and_errors(server, client, tiny) -> None:
    # the shape of vLLM's docs: a text prompt, max_tokens 1, prompt_logprobs; default cache
    body = {"model": tiny.teacher_dir.name, "prompt": "The quick brown fox", "max_tokens": 1}
    r = client.post("/v1/completions", json={**body, "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    ans = r.json()
    assert ans["object"] == "text_completion" and len(ans["choices"]) == 1
    c = ans["choices"][0]
    assert c["index"] == 0 and c["text"] == "" and c["finish_reason"] == "length"
    assert c["prompt_logprobs"][0] is None and len(c["prompt_logprobs"][1]) in (3, 4)
    t0 = engine_tokens(client)
    r2 = client.post("/v1/completions", json={**body, "prompt_logprobs": 3})
    assert r2.json()["choices"][0]["prompt_logprobs"] == c["prompt_logprobs"]
    assert r2.json()["choices"][0]["cached"] is True and engine_tokens(client) == t0
    # a larger k than the default cache's: scored by the engine, not stored
    big = client.post("/v1/completions", json={**body, "prompt_logprobs": K + 2})
    assert big.status_code == 200 and big.json()["choices"][0]["cached"] is False
    assert len(big.json()["choices"][0]["prompt_logprobs"][1]) in (K + 2, K + 3)
    assert engine_tokens(client) > t0
    # unauthenticated, and what the route does not do: typed errors
    with httpx_client(server.url) as anon:
        assert anon.post("/v1/completions", json=body).status_code == 401
        assert anon.get("/v1/models").status_code == 401
    for extra, code in [
        ({"prompt_logprobs": 0}, 422),
        ({"prompt_logprobs": 3, "max_tokens": 16}, 422),
        ({"prompt_logprobs": 3, "logprobs": 2}, 422),
        ({"prompt_logprobs": 3, "model": "another-model"}, 404),
        ({"prompt_logprobs": 3, "cache": "../x"}, 422),
    ]:
        bad = client.post("/v1/completions", json={**body, **extra})
        assert bad.status_code == code, (extra, bad.text)
        assert bad.json()["error"]["message"]


def httpx_client(url: str):
    import httpx

    return httpx.Client(base_url=url, timeout=30.0)


CHATML = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_chat_job_stores_the_assistant_loss_mask(server, client, tiny) -> None:
    """A real chat job (issue #15): the stored row mask is 1 exactly on the rows predicting the
    assistant turns' tokens (content + end-of-turn), read back from the cache."""
    from server_support import wait_job
    from transformers import AutoTokenizer

    turns = [
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "what is two plus two"},
            {"role": "assistant", "content": "four"},
            {"role": "user", "content": "and three"},
            {"role": "assistant", "content": "six, no five"},
        ],
        [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi there"}],
    ]
    body = {
        "cache": "chat-mask",
        "records": [{"id": f"c{i}", "messages": m} for i, m in enumerate(turns)]
        + [{"id": "plain", "text": "a plain text record"}],
        "chat_template": CHATML,
        "loss_mask": True,
    }
    r = client.post("/v1/jobs", json=body)
    assert r.status_code == 201, r.text
    assert wait_job(client, r.json()["id"], timeout=120)["state"] == "succeeded"
    reader = server.services.caches.reader("chat-mask")
    assert reader.manifest.loss_mask
    tok = AutoTokenizer.from_pretrained(tiny.teacher_dir)
    for i, msgs in enumerate(turns):
        rec = reader.get(f"c{i}")
        ids, mask = rec.input_ids.tolist(), rec.loss_mask
        assert mask.shape == (len(ids) - 1,) and set(mask.tolist()) == {0, 1}
        runs, run = [], []
        for j, m in enumerate(mask.tolist()):  # row j predicts token j + 1
            if m:
                run.append(ids[j + 1])
            elif run:
                runs.append(run)
                run = []
        runs += [run] if run else []
        want = [m["content"] + "<|end|>\n" for m in msgs if m["role"] == "assistant"]
        assert [tok.decode(x) for x in runs] == want
    assert reader.get("plain").loss_mask.all()  # a text record of a mask job: every row
    # a trainer reading over HTTP gets the mask folded into the batch's loss_mask (labels keep
    # the tokens)
    from logitcache.client import CacheDataset

    c0 = reader.get("c0")
    ds = CacheDataset(
        open_source(server.url, cache="chat-mask", api_key=API_KEY),
        StreamConfig(tokens_per_item=128, mode="pad", shuffle=False),
    )
    item = next(i for i in ds if i["input_ids"][: c0.length].tolist() == c0.input_ids.tolist())
    n = c0.length - 1
    assert item["loss_mask"][:n].tolist() == c0.loss_mask.astype(bool).tolist()
    assert item["labels"][:n].tolist() == c0.input_ids[1:].tolist()
    # an existing cache without a mask refuses a loss_mask job (nothing written)
    client.post("/v1/score", json={"input_ids": [[1, 2, 3]], "cache": "no-mask"})
    r = client.post("/v1/jobs", json={**body, "cache": "no-mask"})
    assert r.status_code == 409 and "loss mask" in r.json()["error"]["message"]
