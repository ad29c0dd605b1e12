"""Issue #12 ablation methods (examples/distill_train.py live-teacher targets) and the ablation
page's pieces (examples/distill_ablation.py); tiny tensors and a one-layer Llama, no cache."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import distill_ablation  # noqa: E402
import distill_train  # noqa: E402
from client_support import tiny_llama  # noqa: E402
from distill_report import label  # noqa: E402


def test_parse_method_ablation_specs() -> None:
    assert distill_train.parse_method("online_topk_tail@128") == ("online_topk_tail", 128)
    assert distill_train.parse_method("online_sampled@384") == ("online_sampled", 384)
    assert distill_train.parse_method("online_sampled_head@32+96") == ("online_sampled_head", 128)
    assert distill_train.parse_method("online_kd_f16") == ("online_kd_f16", None)
    assert distill_train.parse_head("online_sampled_head@32+96") == (32, 96)
    for bad in ("online_sampled", "online_topk", "online_kd@3", "online_sampled_head@32"):
        with pytest.raises(ValueError):
            distill_train.parse_method(bad)
    assert label("online_sampled_head@32+96").endswith("m=32 + 96 draws/row")
    assert label("online_sampled@384").endswith("384 draws/row")


def test_live_topk_tail_is_the_mass_outside() -> None:
    t_lp = torch.log_softmax(torch.randn(2, 3, 10), -1)
    tgt = distill_train.live_topk(t_lp, 4)
    assert tgt["topk_ids"].shape == (2, 3, 4)
    assert torch.equal(tgt["topk_ids"][..., 0], t_lp.argmax(-1))
    want = 1 - t_lp.exp().gather(-1, tgt["topk_ids"]).sum(-1)
    torch.testing.assert_close(tgt["tail_mass"], want)
    assert float(distill_train.live_topk(t_lp, 10)["tail_mass"].abs().max()) < 1e-6


def test_live_sampled_fresh_per_step_and_unbiased() -> None:
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    t_lp = p.log().expand(1, 4000, 5).contiguous()
    a = distill_train.live_sampled(t_lp, 3, seed=0, step=0)
    again = distill_train.live_sampled(t_lp, 3, seed=0, step=0)
    other = distill_train.live_sampled(t_lp, 3, seed=0, step=1)
    assert torch.equal(a["topk_ids"], again["topk_ids"])
    assert not torch.equal(a["topk_ids"], other["topk_ids"])
    w = a["topk_logprobs"].exp()
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 4000))
    mean_w = torch.zeros(5).index_add_(0, a["topk_ids"].flatten(), w.flatten()) / 4000
    torch.testing.assert_close(mean_w, p, atol=0.02, rtol=0)  # E[w_i] = p_i


def test_live_sampled_head_keeps_the_top_exactly() -> None:
    t_lp = torch.log_softmax(torch.randn(1, 6, 50) * 2, -1)
    tgt = distill_train.live_sampled(t_lp, 8, seed=1, step=0, head=3)
    top = torch.topk(t_lp, 3, -1)
    for r in range(6):
        ids, lws = tgt["topk_ids"][0, r].tolist(), tgt["topk_logprobs"][0, r].tolist()
        got = dict(zip(ids, lws, strict=True))
        for i, lp in zip(top.indices[0, r].tolist(), top.values[0, r].tolist(), strict=True):
            assert got[i] == pytest.approx(lp, abs=1e-5)


def _batch(t: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (2, t), generator=g)
    mask = torch.ones(2, t, dtype=torch.bool)
    mask[1, -2:] = False
    return {
        "input_ids": ids,
        "position_ids": torch.arange(t).expand(2, t),
        "loss_mask": mask,
    }


def test_live_full_topk_tail_equals_online_kd() -> None:
    """k = V: the live top-k + tail loss is the full KL, so only the target source differs."""
    teacher, batch = tiny_llama().eval(), _batch()
    torch.manual_seed(5)
    student = tiny_llama()
    with torch.no_grad():
        for w in student.parameters():
            w.add_(0.1 * torch.randn_like(w))
    s = distill_train.TrainSettings()

    def value(method: str) -> torch.Tensor:
        return distill_train.loss_fn(method, teacher, s)(student, batch).detach()

    full, topk, f16 = value("online_kd"), value("online_topk_tail@97"), value("online_kd_f16")
    assert float(full) > 1e-3
    torch.testing.assert_close(topk, full, atol=1e-4, rtol=1e-4)
    assert abs(float(f16) - float(full)) < 5e-3 * float(full)
    sparse = value("online_topk@8")
    assert abs(float(sparse) - float(full)) > 1e-4  # a top-8 loss is not the full KL


def test_row_kl_zero_for_live_rows_positive_for_other_context() -> None:
    t_lp = torch.log_softmax(torch.randn(2, 5, 20) * 2, -1)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, 0] = False
    batch = {**distill_train.live_topk(t_lp, 6), "loss_mask": mask}
    assert float(distill_ablation.row_kl(batch, t_lp).abs().max()) < 1e-5
    other = torch.log_softmax(torch.randn(2, 5, 20) * 2, -1)
    kl = distill_ablation.row_kl(batch, other)
    assert float(kl[0, 0]) == 0.0  # masked position
    assert float(kl[mask].min()) > 0


def _report(seed: int, kls: dict[str, float], tpi: int = 64) -> dict[str, Any]:
    methods = {
        m: {"kl": kl, "step_ms_median": 500.0 if m == "online_kd" else 250.0}
        for m, kl in kls.items()
    }
    return {
        "command": "python examples/distill.py --steps 3",
        "machine": "test box",
        "models": {"teacher_params": 10, "student_params": 5, "vocab_size": 1024},
        "plan": {"seq_len": 128},
        "cache": {"num_sequences": 2, "k": 8},
        "heldout": {"positions": 100, "window": 128},
        "train": {"steps": 3, "batch_items": 8, "tokens_per_item": tpi, "lr": 0.1, "seed": seed},
        "methods": methods,
    }


def test_ablation_page_paired_gaps() -> None:
    reps = [
        _report(0, {"online_kd": 1.0, "offline_topk_tail@128": 1.10, "online_topk_tail@128": 1.0}),
        _report(1, {"online_kd": 2.0, "offline_topk_tail@128": 2.10, "online_topk_tail@128": 2.02}),
    ]
    check = {
        "tokens_per_item": 64,
        "share_rows_in_cut_pieces": 0.347,
        "batch_items": 8,
        "rows": 1000,
        "mean_kl": 0.04,
        "share_rows_differ": 0.27,
        "mean_kl_differing": 0.13,
        "max_kl": 5.0,
        "top1_agreement": 0.92,
        "same_stream": False,
        "stream_caches": 3,
        "batches": 30,
    }
    text = distill_ablation.ablation_markdown(
        {"split": reps},
        [check],
        command="cmd",
        intro=["why"],
        label=label,
        verdicts={"split": ["Goal 1 verdict."]},
    )
    assert "On this configuration's seed means: Goal 1 verdict." in text
    # offline vs online KD: +10% and +5% -> mean +7.5%, SE 2.5 points
    assert "| +7.5% +- 2.5 | +10.0%, +5.0% | 0.50x |" in text
    assert "`offline_topk_tail@128` vs `online_topk_tail@128` +7.0% +- 3.0" in text
    assert (
        "| 8 x 64 | 34.7% | 1,000 | 4.00e-02 | 27.0% | 0.1300 | 5.00e+00 | 92.00% | "
        "**NO** (3 caches, epoch 1, first 30 batches) |" in text
    )
    assert distill_ablation.paired([1.0], [2.0]) == (-0.5, 0.0)
    # rows 100 and 30 of two sequences, T = 64: rows 64..99 of the first lie in its 2nd piece
    assert distill_ablation.cut_share([100, 30], 64) == pytest.approx(36 / 130)
    assert distill_ablation.cut_share([100, 30], 128) == 0.0


def test_bench_ablation_spec_and_merge(tmp_path: Path) -> None:
    import json

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import distill_bench

    a, b = tmp_path / "a", tmp_path / "b"
    for d, kls, online_ms in (
        (a, {"online_kd": 1.0, "offline_sampled@384": 1.1}, 500.0),
        (b, {"online_sampled@384": 1.02, "online_kd": 9.0}, 1000.0),
    ):
        rep = _report(0, kls)
        rep["methods"]["online_kd"]["step_ms_median"] = online_ms
        (d / "seed0").mkdir(parents=True)
        (d / "seed0" / "distill.json").write_text(json.dumps(rep))
    name, dirs, seeds = distill_bench.parse_ablation(f"draws={a}+{b}@0", [0, 1, 2])
    assert (name, dirs, seeds) == ("draws", [a, b], [0])
    assert distill_bench.parse_ablation(f"x={a}", [2, 3])[2] == [2, 3]
    with pytest.raises(SystemExit):
        distill_bench.parse_ablation(f"x={a}@one", [0])
    merged = distill_bench.merged_report(dirs, 0)
    assert merged["methods"]["online_kd"]["kl"] == 1.0  # the first work dir's own method wins
    assert merged["methods"]["online_sampled@384"]["kl"] == 1.02
    assert merged["merged_methods"] == ["online_sampled@384"]
    only_first = distill_bench.merged_report([a, tmp_path / "no-such-run"], 0)
    assert set(only_first["methods"]) == {"online_kd", "offline_sampled@384"}
    with pytest.raises(FileNotFoundError):  # the first work dir must have the seed
        distill_bench.merged_report([tmp_path / "no-such-run", a], 0)
    text = "\n".join(distill_ablation.config_lines("draws", [merged], label))
    assert "(separate run: step time vs its own run's online KD)" in text
    # 250 ms against its own run's 1000 ms online KD: 0.25x of this run's 500 ms = 125 ms
    assert merged["methods"]["online_sampled@384"]["step_ms_median"] == pytest.approx(125.0)
    assert "`offline_sampled@384` vs `online_sampled@384` +7.8% +- 0.0" in text
    (b / "seed0" / "distill.json").write_text(json.dumps(_report(0, {"online_sampled@384": 1.0})))
    alone = distill_bench.merged_report(dirs, 0)  # no online KD in the second run: no rescale
    assert alone["unscaled_methods"] == ["online_sampled@384"]
    assert "not comparable) |  | 1.0000 |" in "\n".join(
        distill_ablation.config_lines("d", [alone], label)
    )
    other = _report(0, {"online_kd": 1.0}, tpi=128)
    (b / "seed0" / "distill.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="different training plans"):
        distill_bench.merged_report(dirs, 0)


class _EmbTeacher(torch.nn.Module):
    """A deterministic HF-like teacher (``.logits`` = an embedding of the input ids)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, vocab)
        torch.nn.init.normal_(self.emb.weight, std=2.0, generator=torch.Generator().manual_seed(1))

    def forward(self, input_ids: torch.Tensor) -> Any:
        return type("Out", (), {"logits": self.emb(input_ids)})()


