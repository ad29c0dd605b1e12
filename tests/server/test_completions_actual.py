"""``/v1/completions`` answers each position's actual prompt token, as vLLM does (fast tier:
in-process app, fake engine whose distributions are known in closed form).

vLLM's shape (``vllm/v1/sample/sampler.py::Sampler.gather_logprobs``, vLLM 0.32: per position the
prompt token's logprob gathered from the same ``log_softmax``, with its rank, then the top-k; the
prompt-logprob dicts are built in that order, ``vllm/logprobs.py``): the actual token is the
first entry of each position's dict, with its rank in the cache's top-K row; outside it this
service answers rank ``K + 1``, a lower bound of vLLM's exact rank, and lists those positions in
``rank_lower_bound`` (hit and miss alike). Caches the service creates keep the
value (FORMAT.md 4.12), so a hit costs no engine work; a cache made without it scores the actual
tokens outside its top-k, or with ``approximate: true`` spreads the row's tail over them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from asgi_support import LiveApp
from engine_support import FakeEngine, app_settings, fake_logprobs
from logitcache.cache_format import CacheReader, StoreNotFoundError
from server_support import eventually

pytestmark = pytest.mark.fast

JSON = {"content-type": "application/json"}
SEQS = [[5, 9, 2, 7, 11, 3, 40, 41], [4, 4, 8, 1, 17, 250]]
K, V = 5, 300


class App(LiveApp):
    def __init__(self, root: Path, **settings: Any) -> None:
        self.root = root
        self.engine = FakeEngine()
        super().__init__(app_settings(root, k=K, **settings), self.engine)

    def complete(self, **over: Any) -> dict[str, Any]:
        body = {"prompt": SEQS, "prompt_logprobs": K, "max_tokens": 1, **over}
        status, _, data = self.request("POST", "/v1/completions", JSON, json.dumps(body).encode())
        assert status == 200, data
        return json.loads(data)

    def work(self) -> tuple[int, int]:
        return len(self.engine.calls), len(self.engine.id_calls)


def committed(url: Path) -> int:
    """Sequences committed to the cache at ``url`` (-1: not created yet)."""
    try:
        return CacheReader(url).num_sequences
    except StoreNotFoundError:
        return -1


def actual_of(choice: dict[str, Any], seq: list[int]) -> tuple[np.ndarray, list[int]]:
    """The actual tokens' logprobs and ranks of one choice (checking each is first)."""
    rows = choice["prompt_logprobs"][1:]
    assert [next(iter(r)) for r in rows] == [str(t) for t in seq[1:]]
    got = [r[str(t)] for r, t in zip(rows, seq[1:], strict=True)]
    return np.array([v["logprob"] for v in got]), [v["rank"] for v in got]


def want_ranks(seq: list[int]) -> list[int]:
    lp = fake_logprobs(seq, V, 1.0)
    top = np.argsort(-lp, axis=1, kind="stable")[:, :K]
    return [
        int(np.flatnonzero(row == t)[0]) + 1 if t in row else K + 1
        for row, t in zip(top, seq[1:], strict=True)
    ]


def exact_actual(seq: list[int]) -> np.ndarray:
    return fake_logprobs(seq, V, 1.0)[np.arange(len(seq) - 1), seq[1:]]


