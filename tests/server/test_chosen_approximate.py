"""The approximate chosen-id mode (``/inference/v1/generate`` with ``approximate: true``, a
logitcache extension), fast tier (fake engine): on a cache hit an asked id outside its row's
top-k is answered ``log(tail / (V - k))`` from the row's tail mass with no engine call and is
marked in ``approximated``; ids in the top-k stay exact; a miss (scored with its ids in the same
engine call) and a request that does not ask are exact."""

from __future__ import annotations

import asyncio
import base64
import io
from typing import Any

import numpy as np
import pytest
from engine_support import FakeEngine, app_settings, fake_logprobs, in_process

pytestmark = pytest.mark.fast

V, K = 300, 20
SEQ = [1, 40, 7, 99, 12, 250, 33, 8]


def npy(text: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(text)))


def test_approximate_spreads_the_tail_on_a_hit_and_says_where(tmp_path) -> None:
    asyncio.run(_approximate(tmp_path))


async def _approximate(tmp_path: Any) -> None:
    engine = FakeEngine(vocab_size=V, max_k=K)
    full = fake_logprobs(SEQ, V)
    top = np.argsort(-full, axis=1)[:, :K]
    far = np.argsort(-full, axis=1)[:, -3:]  # far outside every row's top-k
    rows = np.concatenate([top[:, :2], far], axis=1)  # 2 in the top-k, 3 outside, per row
    body = {
        "token_ids": SEQ,
        "sampling_params": {"max_tokens": 1, "prompt_logprob_token_ids": rows.tolist()},
        "cache": "approx",
        "approximate": True,
    }
    async with in_process(app_settings(tmp_path, k=K), engine) as c:
        miss = (await c.post("/inference/v1/generate", json=body)).json()
        assert miss["cached"] is False and miss["exact"] is True
        assert miss["approximated"] is None  # scored with its ids: exact throughout
        calls = len(engine.id_calls) + len(engine.calls)
        hit = (await c.post("/inference/v1/generate", json=body)).json()
        assert hit["cached"] is True and hit["exact"] is False
        assert len(engine.id_calls) + len(engine.calls) == calls  # no engine work
        mask = npy(hit["approximated"])
        assert mask.dtype == bool and mask.shape == rows.shape
        assert not mask[:, :2].any() and mask[:, 2:].all()
        got = npy(hit["prompt_token_id_logprobs"])
        stored = (await c.post("/v1/score", json={"input_ids": [SEQ], "cache": "approx"})).json()
        tail = np.asarray(stored["sequences"][0]["tail_mass"], np.float64)
        want_far = np.log(tail / (V - K))[:, None]
        np.testing.assert_allclose(got[:, 2:], np.broadcast_to(want_far, (len(SEQ) - 1, 3)), 1e-6)
        exact = np.take_along_axis(full, rows, axis=1)
        np.testing.assert_allclose(got[:, :2], exact[:, :2], atol=1e-6)
        assert (got[:, 2:] > exact[:, 2:]).all()  # the spread tail is above the far ids' mass
        plain = (await c.post("/inference/v1/generate", json={**body, "approximate": False})).json()
        assert plain["exact"] is True and plain["approximated"] is None
        np.testing.assert_allclose(npy(plain["prompt_token_id_logprobs"]), exact, atol=1e-5)
        assert len(engine.id_calls) > 0 and len(engine.id_calls) + len(engine.calls) > calls


def test_sglang_generate_approximate_lists_the_spread_ids(tmp_path) -> None:
    asyncio.run(_sglang(tmp_path))


async def _sglang(tmp_path: Any) -> None:
    from logitcache.protocol import SglangMetaInfo

    engine = FakeEngine(vocab_size=V, max_k=K)
    full = fake_logprobs(SEQ, V)
    inside = int(np.argsort(-full[0])[0])  # row 0's best id: in its top-k
    far = int(np.argsort(-full[0])[-1])  # row 0's worst: outside it
    body = {
        "input_ids": SEQ,
        "return_logprob": True,
        "logprob_start_len": 1,
        "token_ids_logprob": [inside, far],
        "sampling_params": {"max_new_tokens": 0},
        "cache": "approx-sglang",
        "approximate": True,
    }
    async with in_process(app_settings(tmp_path, k=K), engine) as c:
        miss = (await c.post("/generate", json=body)).json()["meta_info"]
        assert miss["exact_token_ids"] is True
        assert "approximated_token_ids" not in miss  # a miss: exact
        calls = len(engine.id_calls) + len(engine.calls)
        hit = SglangMetaInfo.model_validate(
            (await c.post("/generate", json=body)).json()["meta_info"]
        )
        assert len(engine.id_calls) + len(engine.calls) == calls
        assert hit.cached and hit.exact_token_ids is False
        spread = hit.approximated_token_ids
        assert spread is not None and spread[0] == [far]
        top = np.argsort(-full, axis=1)[:, :K]
        for t, ids in enumerate(spread):  # exactly the asked ids outside each row's top-k
            assert ids == [i for i in (inside, far) if i not in top[t]]
