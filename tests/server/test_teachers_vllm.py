"""Two teachers on vLLM's in-process engine (the default backend) behind one real service, with
room for one engine: the second teacher's engine is built in a worker thread while the service
runs, the first is closed for it and built again when asked for, and each answers the exact
logprobs at chosen ids (``/inference/v1/generate``) that a plain transformers forward gives."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from engine_support import full_forward_logprobs
from server_support import ThreadedServer, server_settings

pytestmark = pytest.mark.vllm


def test_vllm_teachers_load_unload_and_answer_exactly(tiny, vllm_env, tmp_path, heldout_sequences):
    from logitcache.server.serving.teachers import weights_bytes

    other = tmp_path / "tiny-b"
    other.mkdir()
    for f in tiny.teacher_dir.iterdir():
        (other / f.name).symlink_to(f)
    teachers = [
        {"name": "tiny-a", "model": str(tiny.teacher_dir)},
        {"name": "tiny-b", "model": str(other)},
    ]
    settings = server_settings(
        tmp_path,
        "",
        backend="vllm",
        engine_options={"vllm_mode": "inproc"},
        teachers=teachers,
        teacher_memory_bytes=weights_bytes(str(tiny.teacher_dir)),
        max_seq_len=128,
    )
    seq = list(heldout_sequences[2][:16])
    rows = [[3, 7, 11, 40]] * (len(seq) - 1)
    ref = full_forward_logprobs(str(tiny.teacher_dir), seq)[:-1]
    want = np.take_along_axis(ref, np.array(rows), axis=1)
    with ThreadedServer(settings, None) as srv, srv.client() as c:
        for model in ("tiny-b", "tiny-a", "tiny-b"):
            body = {
                "model": model,
                "token_ids": seq,
                "sampling_params": {"max_tokens": 1, "prompt_logprob_token_ids": rows},
            }
            r = c.post("/inference/v1/generate", json=body)
            assert r.status_code == 200, r.text
            got = np.load(io.BytesIO(base64.b64decode(r.json()["prompt_token_id_logprobs"])))
            np.testing.assert_allclose(got, want, atol=1e-3)
            health = c.get("/health").json()
            loaded = [t["name"] for t in health["teachers"] if t["state"] == "loaded"]
            assert loaded == [model]
        loads = {t["name"]: t["loads"] for t in health["teachers"]}
        assert loads == {"tiny-a": 2, "tiny-b": 2}
