"""``CacheDistillTrainer`` resume is exact by construction (issue #14): a checkpoint holds each
rank's data state (the sequence count the epoch was planned over, the epoch length), so a run
resumed mid-epoch after the cache grew trains the same documents in the same steps."""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from client_support import build_cache, make_sequences, manifest, record_for, tiny_llama
from logitcache.client import StreamConfig

# Checked, not imported: transformers loads in the tests, not at collection.
pytestmark = pytest.mark.skipif(find_spec("transformers") is None, reason="needs transformers")

T, B = 40, 2


def _grow(url: Path, sequences: list, first: int) -> None:
    from logitcache.cache_format import CacheWriter

    records = [record_for(s, key=f"seq-{first + i}") for i, s in enumerate(sequences)]
    with CacheWriter.open(str(url), manifest()) as writer:
        writer.append(records)


def _args(out: Path, save: int, workers: int) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        str(out),
        per_device_train_batch_size=B,
        num_train_epochs=2,
        save_steps=save,
        report_to=[],
        dataloader_num_workers=workers,
        disable_tqdm=True,
        use_cpu=True,
        seed=0,
    )


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_after_the_cache_grew_trains_the_same_stream(tmp_path: Path, workers: int) -> None:
    """A mid-epoch resume after a job appended to the cache trains the same batches in the same
    steps as the uninterrupted run (the trainer refuses ``follow=True``: test_client_hf_stream)."""
    from logitcache.client import CacheDataset
    from logitcache.client.hf import DATA_STATE_NAME, CacheDistillTrainer

    url = tmp_path / "cache"
    build_cache(url, make_sequences(30, seed=7, max_len=40))
    log: list[tuple[int, list]] = []

    class Recording(CacheDistillTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            log.append((self.state.global_step, inputs["input_ids"].tolist()))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def run(out: Path, save: int, resume: str | None = None) -> list:
        ds = CacheDataset(url, StreamConfig(tokens_per_item=T, batch_size=B, seed=1))
        log.clear()
        trainer = Recording(model=tiny_llama(), args=_args(out, save, workers), train_dataset=ds)
        trainer.train(resume_from_checkpoint=resume)
        return list(log)

    per_epoch = len(CacheDataset(url, StreamConfig(tokens_per_item=T, batch_size=B, seed=1)))
    save = per_epoch + 2  # mid-epoch 1
    full = run(tmp_path / "a", save)
    assert [s for s, _ in full] == list(range(2 * per_epoch))
    checkpoint = tmp_path / "a" / f"checkpoint-{save}"
    data = json.loads((checkpoint / DATA_STATE_NAME.format(rank=0)).read_text())
    assert data["units_per_epoch"] == per_epoch
    assert data["loader"]["epoch"] == 1 and data["loader"]["num_sequences"] == 30

    _grow(url, make_sequences(25, seed=8, max_len=40), 30)  # a job appended meanwhile
    grown = CacheDataset(url, StreamConfig(tokens_per_item=T, batch_size=B, seed=1))
    assert grown.num_sequences == 55 and len(grown) > per_epoch
    resumed = run(tmp_path / "b", save, resume=str(checkpoint))
    assert resumed == [e for e in full if e[0] >= save]


def test_resume_refuses_a_damaged_data_state(tmp_path: Path) -> None:
    from logitcache.client import CacheDataset
    from logitcache.client.errors import ConfigError, StateError
    from logitcache.client.hf import DATA_STATE_NAME, CacheDistillTrainer

    url = tmp_path / "cache"
    build_cache(url, make_sequences(10, seed=3, max_len=30))
    ds = CacheDataset(url, StreamConfig(tokens_per_item=T, batch_size=B, seed=1))
    trainer = CacheDistillTrainer(
        model=tiny_llama(), args=_args(tmp_path / "o", 5, 0), train_dataset=ds
    )
    checkpoint = tmp_path / "checkpoint-5"
    checkpoint.mkdir()
    path = checkpoint / DATA_STATE_NAME.format(rank=0)
    good = {"loader": ds.state_dict(items_consumed=0), "units_per_epoch": len(ds)}
    path.write_text(json.dumps({**good, "units_per_epoch": "3"}))
    with pytest.raises(ConfigError, match="units_per_epoch"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    path.write_text(json.dumps({**good, "loader": {**good["loader"], "seed": 9}}))
    with pytest.raises(StateError, match="seed"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert not list((tmp_path / "o").glob("checkpoint-*"))  # nothing trained
    assert ds.state_dict() == good["loader"]  # the dataset is untouched


def test_trainer_trains_a_sampled_cache_with_sampled_targets(tmp_path: Path) -> None:
    import torch
    from logitcache.cache_format import CacheWriter, SequenceRecord
    from logitcache.cache_format.sampling import sample_rows, sampling_manifest, uniforms
    from logitcache.client import CacheDataset
    from logitcache.client.hf import CacheDistillTrainer
    from logitcache.client.loss import topk_distill_loss
    from logitcache.client.packing import packed_hidden_states

    url = tmp_path / "sampled"
    records = []
    for i, seq in enumerate(make_sequences(6, seed=2, min_len=5, max_len=30)):
        g = torch.Generator().manual_seed(i)
        lp = torch.log_softmax(torch.randn(len(seq) - 1, 97, generator=g) * 3, -1)
        ids, lw = sample_rows(lp, uniforms(1, f"s{i}", len(seq) - 1, 16))
        records.append(SequenceRecord(f"s{i}", seq, ids, lw))
    m = manifest(k=16, targets="sampled", sampling=sampling_manifest(16, 1.0, 1))
    with CacheWriter.open(str(url), m) as writer:
        writer.append(records)
    ds = CacheDataset(url, StreamConfig(tokens_per_item=T, batch_size=B, seed=1))
    model = tiny_llama()
    trainer = CacheDistillTrainer(model=model, args=_args(tmp_path / "o", 5, 0), train_dataset=ds)
    batch = next(iter(ds))
    got = trainer.compute_loss(model, batch).detach()
    hidden = packed_hidden_states(model, batch)
    want = topk_distill_loss(
        hidden,
        model.lm_head.weight,
        batch["topk_ids"],
        batch["topk_logprobs"],
        mask=batch["loss_mask"],
        targets="sampled",
    ).detach()
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    assert np.isfinite(float(got)) and float(got) > 0
