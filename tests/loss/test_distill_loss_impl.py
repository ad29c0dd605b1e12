"""``examples/distill.py --loss-impl``: the sparse-target methods' ``topk_distill_loss`` impl
(default ``auto``: ``small_vocab`` at the tiny setup's CPU shapes), same loss value either way."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import distill  # noqa: E402
import distill_train  # noqa: E402
from client_support import tiny_llama  # noqa: E402


def test_flag_reaches_the_plan(tmp_path: Path) -> None:
    plan, _ = distill.parse_args(["--workdir", str(tmp_path)])
    assert plan.loss_impl == "auto"
    plan, _ = distill.parse_args(["--workdir", str(tmp_path), "--loss-impl", "fused_chunked"])
    assert plan.loss_impl == "fused_chunked"
    with pytest.raises(SystemExit):
        distill.parse_args(["--workdir", str(tmp_path), "--loss-impl", "nope"])


def test_sparse_methods_use_the_impl(monkeypatch: pytest.MonkeyPatch) -> None:
    import logitcache.client.loss as loss_pkg

    teacher, student = tiny_llama().eval(), tiny_llama()
    torch.manual_seed(5)
    with torch.no_grad():  # the same init: move the student off the teacher
        for w in student.parameters():
            w.add_(0.1 * torch.randn_like(w))
    g = torch.Generator().manual_seed(3)
    batch = {
        "input_ids": torch.randint(0, 97, (2, 6), generator=g),
        "position_ids": torch.arange(6).expand(2, 6),
        "loss_mask": torch.ones(2, 6, dtype=torch.bool),
    }
    seen: list[str] = []
    real = loss_pkg.topk_distill_loss

    def spy(*args, **kw):
        seen.append(kw["impl"])
        return real(*args, **kw)

    monkeypatch.setattr(loss_pkg, "topk_distill_loss", spy)
    values = {}
    for impl in ("auto", "fused_chunked", "small_vocab"):
        settings = distill_train.TrainSettings(loss_impl=impl)
        f = distill_train.loss_fn("online_topk_tail@16", teacher, settings)
        values[impl] = float(f(student, batch))
    assert seen == ["auto", "fused_chunked", "small_vocab"]
    assert values["fused_chunked"] > 1e-3
    assert values["auto"] == pytest.approx(values["fused_chunked"], rel=1e-5)
    assert values["small_vocab"] == pytest.approx(values["fused_chunked"], rel=1e-5)
