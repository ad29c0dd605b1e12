"""Head + residual sampled targets (issue #12, FORMAT.md 4.4 ``sampling.head``): the estimator of
``cache_format/sampling.py`` with ``head = m > 0`` (the teacher's top ``m`` kept exactly, the
draws from the rest), its manifest field, the service's ``sampling.head`` and the CLI's
``--head``; the two real engines agreeing and a real job (marked ``vllm``)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from engine_support import FakeEngine, app_settings, fake_sampled, in_process
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
from logitcache.server.engine.hf import sample_from_hidden
from sampling_support import V, teacher_rows


def dense(ids: np.ndarray, lw: np.ndarray, vocab: int = V) -> np.ndarray:
    """``[r, vocab]`` weights of stored rows (padding slots weigh 0)."""
    w = np.zeros((ids.shape[0], vocab))
    real = lw > PAD_LOGPROB
    rows = np.nonzero(real)[0]
    w[rows, ids[real]] = np.exp(lw[real].astype(np.float64))
    return w


def repeated(lp: torch.Tensor, trials: int, draws: int, tau: float, head: int) -> np.ndarray:
    """The weights of one row sampled ``trials`` times, each with the uniforms of its own seed."""
    u = torch.cat([uniforms(t, "row", 1, draws) for t in range(trials)])
    ids, lw = sample_rows(lp.expand(trials, V), u, tau, head=head)
    assert ids.shape == (trials, head + draws)
    return dense(ids, lw)


# ------------------------------------------------------------------------------ the estimator


def test_head_rows_keep_the_top_m_exactly_then_the_residual_draws() -> None:
    """Every row: the teacher's top-m ids with log w = log p bit for bit, residual ids outside
    the head, weights summing to 1, descending weight (ties by ascending id), padding = the
    smallest absent ids at PAD_LOGPROB, k = m + N slots."""
    lp = teacher_rows(40, seed=2)
    m, n = 5, 12
    ids, lw = sample_rows(lp, uniforms(4, "s", 40, n), head=m)
    assert ids.shape == lw.shape == (40, m + n) and ids.dtype == np.int32
    top_lp, top_ids = lp.topk(m, -1)
    p = lp.double().exp().numpy()
    for r in range(40):
        real = lw[r] > PAD_LOGPROB
        assert len(set(ids[r].tolist())) == m + n
        assert (np.diff(lw[r]) <= 0).all()
        tie = lw[r][1:] == lw[r][:-1]
        assert (ids[r][1:][tie] > ids[r][:-1][tie]).all()
        got = dict(zip(ids[r][real].tolist(), lw[r][real].tolist(), strict=True))
        for i, v in zip(top_ids[r].tolist(), top_lp[r].tolist(), strict=True):
            assert got[i] == v  # the head's weight is p_i exactly (float32 logprob)
        rest = [i for i in got if i not in set(top_ids[r].tolist())]
        assert 1 <= len(rest) <= n
        w_rest = np.exp(np.array([got[i] for i in rest], dtype=np.float64))
        # the residual carries exactly the mass outside the head (float32 rounding)
        assert abs(w_rest.sum() - (1 - p[r, top_ids[r].numpy()].sum())) < 1e-6
        assert abs(np.exp(lw[r][real].astype(np.float64)).sum() - 1) < 1e-5
        pad = ids[r][~real].tolist()
        assert pad == sorted(set(range(V)) - set(ids[r][real].tolist()))[: len(pad)]


@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_head_estimator_is_unbiased_at_tau_one_and_matches_its_formula(tau: float) -> None:
    """tau = 1: the mean of w over 3000 seeds is p within 5 standard errors (+1e-6 for the
    exact head's float32 rounding), for every id (the 60 outside the head included). Any tau:
    each row's residual weights are exactly (1 - P_head) c_i p_i / q_R_i / sum_l c_l p_l /
    q_R_l with the draws recomputed by inverse CDF of the residual proposal."""
    lp = teacher_rows(1, seed=3)
    p = lp.double().exp()[0].numpy()
    m, n, trials = 4, 8, 3000
    w = repeated(lp, trials, n, tau, m)
    np.testing.assert_allclose(w.sum(1), 1.0, atol=1e-5)
    if tau == 1.0:
        # se: the empirical one, at least the binomial one of a residual id, sqrt((1 - P_head)
        # p_i / N / trials) (an id too rare to be drawn has an empirical se of 0)
        rest = 1 - np.sort(p)[::-1][:m].sum()
        se = np.maximum(w.std(0), np.sqrt(rest * p / n)) / np.sqrt(trials)
        mean = w.mean(0)
        assert np.all(np.abs(mean - p) <= 5 * se + 1e-6), np.abs(mean - p).max()
    # the formula, row by row
    head = np.argsort(-p, kind="stable")[:m]
    q = np.exp(torch.log_softmax(lp[0].double() / tau, -1).numpy())
    q_r = q.copy()
    q_r[head] = 0
    q_r /= q_r.sum()
    cdf = np.cumsum(q_r)
    cdf /= cdf[-1]
    for t in (0, 1, 17, 999):
        u = uniforms(t, "row", 1, n)[0].numpy()
        c = np.bincount(np.searchsorted(cdf, u, side="right"), minlength=V).astype(float)
        ratio = c * p / np.where(q_r > 0, q_r, 1)
        want = (1 - p[head].sum()) * ratio / ratio.sum()
        want[head] = p[head]
        np.testing.assert_allclose(w[t], want, atol=1e-6)


def test_head_lowers_the_variance_at_equal_slots() -> None:
    """sum_v E[(w_v - p_v)^2] of head 4 + 12 draws is below plain 16 draws (same 16 slots), on
    a peaked and a flat teacher row (3000 seeds each)."""
    for seed, scale in ((3, 2.5), (8, 1.0)):
        lp = teacher_rows(1, seed=seed, scale=scale)
        p = lp.double().exp()[0].numpy()
        plain = ((repeated(lp, 3000, 16, 1.0, 0) - p) ** 2).sum(1).mean()
        head = ((repeated(lp, 3000, 12, 1.0, 4) - p) ** 2).sum(1).mean()
        assert head < 0.8 * plain, (scale, head, plain)


def _plain_formula(lp: torch.Tensor, u: torch.Tensor, tau: float) -> np.ndarray:
    """``[r, V]`` weights of plain RS-KD by its formula (FORMAT.md 4.4), in numpy: the draws by
    inverse CDF of ``q ∝ p^(1/tau)``, ``w_i = c_i p_i / q_i / sum_l c_l p_l / q_l``."""
    p = lp.double().exp().numpy()
    q = np.exp(torch.log_softmax(lp.double() / tau, -1).numpy())
    w = np.zeros_like(p)
    for r in range(p.shape[0]):
        cdf = np.cumsum(q[r])
        cdf /= cdf[-1]
        c = np.bincount(np.searchsorted(cdf, u[r].numpy(), side="right"), minlength=p.shape[1])
        ratio = c * p[r] / q[r]
        w[r] = ratio / ratio.sum()
    return w


def test_head_zero_is_the_plain_estimator_bit_for_bit() -> None:
    """head = 0, explicit, gives the default's bytes, and both are plain RS-KD by its formula
    (every draw's id, weights to float32 rounding); head = 1 differs. (A sha256 digest of
    these bytes taken on one machine is not portable: torch's vectorised exp/log differ in the
    last bits between CPU kinds, so the check is the formula, not a stored digest.)"""
    lp = torch.log_softmax(
        torch.randn(50, V, generator=torch.Generator().manual_seed(11)) * 2.5, -1
    )
    for tau, n, k in ((1.0, 16, None), (2.0, 8, None), (0.5, 12, 20)):
        u = uniforms(5, "golden", 50, n)
        ids, lw = sample_rows(lp, u, tau, k)
        ids0, lw0 = sample_rows(lp, u, tau, k, head=0)
        assert ids.tobytes() == ids0.tobytes() and lw.tobytes() == lw0.tobytes()
        assert ids.shape == (50, n if k is None else k)
        np.testing.assert_allclose(dense(ids, lw), _plain_formula(lp, u, tau), atol=1e-6)
        ids1, lw1 = sample_rows(lp, u, tau, None if k is None else k + 1, head=1)
        assert ids1.tobytes() != ids.tobytes() or lw1.tobytes() != lw.tobytes()
    # more draws than ids, few distinct (k <= V): still allowed without a head
    flat = torch.log_softmax(torch.zeros(2, 16), -1)
    assert sample_rows(flat, uniforms(0, "k", 2, 40), k=16)[0].shape == (2, 16)


def test_head_rows_do_not_depend_on_chunking() -> None:
    """Slices of the uniforms and the chunked lm-head pass give the full block's rows."""
    lp = teacher_rows(40, seed=6)
    u = uniforms(9, "c", 40, 10)
    full = sample_rows(lp, u, 1.3, head=6)
    parts = [sample_rows(lp[s : s + 7], u[s : s + 7], 1.3, head=6) for s in range(0, 40, 7)]
    assert (np.concatenate([x[0] for x in parts]) == full[0]).all()
    assert (np.concatenate([x[1] for x in parts]) == full[1]).all()
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(37, 16, generator=g), torch.randn(V, 16, generator=g)
    u = uniforms(3, "h", 37, 8)
    ref = sample_rows(torch.log_softmax(hidden @ weight.T / 0.7, -1), u, head=3)
    for chunk in (1, 5, 64):
        got = sample_from_hidden(hidden, weight, u, temperature=0.7, chunk_rows=chunk, head=3)
        assert got[0].shape == (37, 11)
        assert (got[0] == ref[0]).all() and np.allclose(got[1], ref[1], atol=1e-6)
    empty = sample_from_hidden(hidden[:0], weight, u[:0], head=3)
    assert empty[0].shape == (0, 11)


def test_bad_head_arguments_raise() -> None:
    lp = teacher_rows(2)
    for head, match in ((-1, "head must be"), (True, "head must be"), (60, "exceed the vocab")):
        with pytest.raises(ValueError, match=match):
            sample_rows(lp, uniforms(0, "k", 2, 8), head=head)
    with pytest.raises(ValueError, match="exceed the vocab"):
        sample_from_hidden(torch.zeros(2, 4), torch.zeros(V, 4), uniforms(0, "k", 2, 60), head=5)


# --------------------------------------------------------------------------------- manifest


def head_manifest(**over: Any) -> Manifest:
    doc: dict[str, Any] = {
        "teacher_model": "t",
        "tokenizer_fingerprint": "sha256:x",
        "vocab_size": V,
        "k": 12,
        "targets": "sampled",
        "sampling": sampling_manifest(8, 1.0, 7, head=4),
        "logprob_dtype": "float32",
    }
    doc.update(over)
    return Manifest(**doc)


def _records(n: int, head: int) -> list[SequenceRecord]:
    out = []
    for i in range(n):
        lp = teacher_rows(9, seed=i)
        ids, lw = sample_rows(lp, uniforms(7, f"s{i}", 9, 8), head=head)
        out.append(SequenceRecord(f"s{i}", (np.arange(10) * (i + 1)) % V, ids, lw))
    return out


def test_manifest_head_round_trips_validates_and_is_an_identity(tmp_path: Path) -> None:
    """sampling.head is written only when > 0 (absent = 0: the pre-head manifest bytes), round
    trips, the store validates; a resume with another head is a ManifestMismatchError that
    writes nothing; head 0 and absent are one identity; bad heads are ManifestErrors."""
    assert sampling_manifest(8, 1.0, 7) == sampling_manifest(8, 1.0, 7, head=0)
    assert "head" not in sampling_manifest(8, 1.0, 7)
    url = str(tmp_path / "c")
    m = head_manifest()
    with CacheWriter.open(url, m) as w:
        w.append(_records(3, head=4))
    reader = CacheReader(url)
    assert reader.manifest.sampling == {**sampling_manifest(8, 1.0, 7), "head": 4}
    assert reader.manifest.k == 12 and validate(url).ok
    before = CacheReader(url).num_sequences
    with pytest.raises(ManifestMismatchError, match="sampling"):
        CacheWriter.open(url, head_manifest(k=13, sampling=sampling_manifest(8, 1.0, 7, head=5)))
    with pytest.raises(ManifestMismatchError, match="sampling"):
        CacheWriter.open(url, head_manifest(k=8, sampling=sampling_manifest(8, 1.0, 7)))
    assert CacheReader(url).num_sequences == before
    # head 0 spelt out equals a manifest without it (old stores resume unchanged)
    plain = head_manifest(k=8, sampling=sampling_manifest(8, 1.0, 7))
    zero = head_manifest(k=8, sampling={**sampling_manifest(8, 1.0, 7), "head": 0})
    assert zero.sampling == plain.sampling == zero.to_attrs()["sampling"]
    plain.check_compatible(zero)
    attrs = m.to_attrs()
    for bad in ({"head": -1}, {"head": 1.5}, {"head": True}, {"head": 3}):
        with pytest.raises(ManifestError, match="head"):
            Manifest.from_attrs({**attrs, "sampling": {**attrs["sampling"], **bad}})


# ----------------------------------------------------------------------- service (fake tier)


def test_service_refuses_bad_heads_and_writes_the_engines_head_rows(tmp_path: Path) -> None:
    """On the fake teacher: /v1/score and /v1/jobs with sampling.head; head < 0, head + draws
    over the vocabulary or over MAX_K are 422 and create no cache; a head job's cache holds the
    engine's rows at k = head + draws; another head on that cache is a 409."""
    from logitcache.server.engine import EngineInputError, SampledTargets, check_sampled

    engine = FakeEngine()
    prompts = [[1, 5, 9, 200, 7, 33, 2], [1, 2, 3, 4]]
    ask = {"targets": "sampled", "sampling": {"draws": 8, "seed": 2, "head": 3}}
    bads = (
        {"draws": 8, "head": -1},
        {"draws": 290, "head": 20},  # 310 slots > vocabulary 300
        {"draws": 4000, "head": 100},  # > MAX_K
        {"draws": 8, "head": 1.5},
    )

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with in_process(app_settings(tmp_path), engine) as c:
            out["score"] = await c.post(
                "/v1/score", json={"input_ids": prompts, "keys": ["a", "b"], **ask}
            )
            out["bad"] = [
                await c.post(
                    "/v1/jobs",
                    json={
                        "cache": "x",
                        "records": [{"input_ids": p} for p in prompts],
                        "targets": "sampled",
                        "sampling": s,
                    },
                )  # fmt: skip
                for s in bads
            ]
            recs = [{"id": f"r{i}", "input_ids": p} for i, p in enumerate(prompts)]
            r = await c.post("/v1/jobs", json={"cache": "h", "records": recs, **ask})
            out["job"] = r
            job = r.json()
            while job.get("state") not in ("succeeded", "failed", "cancelled"):
                await asyncio.sleep(0.02)
                job = (await c.get(f"/v1/jobs/{job['id']}")).json()
            out["done"] = job
            other = {"targets": "sampled", "sampling": {"draws": 8, "seed": 2, "head": 4}}
            out["other"] = await c.post("/v1/jobs", json={"cache": "h", "records": recs, **other})
        return out

    got = asyncio.run(main())
    t = SampledTargets(8, seed=2, head=3)
    assert got["score"].status_code == 200, got["score"].text
    assert got["score"].json()["k"] == 11  # the response's k is the row's slots, head + draws
    for seq, ids, key in zip(got["score"].json()["sequences"], prompts, ("a", "b"), strict=True):
        ref = fake_sampled(ids, key, t, engine.info)
        assert np.asarray(seq["topk_ids"]).shape == (len(ids) - 1, 11)
        assert seq["topk_ids"] == ref.topk_ids.tolist()
    for r in got["bad"]:
        assert r.status_code == 422, r.text
    assert not (tmp_path / "caches" / "x").exists()
    assert got["job"].status_code == 201 and got["job"].json()["k"] == 11, got["job"].text
    assert got["done"]["state"] == "succeeded", got["done"]
    assert got["done"]["sampling"]["head"] == 3, got["done"]
    assert got["other"].status_code == 409, got["other"].text
    reader = CacheReader(tmp_path / "caches" / "h")
    assert reader.manifest.sampling == sampling_manifest(8, 1.0, 2, head=3)
    assert reader.manifest.k == 11 and validate(str(tmp_path / "caches" / "h")).ok
    for key, ids in zip(("r0", "r1"), prompts, strict=True):
        rec, ref = reader.get(key), fake_sampled(ids, key, t, engine.info)
        assert (rec.topk_ids == ref.topk_ids).all()
        np.testing.assert_array_equal(rec.topk_logprobs, ref.topk_logprobs)
    assert check_sampled(t, 300) == t and t.slots == 11
    with pytest.raises(EngineInputError, match="head"):
        check_sampled(SampledTargets(8, head=293), 300)


def test_jobs_cli_head_flag_and_label() -> None:
    """``jobs submit --targets sampled --head M`` puts head in the job's sampling; --head without
    --targets sampled is refused; the list label names the head."""
    from logitcache.client.cli import CliError
    from logitcache.client.cli.jobs import target_fields, targets_label

    def sampling(**kw: Any) -> dict[str, Any]:
        return {"draws": None, "proposal_temperature": None, "seed": None, "head": None, **kw}

    assert target_fields("sampled", None, sampling(head=8, draws=24)) == {
        "targets": "sampled",
        "sampling": {"draws": 24, "head": 8},
    }
    with pytest.raises(CliError, match="--head only apply"):
        target_fields(None, None, sampling(head=8))
    job = {"targets": "sampled", "k": 32}
    s = {"draws": 24, "proposal_temperature": 1.0, "seed": 0}
    assert targets_label({**job, "sampling": {**s, "head": 8}}) == "sampled 24 head 8 tau 1 seed 0"
    assert targets_label({**job, "sampling": s}) == "sampled 24 tau 1 seed 0"
    assert json.dumps(s)  # the plain label is unchanged


# ---------------------------------------------------------------------- the real engines


def _sampled(engine: Any, seqs: list, keys: list, **params: Any) -> list:
    from logitcache.server.engine import SampledTargets

    return asyncio.run(engine.score_sampled(seqs, keys, SampledTargets(**params)))


@pytest.mark.vllm
def test_engines_agree_on_head_rows(vllm_engine, hf_engine, heldout_sequences) -> None:  # noqa: ANN001
    """vLLM (inside its worker) and transformers (chunked lm-head pass) give the same head +
    residual rows; the head is each engine's own top-m with w = p (to float32 rounding)."""
    seqs = [s[:40] for s in heldout_sequences[:4] if len(s) >= 8]
    keys = [f"h{i}" for i in range(len(seqs))]
    m, n = 8, 24
    got = _sampled(vllm_engine, seqs, keys, draws=n, seed=3, head=m)
    ref = _sampled(hf_engine, seqs, keys, draws=n, seed=3, head=m)
    top = asyncio.run(vllm_engine.score(seqs, m))
    rows = sum(len(s) - 1 for s in seqs)
    same = sum(int((a.topk_ids == b.topk_ids).all(1).sum()) for a, b in zip(got, ref, strict=True))
    assert same >= 0.9 * rows, (same, rows)
    for s, t in zip(got, top, strict=True):
        assert s.topk_ids.shape == (t.num_rows, m + n)
        for r in range(t.num_rows):
            have = dict(zip(s.topk_ids[r].tolist(), s.topk_logprobs[r].tolist(), strict=True))
            for i, v in zip(t.topk_ids[r].tolist(), t.topk_logprobs[r].tolist(), strict=True):
                assert abs(have[i] - v) < 1e-4
        w = np.exp(s.topk_logprobs.astype(np.float64)) * (s.topk_logprobs > PAD_LOGPROB)
        np.testing.assert_allclose(w.sum(1), 1.0, atol=1e-5)


@pytest.mark.vllm
def test_head_job_on_vllm_writes_the_engines_rows(vllm_engine, tiny, heldout_sequences, tmp_path):  # noqa: ANN001, ANN201
    """A job with sampling.head through the real app on the real vLLM engine: k = head +
    draws, the manifest's sampling.head, a valid store holding the engine's own rows; the same
    job again on the cache (a resume) adds nothing and keeps the bytes."""
    from server_support import ThreadedServer, server_settings, wait_job

    seqs = [s[:32] for s in heldout_sequences if len(s) >= 4][:4]
    records = [{"id": f"r{i}", "input_ids": s} for i, s in enumerate(seqs)]
    sampling = {"draws": 12, "seed": 5, "head": 4}
    job = {"cache": "a", "targets": "sampled", "sampling": sampling, "records": records}
    settings = server_settings(tmp_path, str(tiny.teacher_dir), k=8, logprob_dtype="float32")
    with ThreadedServer(settings, vllm_engine) as srv, srv.client() as c:
        r = c.post("/v1/jobs", json=job)
        assert r.status_code == 201 and r.json()["k"] == 16, r.text
        assert wait_job(c, r.json()["id"], timeout=120)["state"] == "succeeded"
        url = tmp_path / "caches" / "a"
        first = {k: CacheReader(url).get(k).topk_logprobs.tobytes() for k in CacheReader(url).keys}
        r = c.post("/v1/jobs", json=job)
        assert wait_job(c, r.json()["id"], timeout=120)["state"] == "succeeded"
    reader = CacheReader(url)
    assert reader.manifest.sampling == sampling_manifest(12, 1.0, 5, head=4)
    assert reader.manifest.k == 16 and validate(str(url)).ok
    assert reader.num_sequences == len(records)
    direct = _sampled(vllm_engine, seqs, [r["id"] for r in records], draws=12, seed=5, head=4)
    for rec, d in zip(records, direct, strict=True):
        got = reader.get(rec["id"])
        assert (got.topk_ids == d.topk_ids).all()
        np.testing.assert_array_equal(got.topk_logprobs, d.topk_logprobs)
        assert got.topk_logprobs.tobytes() == first[rec["id"]]


# ---------------------------------------------------------------- readers and the loss


def test_head_rows_read_trim_and_train_like_plain_rows(tmp_path: Path) -> None:
    """A head cache through CacheDataset(trim_sampled=True) drops only trailing padding, and
    the loss (targets="sampled", reduction "none") on it is each row's
    sum_i w_i (log w_i - log s_i) with w the stored weights (float64)."""
    from client_support import VOCAB, make_dataset, make_sequences, manifest
    from logitcache.client.collate import IGNORE_INDEX
    from logitcache.client.loss import topk_distill_loss

    m, n = 6, 20
    records = []
    for i, seq in enumerate(make_sequences(12, seed=3, min_len=6, max_len=40)):
        g = torch.Generator().manual_seed(i)
        scale = torch.linspace(0.5, 6.0, len(seq) - 1)[:, None]
        lp = torch.log_softmax(torch.randn(len(seq) - 1, VOCAB, generator=g) * scale, -1)
        ids, lw = sample_rows(lp, uniforms(5, f"s{i}", len(seq) - 1, n), head=m)
        records.append(SequenceRecord(f"s{i}", seq, ids, lw))
    url = str(tmp_path / "head")
    mf = manifest(k=m + n, targets="sampled", sampling=sampling_manifest(n, 1.0, 5, head=m))
    with CacheWriter.open(url, mf) as w:
        w.append(records)
    assert validate(url).ok
    opts: dict[str, Any] = {"tokens_per_item": 32, "batch_size": 3, "seed": 1}
    full = list(make_dataset(url, trim_sampled=False, **opts))
    trimmed = list(make_dataset(url, **opts))
    assert len(full) == len(trimmed) > 2
    narrower = 0
    for f, t in zip(full, trimmed, strict=True):
        assert t["target_kind"] == "sampled"
        width = t["topk_ids"].shape[-1]
        narrower += width < m + n
        assert torch.equal(t["topk_ids"], f["topk_ids"][..., :width])
        rows = f["labels"] != IGNORE_INDEX
        assert (f["topk_logprobs"][..., width:][rows] == PAD_LOGPROB).all()
    assert narrower > 0
    unit = trimmed[0]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(*unit["labels"].shape, 8, generator=g, dtype=torch.float64)
    weight = torch.randn(VOCAB, 8, generator=g, dtype=torch.float64) / 2
    loss = topk_distill_loss(
        hidden,
        weight,
        unit["topk_ids"],
        unit["topk_logprobs"],
        labels=unit["labels"],
        targets="sampled",
        impl="dense",
        reduction="none",
    )
    log_s = torch.log_softmax(hidden @ weight.T, -1)
    lw = unit["topk_logprobs"].double()
    wt = lw.exp() * (lw > PAD_LOGPROB)
    ref = (wt * (lw.clamp_min(-1e4) - log_s.gather(-1, unit["topk_ids"].long()))).sum(-1)
    rows = unit["labels"] != IGNORE_INDEX
    torch.testing.assert_close(loss[rows], ref[rows], rtol=1e-6, atol=1e-8)
