"""Sampled targets (random-sampling KD): the estimator of cache_format/sampling.py and the
format's ``targets = "sampled"`` kind (FORMAT.md section 4.4)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from logitcache.cache_format import (
    CacheReader,
    CacheWriter,
    Manifest,
    ManifestError,
    ManifestMismatchError,
    SequenceRecord,
    validate,
)
from logitcache.cache_format.sampling import (
    PAD_LOGPROB,
    sample_rows,
    sampling_manifest,
    uniforms,
)
from sampling_support import V, teacher_rows


def test_rows_are_distinct_sorted_normalised_and_padded() -> None:
    lp = teacher_rows(32)
    ids, lw = sample_rows(lp, uniforms(7, "seq", 32, 16))
    assert ids.shape == lw.shape == (32, 16) and ids.dtype == np.int32
    for row_ids, row_lw in zip(ids, lw, strict=True):
        assert len(set(row_ids.tolist())) == 16
        assert (np.diff(row_lw) <= 0).all()
        tie = row_lw[1:] == row_lw[:-1]
        assert (row_ids[1:][tie] > row_ids[:-1][tie]).all()  # equal weights: ascending ids
        real = row_lw > PAD_LOGPROB
        assert np.isclose(np.exp(row_lw[real]).sum(), 1.0, atol=1e-6)
        # tau = 1: every weight is count / N, a multiple of 1/16
        counts = np.exp(row_lw[real]) * 16
        np.testing.assert_allclose(counts, np.round(counts), atol=1e-6)
        # padding: the smallest ids not drawn, ascending
        pad = row_ids[~real].tolist()
        assert pad == sorted(set(range(V)) - set(row_ids[real].tolist()))[: len(pad)]


def test_weights_are_unbiased_at_tau_one() -> None:
    lp = teacher_rows(1, seed=3)
    p = lp.exp()[0].numpy()
    mean = np.zeros(V)
    trials = 2000
    # one call: the same row 2000 times, each with the uniforms of its own seed
    u = torch.cat([uniforms(t, "row", 1, 8) for t in range(trials)])
    ids, lw = sample_rows(lp.expand(trials, V), u)
    np.add.at(mean, ids.ravel(), (np.exp(lw) * (lw > PAD_LOGPROB)).ravel())
    mean /= trials
    # E[w_i] = p_i; the standard error of a mean of w (values k/8) is <= sqrt(p/8/trials)
    se = np.sqrt(p * (1 - p) / 8 / trials)
    assert np.all(np.abs(mean - p) <= 5 * se + 1e-4)


def test_proposal_temperature_gives_importance_weights() -> None:
    lp = teacher_rows(4, seed=5)
    tau = 2.0
    u = uniforms(1, "x", 4, 32)
    ids, lw = sample_rows(lp, u, proposal_temperature=tau)
    lq = torch.log_softmax(lp / tau, -1)
    cdf = lq.double().exp().cumsum(-1)
    cdf = cdf / cdf[:, -1:]
    draws = torch.searchsorted(cdf, u, right=True).numpy()
    for r in range(4):
        c = np.bincount(draws[r], minlength=V).astype(float)
        w = c * np.exp(lp[r].double().numpy() - lq[r].double().numpy())
        w /= w.sum()
        got = np.zeros(V)
        real = lw[r] > PAD_LOGPROB
        got[ids[r][real]] = np.exp(lw[r][real])
        np.testing.assert_allclose(got, w, atol=1e-6)


def test_targets_depend_on_seed_and_key_only() -> None:
    lp = teacher_rows(40)
    a = sample_rows(lp, uniforms(1, "k", 40, 12))
    b = sample_rows(lp, uniforms(1, "k", 40, 12))
    assert all((x == y).all() for x, y in zip(a, b, strict=True))
    # chunked (the engine's lm-head pass): the same rows from slices of the same uniforms
    u = uniforms(1, "k", 40, 12)
    parts = [sample_rows(lp[s : s + 7], u[s : s + 7]) for s in range(0, 40, 7)]
    assert (np.concatenate([p[0] for p in parts]) == a[0]).all()
    assert (np.concatenate([p[1] for p in parts]) == a[1]).all()
    other_key = sample_rows(lp, uniforms(1, "k2", 40, 12))
    other_seed = sample_rows(lp, uniforms(2, "k", 40, 12))
    assert not (other_key[0] == a[0]).all() and not (other_seed[0] == a[0]).all()


def test_bad_arguments_raise() -> None:
    lp = teacher_rows(2)
    with pytest.raises(ValueError, match="proposal_temperature"):
        sample_rows(lp, uniforms(0, "k", 2, 4), proposal_temperature=0.0)
    with pytest.raises(ValueError, match="distinct draws"):
        sample_rows(teacher_rows(2, scale=0.01), uniforms(0, "k", 2, 40), k=2)


def sampled_manifest(**over) -> Manifest:
    doc = {
        "teacher_model": "t",
        "tokenizer_fingerprint": "sha256:x",
        "vocab_size": V,
        "k": 16,
        "targets": "sampled",
        "sampling": sampling_manifest(16, 1.0, 7),
    }
    return Manifest(**{**doc, **over})


def test_sampled_cache_round_trips_and_validates(tmp_path: Path) -> None:
    url = str(tmp_path / "c")
    recs = []
    for i in range(3):
        inp = np.arange(10 + i) % V
        key = f"s{i}"
        lp = teacher_rows(len(inp) - 1, seed=i)
        ids, lw = sample_rows(lp, uniforms(7, key, len(inp) - 1, 16))
        recs.append(SequenceRecord(key, inp, ids, lw))
    with CacheWriter.open(url, sampled_manifest()) as w:
        w.append(recs)
    reader = CacheReader(url)
    assert reader.manifest.targets == "sampled"
    assert reader.manifest.sampling == sampling_manifest(16, 1.0, 7)
    for rec in recs:
        got = reader.sequence(recs.index(rec))
        assert (got.topk_ids == rec.topk_ids).all()
        np.testing.assert_allclose(got.topk_logprobs, rec.topk_logprobs, rtol=2e-3)
        assert np.abs(np.exp(got.topk_logprobs.astype(np.float64)).sum(-1) - 1).max() < 2e-3
    assert validate(url).ok
    # a resuming writer with other sampling parameters is refused (identity fields)
    with pytest.raises(ManifestMismatchError, match="sampling"):
        CacheWriter.open(url, sampled_manifest(sampling=sampling_manifest(16, 1.0, 8)))


def test_manifest_rules_for_the_target_kind() -> None:
    topk = Manifest(teacher_model="t", tokenizer_fingerprint="f", vocab_size=V, k=4)
    assert "targets" not in topk.to_attrs() and "sampling" not in topk.to_attrs()
    attrs = sampled_manifest().to_attrs()
    assert attrs["targets"] == "sampled" and Manifest.from_attrs(attrs).sampling["draws"] == 16
    with pytest.raises(ManifestError, match="needs sampling"):
        Manifest.from_attrs({**attrs, "sampling": None})
    with pytest.raises(ManifestError, match="only allowed"):
        Manifest.from_attrs({**topk.to_attrs(), "sampling": sampling_manifest(4, 1.0, 0)})
    with pytest.raises(ManifestError, match="draws"):
        Manifest.from_attrs({**attrs, "sampling": {**attrs["sampling"], "draws": 0}})


def test_validate_flags_sampled_rows_whose_weights_do_not_sum_to_one(tmp_path: Path) -> None:
    url = str(tmp_path / "bad")
    lp = teacher_rows(9)
    ids, lw = sample_rows(lp, uniforms(7, "s", 9, 16))
    half = np.where(lw > PAD_LOGPROB, lw + np.log(0.5), lw)  # every weight halved
    with CacheWriter.open(url, sampled_manifest()) as w:
        w.append([SequenceRecord("s", np.arange(10) % V, ids, half)])
    report = validate(url)
    assert not report.ok and "sampled_weights" in report.codes()
    # the same rows in a top-k cache are fine (a top-k row may hold less than all the mass)
    url2 = str(tmp_path / "topk")
    with CacheWriter.open(url2, sampled_manifest(targets="topk", sampling=None)) as w:
        w.append([SequenceRecord("s", np.arange(10) % V, ids, half)])
    assert validate(url2).ok


def test_chunked_lm_head_pass_equals_the_full_block() -> None:
    from logitcache.server.engine.hf import sample_from_hidden

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(37, 16, generator=g), torch.randn(V, 16, generator=g)
    u = uniforms(3, "h", 37, 8)
    full = sample_rows(torch.log_softmax(hidden @ weight.T / 0.7, -1), u)
    for chunk in (1, 5, 64):
        got = sample_from_hidden(hidden, weight, u, temperature=0.7, chunk_rows=chunk)
        assert (got[0] == full[0]).all() and np.allclose(got[1], full[1], atol=1e-6)
    with pytest.raises(ValueError, match="chunk_rows"):
        sample_from_hidden(hidden, weight, u, chunk_rows=0)


class _Teacher(torch.nn.Module):
    """A deterministic stand-in with the Hugging Face call signature (``.logits``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(V, V)
        torch.nn.init.normal_(self.emb.weight, std=2.0, generator=torch.Generator().manual_seed(1))

    def forward(self, input_ids: torch.Tensor):  # noqa: ANN201 - HF-like output
        return type("Out", (), {"logits": self.emb(input_ids)})()


def test_sampled_cache_resumes_to_the_same_targets(tmp_path: Path) -> None:
    """A sampled cache built in two sittings (a killed producer resumed) equals one built at once:
    the draws depend on (seed, key, teacher row) only."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from distill_caches import sampled_caches

    src = str(tmp_path / "src")
    m = sampled_manifest(targets="topk", sampling=None, k=4)
    with CacheWriter.open(src, m) as w:
        w.append(
            [
                SequenceRecord(f"s{i}", (np.arange(12) * (i + 1)) % V, *top4(12 - 1, i))
                for i in range(6)
            ]
        )
    teacher = _Teacher()
    once = sampled_caches(src, {8: str(tmp_path / "once")}, teacher, seed=3)[8]
    twice = str(tmp_path / "twice")
    sampled_caches(src, {8: twice}, teacher, seed=3, limit=2)  # the first sitting stops early
    sampled_caches(src, {8: twice}, teacher, seed=3)  # resume: known keys skipped
    a, b = CacheReader(once), CacheReader(twice)
    assert a.num_sequences == b.num_sequences == 6
    for i in range(6):
        ra, rb = a.sequence(i), b.sequence(i)
        assert ra.key == rb.key and (ra.topk_ids == rb.topk_ids).all()
        assert (ra.topk_logprobs == rb.topk_logprobs).all()
    assert b.manifest.sampling == sampling_manifest(8, 1.0, 3)


def top4(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    lp = teacher_rows(rows, seed)
    v, i = lp.topk(4, -1)
    return i.numpy(), v.numpy()


# ------------------------------------------- the teacher service: engines, jobs, /v1/score


def _sampled(engine, seqs, keys, **params):  # noqa: ANN001, ANN202 - test helper
    from logitcache.server.engine import SampledTargets

    return asyncio.run(engine.score_sampled(seqs, keys, SampledTargets(**params)))


@pytest.mark.vllm
def test_engines_sample_the_teacher_distribution(vllm_engine, hf_engine, heldout_sequences):  # noqa: ANN001
    """vLLM (draws inside its worker) and transformers (chunked lm-head pass) give the same
    sampled rows for the same seed and keys; the weights are unbiased estimates of the engine's
    own probabilities; the same call again gives the same bytes, another seed other rows."""
    seqs = [s[:64] for s in heldout_sequences[:8] if len(s) >= 8]
    keys = [f"k{i}" for i in range(len(seqs))]
    n = 64
    got = _sampled(vllm_engine, seqs, keys, draws=n, seed=11)
    again = _sampled(vllm_engine, seqs, keys, draws=n, seed=11)
    other = _sampled(vllm_engine, seqs, keys, draws=n, seed=12)
    ref = _sampled(hf_engine, seqs, keys, draws=n, seed=11)
    top = asyncio.run(vllm_engine.score(seqs, 20))
    rows = sum(len(s) - 1 for s in seqs)
    same_hf = sum(
        int((a.topk_ids == b.topk_ids).all(1).sum()) for a, b in zip(got, ref, strict=True)
    )
    assert same_hf >= 0.95 * rows, (same_hf, rows)  # a draw on a CDF step may flip by rounding
    for a, b, c in zip(got, again, other, strict=True):
        assert (a.topk_ids == b.topk_ids).all() and (a.topk_logprobs == b.topk_logprobs).all()
        assert not (a.topk_ids == c.topk_ids).all()
    # statistics: E[w_i] = p_i, Var(w_i) = p_i (1 - p_i) / N (tau = 1: w = counts / N)
    diff1, var1, diff20, var20 = 0.0, 0.0, 0.0, 0.0
    for s, t in zip(got, top, strict=True):
        assert s.topk_ids.shape == (t.num_rows, n)
        w = np.exp(s.topk_logprobs.astype(np.float64)) * (s.topk_logprobs > PAD_LOGPROB)
        np.testing.assert_allclose(w.sum(1), 1.0, atol=1e-5)
        np.testing.assert_allclose(w * n, np.round(w * n), atol=1e-4)
        p = np.exp(t.topk_logprobs.astype(np.float64))
        for r in range(t.num_rows):
            wr = dict(zip(s.topk_ids[r].tolist(), w[r].tolist(), strict=True))
            w_top = np.array([wr.get(i, 0.0) for i in t.topk_ids[r].tolist()])
            diff1 += w_top[0] - p[r, 0]
            var1 += p[r, 0] * (1 - p[r, 0]) / n
            m = p[r].sum()
            diff20 += w_top.sum() - m
            var20 += m * (1 - m) / n
    assert abs(diff1) <= 5 * np.sqrt(var1), (diff1, var1)
    assert abs(diff20) <= 5 * np.sqrt(var20), (diff20, var20)
    # a proposal temperature: importance weights, the same rows from both backends
    warm = _sampled(vllm_engine, seqs[:3], keys[:3], draws=32, proposal_temperature=2.0, seed=1)
    warm_hf = _sampled(hf_engine, seqs[:3], keys[:3], draws=32, proposal_temperature=2.0, seed=1)
    eq = sum(
        int((a.topk_ids == b.topk_ids).all(1).sum()) for a, b in zip(warm, warm_hf, strict=True)
    )
    assert eq >= 0.9 * sum(x.num_rows for x in warm)
    assert not np.allclose(warm[0].topk_logprobs[:, 0], warm[0].topk_logprobs[:, 1])


def test_engine_refuses_bad_sampling_arguments(vllm_engine):  # noqa: ANN001
    from logitcache.server.engine import EngineInputError

    for params, match in (
        ({"draws": 0}, "draws"),
        ({"draws": 10**6}, "draws"),
        ({"draws": 4, "proposal_temperature": 0.0}, "proposal_temperature"),
        ({"draws": 4, "seed": -1}, "seed"),
    ):
        with pytest.raises(EngineInputError, match=match):
            _sampled(vllm_engine, [[1, 2, 3]], ["k"], **params)
    with pytest.raises(EngineInputError, match="keys"):
        _sampled(vllm_engine, [[1, 2, 3]], ["a", "b"], draws=4)


@pytest.mark.vllm
def test_sampled_job_on_vllm_validates_and_resumes_to_the_same_cache(  # noqa: ANN201
    vllm_engine, tiny, heldout_sequences, tmp_path
):  # noqa: ANN001
    """A job with ``targets="sampled"`` on the real vLLM engine (real app under uvicorn) writes a
    sampled cache that validates and holds the engine's own sampled rows. Resume: a second cache
    that already holds a subset of the keys, scored in other batches (what a killed job leaves
    committed), completed by the same job, equals the one-go cache byte for byte: the draws
    depend on (seed, key, teacher row) only. Another kind or other parameters are a 409."""
    from server_support import ThreadedServer, server_settings, wait_job

    seqs = [s[:48] for s in heldout_sequences if len(s) >= 4][:12]
    records = [{"id": f"r{i}", "input_ids": s} for i, s in enumerate(seqs)]
    sampling = {"draws": 24, "seed": 5}
    job = {"targets": "sampled", "sampling": sampling, "records": records}
    settings = server_settings(
        tmp_path, str(tiny.teacher_dir), k=8, logprob_dtype="float32", job_batch_sequences=5
    )
    caches = tmp_path / "caches"
    # "b" first holds 4 of the keys, scored alone and in another order (a killed job's prefix)
    part = [7, 2, 10, 0]
    pre = _sampled(vllm_engine, [seqs[i] for i in part], [f"r{i}" for i in part], **sampling)
    manifest = None
    with ThreadedServer(settings, vllm_engine) as srv, srv.client() as c:
        r = c.post("/v1/jobs", json={"cache": "a", **job})
        assert r.status_code == 201, r.text
        assert r.json()["k"] == 24
        assert wait_job(c, r.json()["id"], timeout=120)["state"] == "succeeded"
        manifest = CacheReader(caches / "a").manifest
        with CacheWriter.open(str(caches / "b"), manifest) as w:
            w.append(
                [
                    SequenceRecord(f"r{i}", np.asarray(seqs[i]), s.topk_ids, s.topk_logprobs)
                    for i, s in zip(part, pre, strict=True)
                ]
            )
        r = c.post("/v1/jobs", json={"cache": "b", **job})
        assert wait_job(c, r.json()["id"], timeout=120)["state"] == "succeeded"
        # one cache, one kind: a top-k job, other sampling parameters -> 409, nothing written
        for other in (
            {"k": 8},
            {"targets": "sampled", "sampling": {"draws": 24, "seed": 6}},
            {"targets": "sampled", "sampling": {"draws": 16, "seed": 5}},
        ):
            r = c.post("/v1/jobs", json={"cache": "a", "records": records, **other})
            assert r.status_code == 409, (other, r.text)
        # targets=sampled without sampling: the cache's own parameters
        r = c.post("/v1/jobs", json={"cache": "a", "targets": "sampled", "records": records})
        assert r.status_code == 201 and r.json()["k"] == 24, r.text
        wait_job(c, r.json()["id"], timeout=120)
        # /v1/score: sampled rows without a cache; from a sampled cache (hits) and a miss
        ask = {"targets": "sampled", "sampling": sampling}
        plain = c.post("/v1/score", json={"input_ids": seqs[:2], "keys": ["r0", "r1"], **ask})
        assert plain.status_code == 200 and plain.json()["k"] == 24, plain.text
        served = c.post(
            "/v1/score",
            json={"input_ids": [seqs[0], seqs[1][:9]], "keys": ["r0", "new"], "cache": "a", **ask},
        )
        assert served.status_code == 200, served.text
        assert [s["cached"] for s in served.json()["sequences"]] == [True, False]
        assert served.json()["stored"] == 1
        assert plain.json()["sequences"][0]["topk_ids"] == served.json()["sequences"][0]["topk_ids"]
        hit = c.post(
            "/v1/score",
            json={"input_ids": [seqs[1][:9]], "keys": ["new"], "cache": "a", "targets": "sampled"},
        )
        assert hit.json()["sequences"][0]["cached"] is True
        assert (
            hit.json()["sequences"][0]["topk_logprobs"]
            == served.json()["sequences"][1]["topk_logprobs"]
        )
        wrong = c.post("/v1/score", json={"input_ids": seqs[:1], "cache": "a"})
        assert wrong.status_code == 409, wrong.text
        for bad in (
            {"targets": "topk", "sampling": sampling},
            {"targets": "sampled", "k": 4},
            {"targets": "sampled", "sampling": {"draws": 0}},
            {"targets": "sampled", "sampling": {"draws": 24, "proposal_temperature": 0}},
        ):
            r = c.post("/v1/jobs", json={"cache": "c", "records": records, **bad})
            assert r.status_code == 422, (bad, r.text)
    assert not (caches / "c").exists()
    assert manifest.targets == "sampled"
    assert manifest.sampling == sampling_manifest(24, 1.0, 5) and manifest.k == 24
    for name in ("a", "b"):
        report = validate(str(caches / name))
        assert report.ok, report
    a, b = CacheReader(caches / "a"), CacheReader(caches / "b")
    assert sorted(b.keys) == sorted(r["id"] for r in records)
    assert sorted(a.keys) == sorted([*b.keys, "new"])
    direct = _sampled(vllm_engine, seqs, [r["id"] for r in records], **sampling)
    for rec, d in zip(records, direct, strict=True):
        ra, rb = a.get(rec["id"]), b.get(rec["id"])
        assert (ra.topk_ids == rb.topk_ids).all() and (ra.topk_logprobs == rb.topk_logprobs).all()
        assert (ra.topk_ids == d.topk_ids).all()
        np.testing.assert_array_equal(ra.topk_logprobs, d.topk_logprobs)


@pytest.mark.vllm
def test_both_vllm_hooks_install_once(vllm_engine) -> None:  # noqa: ANN001
    """The array-form and sampling hooks (server/engine/patching.py's patch-once) wrap vLLM's
    methods, once: a second install() keeps the same wrapper (no wrapper of a wrapper). After
    the shared engine exists, so vLLM's modules are already imported."""
    from logitcache.server.engine import vllm_logprobs, vllm_sampling
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert vllm_logprobs.install() is True and vllm_sampling.install() is True
    update = LogprobsProcessor._update_prompt_logprobs
    runner = GPUModelRunner._get_prompt_logprobs_dict
    assert update.__module__ == vllm_logprobs.__name__
    assert runner.__module__ == vllm_sampling.__name__
    assert vllm_logprobs.install() is True and vllm_sampling.install() is True
    assert LogprobsProcessor._update_prompt_logprobs is update
    assert GPUModelRunner._get_prompt_logprobs_dict is runner
