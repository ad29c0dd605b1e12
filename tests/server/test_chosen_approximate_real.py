"""The approximate chosen-id mode on the tiny teacher (transformers engine): on a cache hit the
candidates in a row's top-k are the engine's exact logprobs (a plain transformers forward), the
others ``log(tail / (V - k))`` of the cached row, marked in ``approximated``."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
from engine_support import full_forward_logprobs, in_process
from server_support import server_settings

K = 8


def npy(text: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(text)))


def test_approximate_on_the_tiny_teacher(hf_engine, tiny, tmp_path, heldout_sequences) -> None:
    seq = list(heldout_sequences[3][:24])
    full = full_forward_logprobs(str(tiny.teacher_dir), seq)[:-1]
    order = np.argsort(-full, axis=1)
    rows = np.concatenate([order[:, :3], order[:, 50:52]], axis=1)  # 3 in the top-k, 2 not
    body = {
        "token_ids": seq,
        "sampling_params": {"max_tokens": 1, "prompt_logprob_token_ids": rows.tolist()},
        "cache": "approx",
        "approximate": True,
    }
    settings = server_settings(tmp_path, str(tiny.teacher_dir), k=K, logprob_dtype="float32")

    async def run() -> tuple[dict, dict, dict]:
        async with in_process(settings, hf_engine) as c:
            miss = (await c.post("/inference/v1/generate", json=body)).json()
            hit = (await c.post("/inference/v1/generate", json=body)).json()
            score = {"input_ids": [seq], "cache": "approx", "k": K}
            stored = (await c.post("/v1/score", json=score)).json()
            return miss, hit, stored

    miss, hit, stored = asyncio.run(run())
    assert miss["exact"] and miss["approximated"] is None
    np.testing.assert_allclose(
        npy(miss["prompt_token_id_logprobs"]), np.take_along_axis(full, rows, 1), atol=1e-4
    )
    assert hit["cached"] and not hit["exact"]
    mask = npy(hit["approximated"])
    assert not mask[:, :3].any() and mask[:, 3:].all()
    got = npy(hit["prompt_token_id_logprobs"])
    np.testing.assert_allclose(got[:, :3], np.take_along_axis(full, rows[:, :3], 1), atol=1e-4)
    tail = np.asarray(stored["sequences"][0]["tail_mass"], np.float64)
    spread = np.log(tail / (tiny.vocab_size - K))[:, None]
    np.testing.assert_allclose(got[:, 3:], np.broadcast_to(spread, got[:, 3:].shape), rtol=1e-5)
