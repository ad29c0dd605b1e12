"""SGLang-compatible ``POST /generate`` on the real transformers engine and the tiny teacher,
over real HTTP (uvicorn in a thread), against a plain transformers forward.

Shapes per SGLang 0.5.x ``GenerateReqInput`` (``python/sglang/srt/managers/io_struct.py``) and
its ``meta_info.input_token_logprobs`` / ``input_top_logprobs`` (``[logprob, token_id, text]``).
The first request is a miss (scored, stored), the second a hit (no engine work: the engine's own
token counter), both equal to the reference within the cache's quantisation step.
"""

from __future__ import annotations

import pytest
from server_support import ThreadedServer, server_settings

TOP = 5


def _reference(tiny, seq: list[int]):  # noqa: ANN001, ANN202
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny.teacher_dir), torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # row t predicts token t + 1


def test_generate_matches_a_transformers_forward(hf_engine, tiny, heldout_sequences, tmp_path):  # noqa: ANN001
    seq = heldout_sequences[0][:40]
    settings = server_settings(tmp_path, str(tiny.teacher_dir), k=8)
    body = {
        "input_ids": seq,
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": TOP,
        "return_text_in_logprobs": True,
        "sampling_params": {"max_new_tokens": 0},
    }
    with ThreadedServer(settings, hf_engine) as srv, srv.client() as c:
        first = c.post("/generate", json=body)
        assert first.status_code == 200, first.text
        second = c.post("/generate", json=body).json()
        short = seq[:2]  # logprobs at chosen ids (here the reference's 3rd and 1st best)
        asked = _reference(tiny, short)[0].topk(3).indices.tolist()[::-2]
        chosen = c.post("/generate", json={**body, "input_ids": short, "token_ids_logprob": asked})
        assert chosen.status_code == 200, chosen.text
    a = first.json()
    assert a["meta_info"]["cached"] is False and second["meta_info"]["cached"] is True
    assert second["meta_info"]["input_top_logprobs"] == a["meta_info"]["input_top_logprobs"]
    ref = _reference(tiny, seq)
    tok, top = a["meta_info"]["input_token_logprobs"], a["meta_info"]["input_top_logprobs"]
    assert len(tok) == len(top) == len(seq) and tok[0][0] is None and top[0] is None
    at = chosen.json()["meta_info"]["input_token_ids_logprobs"][1]
    assert [e[1] for e in at] == asked
    assert [e[0] for e in at] == pytest.approx(ref[0][asked].tolist(), abs=2e-2)
    tokenizer = tiny.load_tokenizer()
    for t in range(1, len(seq)):
        want_lp, want_ids = ref[t - 1].topk(TOP)
        got_ids = [e[1] for e in top[t]]
        assert got_ids == want_ids.tolist(), t
        assert [e[0] for e in top[t]] == pytest.approx(want_lp.tolist(), abs=2e-2)
        assert top[t][0][2] == tokenizer.decode([got_ids[0]])
        # the actual token: from the cached top-k or the cache's actual_logprob (FORMAT.md 4.12)
        assert tok[t][0] == pytest.approx(float(ref[t - 1][seq[t]]), abs=2e-2)


def test_token_ids_logprob_outside_the_cached_top_k_is_exact(
    hf_engine, tiny, heldout_sequences, tmp_path
):  # noqa: ANN001
    """``token_ids_logprob`` with ids outside the cached top-k (here mostly far outside), at
    T = 0.7 and 2: exact ``log_softmax(z / T)`` of a plain transformers forward at those ids,
    for a cached sequence and a new one alike (no 422, no estimate)."""
    import numpy as np
    from engine_support import full_forward_logprobs

    seqs = [heldout_sequences[1][:30], heldout_sequences[2][:25]]
    settings = server_settings(tmp_path, str(tiny.teacher_dir), k=8)
    rng = np.random.default_rng(3)
    asked = rng.choice(tiny.vocab_size, size=6, replace=False).tolist()
    for t in (0.7, 2.0):
        body = {
            "input_ids": seqs,
            "return_logprob": True,
            "logprob_start_len": 0,
            "token_ids_logprob": asked,
            "sampling_params": {"max_new_tokens": 0, "temperature": t},
        }
        with ThreadedServer(settings, hf_engine) as srv, srv.client() as c:
            warm = {**body, "input_ids": seqs[:1], "token_ids_logprob": None}
            assert c.post("/generate", json=warm).status_code == 200  # seqs[0] cached
            r = c.post("/generate", json=body)
            assert r.status_code == 200, r.text
        out = r.json()
        assert [o["meta_info"]["cached"] for o in out] == [True, False]
        for o, seq in zip(out, seqs, strict=True):
            assert o["meta_info"]["exact_token_ids"] is True
            ref = full_forward_logprobs(str(tiny.teacher_dir), seq, temperature=t)
            at = o["meta_info"]["input_token_ids_logprobs"]
            assert at[0] is None and len(at) == len(seq)
            got = np.array([[e[0] for e in row] for row in at[1:]])
            assert [e[1] for e in at[1]] == asked
            np.testing.assert_allclose(got, ref[: len(seq) - 1][:, asked], atol=2e-4)
