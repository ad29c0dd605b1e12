"""``CacheDistillTrainer`` on a ``targets="hidden"`` cache: the tiny teacher's hidden states
(captured by the real transformers engine) and its head train the tiny student with
``exact_distill_loss``; the trainer's loss on a batch is online KD's full-vocabulary KL against
the PyTorch teacher on the same packed batch, and two real ``Trainer`` steps train."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import pytest
import torch
from format_support import hidden_manifest
from logitcache.cache_format import CacheWriter, HiddenRecord
from logitcache.client import CacheDataset, StreamConfig
from logitcache.client.errors import ConfigError
from logitcache.client.packing import packed_hidden_states

if TYPE_CHECKING:
    from logitcache.client.hf import CacheDistillTrainer

# The trainer stack (transformers.Trainer, ~5 CPU-s to import) is imported by the tests that use
# it, not when the module is collected: every pytest process collects this file.
T, B = 64, 2


@pytest.fixture(scope="module")
def hidden_cache(hf_engine, heldout_sequences, tmp_path_factory) -> str:
    prompts = heldout_sequences[:12]
    hidden = asyncio.run(hf_engine.score_hidden(prompts))
    head = hf_engine.teacher_head()
    url = str(tmp_path_factory.mktemp("hf-exact") / "h.zarr")
    with CacheWriter.open(url, hidden_manifest(head), head=head) as w:
        w.append([HiddenRecord(None, p, h) for p, h in zip(prompts, hidden, strict=True)])
    return url


def _dataset(url: str, tiny: Any) -> CacheDataset:
    config = StreamConfig(tokens_per_item=T, mode="pack", batch_size=B, seed=0)
    return CacheDataset(url, config, vocab_size=tiny.vocab_size)


def _trainer(url: str, tiny: Any, out: str, **kw: Any) -> CacheDistillTrainer:
    from logitcache.client.hf import CacheDistillTrainer
    from transformers import LlamaForCausalLM, TrainingArguments

    args = TrainingArguments(
        out,
        per_device_train_batch_size=B,
        max_steps=2,
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    student = LlamaForCausalLM.from_pretrained(str(tiny.student_dir)).float()
    return CacheDistillTrainer(model=student, args=args, train_dataset=_dataset(url, tiny), **kw)


def test_hidden_batches_train_with_the_exact_loss(hidden_cache, tiny, tmp_path) -> None:
    trainer = _trainer(hidden_cache, tiny, str(tmp_path / "run"))
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["hidden"].dtype == torch.bfloat16 and "topk_ids" not in batch
    from transformers import LlamaForCausalLM

    teacher = LlamaForCausalLM.from_pretrained(str(tiny.teacher_dir)).float().eval()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
        p = torch.log_softmax(teacher.lm_head(packed_hidden_states(teacher, batch)), -1)
        s = trainer.model
        q = torch.log_softmax(s.lm_head(packed_hidden_states(s, batch)), -1)
    mask = batch["loss_mask"]
    online = (p.exp() * (p - q)).sum(-1)[mask].mean()  # online KD on the same packed batch
    assert float(loss) > 1.0
    torch.testing.assert_close(loss.double(), online.double(), rtol=2e-3, atol=0)

    before = trainer.model.lm_head.weight.detach().clone()
    result = trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert trainer.state.global_step == 2 and len(losses) == 2
    assert losses[0] == pytest.approx(float(loss), rel=1e-3)  # step 1 trained that batch
    assert all(torch.isfinite(torch.tensor(losses))) and result.training_loss > 0
    assert not torch.equal(before, trainer.model.lm_head.weight.detach())


def test_empty_hidden_unit_counts_nothing(hidden_cache, tiny, tmp_path) -> None:
    from logitcache.client.hf import RankEvenStream

    trainer = _trainer(hidden_cache, tiny, str(tmp_path / "run"), kd_loss="jsd")
    unit = RankEvenStream(trainer.train_dataset, 1).empty_unit()
    assert unit["hidden"].shape == (1, T, 256) and unit["target_kind"] == "hidden"
    with torch.no_grad():
        assert float(trainer.compute_loss(trainer.model, unit, num_items_in_batch=4)) == 0.0


def test_a_divergence_the_exact_loss_lacks_is_refused(hidden_cache, tiny, tmp_path) -> None:
    with pytest.raises(ConfigError, match="hidden cache trains with kd_loss"):
        _trainer(hidden_cache, tiny, str(tmp_path / "run"), kd_loss="renormalized_kl")