def test_new_cache_keeps_the_actual_token_and_a_hit_costs_no_engine_work(tmp_path) -> None:
    app = App(tmp_path)
    try:
        first = app.complete()
        work = app.work()
        again = app.complete()
        assert app.work() == work, "a hit must not reach the engine"
        assert [c["cached"] for c in again["choices"]] == [True, True]
        outside = 0
        for seq, a, b in zip(SEQS, first["choices"], again["choices"], strict=True):
            assert a["prompt_logprobs"] == b["prompt_logprobs"]
            got, ranks = actual_of(b, seq)
            np.testing.assert_allclose(got, exact_actual(seq), atol=1e-6)
            assert ranks == want_ranks(seq)
            outside += ranks.count(K + 1)
            bound = [t + 1 for t, r in enumerate(ranks) if r == K + 1]
            assert a["rank_lower_bound"] == b["rank_lower_bound"] == bound
            exact = (fake_logprobs(seq, V, 1.0) > exact_actual(seq)[:, None]).sum(axis=1) + 1
            assert all(exact[t - 1] > K for t in bound)  # K + 1 <= the exact rank there
            assert "approximated" not in b
        assert outside >= 3  # the tokens vLLM adds an entry for are exercised
        narrow = app.complete(prompt_logprobs=2)  # below the cache's k: ranks from its rows
        assert app.work() == work
        for seq, c in zip(SEQS, narrow["choices"], strict=True):
            got, ranks = actual_of(c, seq)
            assert ranks == want_ranks(seq)  # e.g. 4: beyond the 2 asked, within the cache's 5
            assert c["rank_lower_bound"] == [t + 1 for t, r in enumerate(ranks) if r == K + 1]
            np.testing.assert_allclose(got, exact_actual(seq), atol=1e-6)
            for row in c["prompt_logprobs"][1:]:
                assert sorted(v["rank"] for v in row.values() if v["rank"] <= 2) == [1, 2]
                assert len(row) in (2, 3)
        url = tmp_path / "caches" / "openai-completions"
        eventually(lambda: committed(url) == len(SEQS))  # behind the answers
        with CacheReader(url) as r:
            assert r.manifest.actual_logprob is True
            rec = r.sequence(0)
            want = exact_actual(list(rec.input_ids)).astype(np.float32)
            np.testing.assert_array_equal(rec.actual_logprob, want)  # as computed
    finally:
        app.close()


def test_cache_without_the_array_scores_or_spreads_the_missing_tokens(tmp_path) -> None:
    old = App(tmp_path, actual_logprob=False)  # a cache made without it (FORMAT.md 4.12)
    try:
        first = old.complete()  # misses: the engine's rows carry the actual tokens
        for seq, c in zip(SEQS, first["choices"], strict=True):
            np.testing.assert_allclose(actual_of(c, seq)[0], exact_actual(seq), atol=1e-6)
    finally:
        old.close()
    app = App(tmp_path)  # a server that keeps it, on the old cache: the cache keeps its flag
    try:
        calls, id_calls = app.work()
        hit = app.complete()
        assert [c["cached"] for c in hit["choices"]] == [True, True]
        assert app.work() == (calls, id_calls + 1)  # the missing tokens scored, once
        for seq, c in zip(SEQS, hit["choices"], strict=True):
            got, ranks = actual_of(c, seq)
            np.testing.assert_allclose(got, exact_actual(seq), atol=1e-6)
            assert ranks == want_ranks(seq)
        spread = app.complete(approximate=True)
        assert app.work() == (calls, id_calls + 1)  # no engine work
        for seq, c in zip(SEQS, spread["choices"], strict=True):
            got, ranks = actual_of(c, seq)
            outside = [t + 1 for t, r in enumerate(ranks) if r == K + 1]
            assert c["approximated"] == outside and outside
            lp = fake_logprobs(seq, V, 1.0)
            top = np.sort(lp, axis=1)[:, ::-1][:, :K]
            tail = 1.0 - np.exp(top.astype(np.float64)).sum(axis=1)
            want = np.where(np.array(ranks) > K, np.log(tail / (V - K)), exact_actual(seq))
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        new = app.complete(prompt=[[7, 7, 3, 9, 2]])  # a miss into the old cache is stored
        assert new["choices"][0]["cached"] is False
        url = tmp_path / "caches" / "openai-completions"
        eventually(lambda: committed(url) == 3)  # stored behind the answer
        with CacheReader(url) as r:
            assert r.manifest.actual_logprob is False
    finally:
        app.close()
