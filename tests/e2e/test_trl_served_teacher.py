"""TRL's served-teacher client against this server (issue #17): ``trl.generation.vllm_client.
VLLMClient.get_sequence_logprobs`` is what TRL's distillation trainers call on a ``vllm serve``
teacher (``POST /v1/completions`` with token-id prompts, ``max_tokens: 1``,
``prompt_logprobs: k``). Pointed at this server it gets the cache's answers: the first call
scores and stores, the second is served with no engine work, and both equal ``/v1/score``; the
actual token's logprob (``actual_logprobs``, which TRL reads from the token's own entry, added by
vLLM to every position) is there at every position and equals a transformers forward.

Real parts: TRL 1.16's own client (``requests``), the suite's vLLM engine on the tiny teacher,
the app under real uvicorn (no API key: TRL's client sends none), real zarr caches.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from engine_support import full_forward_logprobs
from logitcache.server.metrics import scraped_total
from server_support import ThreadedServer, server_settings

pytestmark = pytest.mark.vllm

K = 5


@pytest.fixture(scope="module")
def server(vllm_engine, tiny, tmp_path_factory):
    work = tmp_path_factory.mktemp("trl-teacher")
    with ThreadedServer(server_settings(work, str(tiny.teacher_dir), k=8), vllm_engine) as srv:
        yield srv


def engine_tokens(client) -> float:
    text = client.get("/metrics").text
    return scraped_total(text, "logitcache_tokens_scored_total", source="score")


def test_trl_get_sequence_logprobs_is_served_from_the_cache(
    server, heldout_sequences, tiny
) -> None:
    # imported here, not at collection: TRL's generation package imports vLLM (~10 CPU-s),
    # which every pytest process would pay while collecting, the fast tier's included
    trl_client = pytest.importorskip("trl.generation.vllm_client")
    seqs = [list(s[:24]) for s in heldout_sequences if len(s) >= 24][:3]
    prompt_lengths = [6, 10, 12]
    teacher = trl_client.VLLMClient(base_url=server.url, connection_timeout=10)
    with server.client() as c:
        first = teacher.get_sequence_logprobs(seqs, prompt_lengths, top_logprobs=K)
        t0 = engine_tokens(c)
        again = teacher.get_sequence_logprobs(seqs, prompt_lengths, top_logprobs=K)
        assert engine_tokens(c) == t0, "the second epoch must be served from the cache"
        direct = c.post("/v1/score", json={"input_ids": seqs, "k": K}).json()["sequences"]
    assert again == first
    for b, (seq, p) in enumerate(zip(seqs, prompt_lengths, strict=True)):
        lp, ids = np.asarray(first["logprobs"][b]), first["logprob_token_ids"][b]
        assert lp.shape == (len(seq) - p, K)
        d = direct[b]  # row j predicts token j + 1: TRL's position p is row p - 1
        assert ids == d["topk_ids"][p - 1 :]
        np.testing.assert_allclose(lp, np.asarray(d["topk_logprobs"][p - 1 :]), atol=2e-2)
        ref = full_forward_logprobs(str(tiny.teacher_dir), seq)
        outside = 0
        for pos, (row_ids, actual) in enumerate(
            zip(ids, first["actual_logprobs"][b], strict=True), start=p
        ):
            assert actual[0] > -math.inf  # every position has it (FORMAT.md 4.12)
            np.testing.assert_allclose(actual[0], ref[pos - 1][seq[pos]], atol=2e-3)
            if seq[pos] in row_ids:  # its top-k entry (the cache's float16 value)
                assert actual[0] == lp[pos - p][row_ids.index(seq[pos])]
            else:
                outside += 1
                assert actual[0] <= lp[pos - p][-1] + 1e-2
        assert outside > 0