def _src_cache(tmp_path: Path, teacher: Any, v: int = 64) -> str:
    """A k=4 top-k cache of three 10-token sequences scored by ``teacher``."""
    import numpy as np
    from logitcache.cache_format import CacheWriter, Manifest, SequenceRecord

    src = str(tmp_path / "src")
    manifest = Manifest(teacher_model="t", tokenizer_fingerprint="sha256:x", vocab_size=v, k=4)
    with torch.no_grad(), CacheWriter.open(src, manifest) as w:
        recs = []
        for i in range(3):
            ids = (np.arange(10) * (i + 3)) % v
            lp = torch.log_softmax(teacher(torch.as_tensor(ids)[None]).logits[0, :-1], -1)
            top = lp.topk(4, -1)
            recs.append(SequenceRecord(f"s{i}", ids, top.indices.numpy(), top.values.numpy()))
        w.append(recs)
    return src


def test_split_note_only_when_items_cut_sequences(tmp_path: Path) -> None:
    import distill

    src = _src_cache(tmp_path, _EmbTeacher(64))
    note = distill.split_note(src, 4)  # rows 4..8 of each 10-token sequence: 5 of 9 cut
    assert note.startswith("55.6% of the cache's rows lie in pieces cut")
    assert distill.split_note(src, 10) == ""


