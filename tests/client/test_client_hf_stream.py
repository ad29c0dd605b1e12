"""``RankEvenStream``: every rank the same number of batches, any ``num_workers``, cheap skips."""

from __future__ import annotations

from pathlib import Path

import pytest
from client_support import build_cache, make_sequences, tiny_llama


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("stream") / "cache"
    build_cache(path, make_sequences(30, seed=7, max_len=40))
    return path


def _ds(url: Path, rank: int, **kw: int) -> object:
    from logitcache.client import CacheDataset

    return CacheDataset(
        url, tokens_per_item=40, batch_size=2, seed=1, rank=rank, world_size=2, **kw
    )


def _ids(units: list) -> list:
    return [u["input_ids"].numpy().tolist() if u else None for u in units]


LANES = {"shuffle_block_size": 4, "shuffle_window": 2, "lanes": 3}


@pytest.mark.parametrize("shuffle", [{}, LANES])
def test_ranks_padded_to_the_same_length_with_empty_batches(url: Path, shuffle: dict) -> None:
    from logitcache.client.hf import RankEvenStream, planned_units

    ranks = [_ds(url, r, **shuffle) for r in (0, 1)]
    counts = [planned_units(ranks[0], 0, r) for r in (0, 1)]  # rank 0 plans rank 1's epoch too
    assert counts == [len(d) for d in ranks]  # the planner agrees with each rank's dataset
    ranks[1].set_epoch(1)
    assert planned_units(ranks[0], 1, 1) == len(ranks[1])
    units = max(counts) + 1  # one more than the longest rank: padding on every rank
    for ds, count in zip(ranks, counts, strict=True):
        got = list(RankEvenStream(ds, units))
        assert len(got) == units
        assert all(int(u["loss_mask"].sum()) > 0 for u in got[:count])
        for pad in got[count:]:
            assert not pad["loss_mask"].any() and (pad["labels"] == -100).all()
            assert pad["topk_ids"].shape[-1] == ds.k and pad["input_ids"].shape == (1, 40)


@pytest.mark.slow
def test_workers_keep_the_order(url: Path) -> None:
    from logitcache.client.hf import RankEvenStream, _EpochLoader

    ds = _ds(url, 1)
    units = len(ds) + 3
    plain = _ids(list(RankEvenStream(ds, units)))
    loader = _EpochLoader(RankEvenStream(ds, units), batch_size=None, num_workers=2)
    assert _ids(list(loader)) == plain


def test_placeholders_stand_in_for_skipped_batches(url: Path) -> None:
    from logitcache.client.hf import RankEvenStream

    ds = _ds(url, 0)
    units = len(ds) + 1
    full = _ids(list(RankEvenStream(ds, units)))
    for skip in (1, 3, units):
        stream = RankEvenStream(ds, units)
        stream.skip_placeholders = skip
        got = list(stream)
        # real batches are replaced (not read); padding batches are cheap and stay: the stream
        # keeps its length, so a consumer dropping the first `skip` sees exactly full[skip:]
        held = min(skip, len(ds))
        assert len(got) == units and got[:held] == [{}] * held
        assert _ids(got[held:]) == full[held:]
        assert stream.skip_placeholders == 0  # armed for one iteration only


def test_trainer_refuses_a_dataset_it_would_shard_wrongly(url: Path, tmp_path: Path) -> None:
    from logitcache.client import CacheDataset
    from logitcache.client.errors import ConfigError
    from logitcache.client.hf import CacheDistillTrainer
    from transformers import TrainingArguments

    model = tiny_llama()
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=2, report_to=[])

    def trainer(**ds_kw: object) -> CacheDistillTrainer:
        ds = CacheDataset(url, tokens_per_item=40, seed=1, **ds_kw)
        return CacheDistillTrainer(model=model, args=args, train_dataset=ds)

    with pytest.raises(ConfigError, match="batch_size"):
        trainer(batch_size=4)
    with pytest.raises(ConfigError, match="rank 1 of 2"):
        trainer(batch_size=2, rank=1, world_size=2)
    with pytest.raises(ConfigError, match="follow=False"):
        trainer(batch_size=2, follow=True)
    ok = trainer(batch_size=2)
    assert ok.args.accelerator_config.dispatch_batches is False
    assert len(ok.get_train_dataloader()) == len(ok.train_dataset)
    with pytest.raises(ConfigError, match="evaluate"):
        ok.get_eval_dataloader(ok.train_dataset)


@pytest.mark.slow
def test_trainer_resume_with_dataloader_workers(url: Path, tmp_path: Path) -> None:
    """With ``dataloader_num_workers > 0`` Trainer's skip reads and drops the trained batches;
    the resumed run (mid-epoch 1) must train the same documents in the same steps."""
    from logitcache.client import CacheDataset
    from logitcache.client.hf import CacheDistillTrainer
    from transformers import TrainingArguments

    log: list[tuple[int, list]] = []

    class Recording(CacheDistillTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            log.append((self.state.global_step, inputs["input_ids"].tolist()))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def run(out: Path, save: int, resume: str | None = None) -> list:
        args = TrainingArguments(
            str(out),
            per_device_train_batch_size=2,
            num_train_epochs=2,
            save_steps=save,
            report_to=[],
            dataloader_num_workers=2,
            disable_tqdm=True,
            seed=0,
        )
        ds = CacheDataset(url, tokens_per_item=40, batch_size=2, seed=1)
        log.clear()
        Recording(model=tiny_llama(), args=args, train_dataset=ds).train(
            resume_from_checkpoint=resume
        )
        return list(log)

    per_epoch = len(CacheDataset(url, tokens_per_item=40, batch_size=2, seed=1))
    save = per_epoch + 2
    full = run(tmp_path / "a", save)
    assert [s for s, _ in full] == list(range(2 * per_epoch))
    resumed = run(tmp_path / "b", save, resume=str(tmp_path / "a" / f"checkpoint-{save}"))
    assert resumed == [e for e in full if e[0] >= save]
