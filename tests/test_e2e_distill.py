"""The README's main job end to end: ``examples/distill.py --quick`` as a real subprocess.

It starts the real teacher service (uvicorn + vLLM on the tiny teacher) on 127.0.0.1, scores a
small corpus with a batch job over HTTP, and trains the student from the cache with
``CacheDataset`` + the fused chunked loss. The test checks the cache itself (valid, the teacher's
own distribution, the tokenizer's fingerprint), that training reduced the loss, and that the
distilled student is closer to the teacher on held-out text than the untrained one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def quick_run(tiny: Any, vllm_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("distill")
    cmd = [sys.executable, str(ROOT / "examples/distill.py"), "--quick", "--workdir", str(work)]
    proc = subprocess.run(
        cmd,
        env={**os.environ, **vllm_env},
        capture_output=True,
        text=True,
        timeout=420,
        check=False,
    )
    log = (work / "service" / "server.log").read_text() if (work / "service").exists() else ""
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{log[-2000:]}"
    return json.loads((work / "distill.json").read_text())


def test_job_wrote_a_valid_cache_of_the_teacher(quick_run: dict[str, Any], tiny: Any) -> None:
    import torch
    from logitcache.cache_format import CacheReader, tokenizer_fingerprint, validate
    from transformers import LlamaForCausalLM

    cache = quick_run["cache"]
    assert quick_run["job"]["state"] == "succeeded"
    report = validate(cache["url"])
    assert report.ok, str(report)
    reader = CacheReader(cache["url"])
    assert reader.num_sequences == quick_run["plan"]["train_seqs"] == 200
    assert reader.manifest.k == 64 and reader.manifest.vocab_size == tiny.vocab_size
    assert reader.manifest.tokenizer_fingerprint == tokenizer_fingerprint(tiny.load_tokenizer())
    # the cached rows are the teacher's distribution of the next token (DESIGN.md alignment)
    rec = reader.sequence(0)
    teacher = LlamaForCausalLM.from_pretrained(str(tiny.teacher_dir)).float().eval()
    with torch.no_grad():
        ids = torch.as_tensor(rec.input_ids, dtype=torch.long)[None]
        lp = torch.log_softmax(teacher(input_ids=ids).logits[0, :-1].float(), -1).numpy()
    want = np.take_along_axis(lp, rec.topk_ids.astype(np.int64), axis=1)
    np.testing.assert_allclose(rec.topk_logprobs, want, atol=2e-2, rtol=1e-2)
    assert (rec.topk_ids[:, 0] == lp.argmax(-1)).mean() >= 0.95


def test_distillation_reduced_the_loss(quick_run: dict[str, Any]) -> None:
    run = quick_run["methods"]["offline_topk_tail"]
    curve = np.array(run["loss_curve"])
    assert len(curve) == quick_run["train"]["steps"] == 40
    assert np.isfinite(curve).all()
    assert curve[-5:].mean() < 0.8 * curve[:5].mean()
    assert run["rows_trained"] > 0


def test_distilled_student_is_closer_to_the_teacher(quick_run: dict[str, Any]) -> None:
    before, after = quick_run["untrained"], quick_run["methods"]["offline_topk_tail"]
    assert after["kl"] < 0.9 * before["kl"]
    assert after["ppl"] < before["ppl"]
    assert quick_run["heldout"]["positions"] >= 1000