def test_head_sampled_cache_keeps_the_teacher_top_exactly(tmp_path: Path) -> None:
    from distill_caches import sampled_caches
    from logitcache.cache_format import CacheReader
    from logitcache.cache_format.sampling import sampling_manifest

    teacher = _EmbTeacher(64)
    src = _src_cache(tmp_path, teacher)
    url = sampled_caches(src, {6: str(tmp_path / "head")}, teacher, seed=2, head=3)[6]
    reader = CacheReader(url)
    assert reader.manifest.k == 9 and reader.manifest.sampling == sampling_manifest(6, 1.0, 2, 3)
    for i in range(3):
        rec, want = reader.sequence(i), CacheReader(src).sequence(i)
        for row in range(rec.topk_ids.shape[0]):
            got = dict(
                zip(rec.topk_ids[row].tolist(), rec.topk_logprobs[row].tolist(), strict=True)
            )
            for j in range(3):  # the top-3 ids with their exact log p (float16 storage)
                assert got[int(want.topk_ids[row, j])] == pytest.approx(
                    float(want.topk_logprobs[row, j]), abs=2e-2
                )
    assert distill_train.parse_method("offline_sampled_head@3+6") == ("offline_sampled_head", 9)


def test_same_stream_true_for_a_derived_cache_false_for_another_order(tmp_path: Path) -> None:
    from distill_caches import derive_topk_cache
    from logitcache.cache_format import CacheReader, CacheWriter, SequenceRecord

    src = _src_cache(tmp_path, _EmbTeacher(64))
    derived = derive_topk_cache(src, str(tmp_path / "k2"), 2)
    reader = CacheReader(src)
    with CacheWriter.open(str(tmp_path / "rev"), reader.manifest) as w:
        for i in reversed(range(reader.num_sequences)):
            r = reader.sequence(i)
            w.append([SequenceRecord(r.key, r.input_ids, r.topk_ids, r.topk_logprobs)])
    kw = {"tokens_per_item": 10, "batch_items": 1, "batches": 5}
    assert distill_ablation.same_stream([src, derived], **kw)
    assert not distill_ablation.same_stream([src, str(tmp_path / "rev")], **kw)
