"""A request's teacher temperature on every route (fast tier: in-process app, fake engine).

The fake engine's rows are the top-k of ``fake_logprobs(ids, V, T)`` (``log_softmax(z / T)`` of
its closed-form logits) at the temperature the engine is called with, so each answer is compared
with the exact distribution at the asked temperature. Caches: a named cache made at another
temperature is a 409 that writes nothing; the protocol routes' default caches are one per
temperature (``openai-completions`` at the server's, ``openai-completions-t0.7`` at 0.7), so a
trainer at any temperature is served from a cache and none answers another's. The real engines
at ``T = 0.7`` and ``2`` are tested against a transformers forward in
``tests/engine/test_engine_temperature.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from asgi_support import LiveApp
from engine_support import FakeEngine, app_settings, fake_logprobs
from server_support import eventually

pytestmark = pytest.mark.fast

JSON = {"content-type": "application/json"}
SEQS = [[5, 9, 2, 7, 11, 3], [4, 4, 8, 1, 17]]
K = 5


class App(LiveApp):
    def __init__(self, root: Path) -> None:
        self.root = root
        self.engine = FakeEngine()
        super().__init__(app_settings(root, k=K), self.engine)

    def post(self, target: str, body: Any) -> tuple[int, Any]:
        status, _, data = self.request("POST", target, JSON, json.dumps(body).encode())
        return status, json.loads(data)

    def cache_temperature(self, name: str) -> float:
        status, _, data = self.request("GET", f"/v1/caches/{name}", {}, b"")
        assert status == 200, data
        return float(json.loads(data)["manifest"]["temperature"])

    def caches(self) -> list[str]:
        return sorted(p.name for p in (self.root / "caches").iterdir())

    def stored(self, *names: str) -> bool:
        """Whether the cache folders are ``names`` and each holds its first commit (a folder
        appears when its writer opens, before the commit that a route runs behind its
        answer)."""
        ok = self.caches() == sorted(names)
        return ok and all(self.request("GET", f"/v1/caches/{n}", {}, b"")[0] == 200 for n in names)


@pytest.fixture
def app(tmp_path: Path) -> Iterator[App]:
    a = App(tmp_path)
    yield a
    a.close()


def exact(ids: list[int], t: float, k: int = K) -> tuple[np.ndarray, np.ndarray]:
    lp = fake_logprobs(ids, 300, t)
    top = np.argsort(-lp, axis=1, kind="stable")[:, :k]
    return top, np.take_along_axis(lp, top, axis=1)


def test_score_applies_the_temperature_and_a_cache_keeps_its_own(app: App) -> None:
    status, body = app.post("/v1/score", {"input_ids": SEQS, "temperature": 0.7})
    assert status == 200, body
    assert app.engine.temperatures == [0.7]
    for ids, seq in zip(SEQS, body["sequences"], strict=True):
        want_ids, want_lp = exact(ids, 0.7)
        assert seq["topk_ids"] == want_ids.tolist()
        np.testing.assert_allclose(seq["topk_logprobs"], want_lp, atol=1e-6)
    # a cache made at 2.0; a repeat without temperature is answered from it (its own T)
    status, first = app.post("/v1/score", {"input_ids": SEQS, "cache": "hot", "temperature": 2.0})
    assert status == 200 and first["stored"] == 2, first
    assert app.cache_temperature("hot") == 2.0
    status, again = app.post("/v1/score", {"input_ids": SEQS, "cache": "hot"})
    assert status == 200 and again["hits"] == 2, again
    assert again["sequences"][0]["topk_logprobs"] == first["sequences"][0]["topk_logprobs"]
    np.testing.assert_allclose(again["sequences"][0]["topk_logprobs"], exact(SEQS[0], 2.0)[1], 1e-6)
    calls = list(app.engine.temperatures)
    # another temperature than the cache's: 409 naming it, no engine work, nothing stored
    for t in (1.0, 0.7):
        status, err = app.post(
            "/v1/score", {"input_ids": [[1, 2, 3]], "cache": "hot", "temperature": t}
        )
        assert status == 409, err
        assert err["error"]["code"] == "conflict" and "temperature" in err["error"]["detail"]
    # a k above the cache's: scored at the cache's temperature, not stored
    status, above = app.post("/v1/score", {"input_ids": SEQS, "cache": "hot", "k": K + 3})
    assert status == 200 and above["stored"] == 0, above
    np.testing.assert_allclose(
        above["sequences"][1]["topk_logprobs"], exact(SEQS[1], 2.0, K + 3)[1], atol=1e-6
    )
    assert app.engine.temperatures == [*calls, 2.0]


def top_k(row: dict[str, Any]) -> dict[str, Any]:
    """A ``/v1/completions`` position's top-K entries by rank (without vLLM's added actual
    token when it is outside them)."""
    return dict(
        sorted(((t, v) for t, v in row.items() if v["rank"] <= K), key=lambda e: e[1]["rank"])
    )


def test_completions_temperature_has_a_default_cache_of_its_own(app: App) -> None:
    def complete(**over: Any) -> tuple[int, Any]:
        return app.post(
            "/v1/completions", {"prompt": SEQS, "prompt_logprobs": K, "max_tokens": 0, **over}
        )

    status, hot = complete(temperature=0.7)  # what TRL's VLLMClient sends
    assert status == 200, hot
    eventually(lambda: app.stored("openai-completions-t0.7"))  # stored behind the answer
    assert app.cache_temperature("openai-completions-t0.7") == 0.7
    for ids, choice in zip(SEQS, hot["choices"], strict=True):
        want_ids, want_lp = exact(ids, 0.7)
        rows = [top_k(row) for row in choice["prompt_logprobs"][1:]]
        assert [[int(t) for t in row] for row in rows] == want_ids.tolist()
        got = [[v["logprob"] for v in row.values()] for row in rows]
        np.testing.assert_allclose(got, want_lp, atol=1e-6)
    status, plain = complete()  # no temperature: the server's (1.0), its own cache
    assert status == 200
    eventually(lambda: app.stored("openai-completions", "openai-completions-t0.7"))
    assert app.cache_temperature("openai-completions") == 1.0
    np.testing.assert_allclose(
        [v["logprob"] for v in top_k(plain["choices"][0]["prompt_logprobs"][1]).values()],
        exact(SEQS[0], 1.0)[1][0],
        atol=1e-6,
    )
    calls = len(app.engine.temperatures)
    status, again = complete(temperature=0.7)
    assert status == 200 and [c["cached"] for c in again["choices"]] == [True, True]
    assert len(app.engine.temperatures) == calls  # no engine work
    status, err = complete(temperature=0.7, cache="openai-completions")
    assert status == 409 and "temperature" in err["error"]["detail"], err
    status, err = complete(temperature=0.0)
    assert status == 422 and "temperature" in json.dumps(err), err
    assert len(app.engine.temperatures) == calls


def test_generate_sampling_params_temperature(app: App) -> None:
    body = {
        "input_ids": SEQS[0],
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
        "sampling_params": {"max_new_tokens": 0, "temperature": 2.0},
    }
    status, out = app.post("/generate", body)
    assert status == 200, out
    eventually(lambda: app.stored("sglang-generate-t2.0"))
    want_ids, want_lp = exact(SEQS[0], 2.0)
    tops = out["meta_info"]["input_top_logprobs"][1:]
    assert [[e[1] for e in row] for row in tops] == want_ids[:, :3].tolist()
    np.testing.assert_allclose([[e[0] for e in row] for row in tops], want_lp[:, :3], atol=1e-6)
    for bad in (0.0, -1.0, "hot", 1e9):
        status, err = app.post(
            "/generate", {**body, "sampling_params": {"max_new_tokens": 0, "temperature": bad}}
        )
        assert status == 422 and "temperature" in err["error"]["message"], err
    assert app.engine.temperatures == [2.0]
