"""Hugging Face ``Trainer`` integration: distil a causal LM from a teacher cache, right under DDP.

:class:`CacheDistillTrainer` is a ``transformers.Trainer`` whose ``train_dataset`` is a
:class:`~logitcache.client.CacheDataset` (``batch_size = per_device_train_batch_size``). Per
micro-batch it runs the *wrapped* model on the packed batch
(:func:`~logitcache.client.packing.packed_hidden_states`: DDP's hooks fire, no document attends to
another) and trains the student's own ``lm_head`` with
:func:`~logitcache.client.loss.topk_distill_loss` (a ``targets="hidden"`` cache: with
:func:`~logitcache.client.loss.exact_distill_loss` against the cached hidden states and head)::

    loss = sum over counted rows of [ T**2 * KD(row) + ce_weight * CE(row) ] / N

where a row counts when ``loss_mask`` is true and ``N`` is the number of counted rows of the
whole optimizer step (every micro-batch of the accumulation window, summed across ranks). The
loss is multiplied by the number of processes because DDP averages gradients, so a step equals
one process training on the same global batch.

Sharding happens once, in the dataset: each rank's ``CacheDataset`` reads its own partition
(``rank=args.process_index, world_size=args.world_size``, checked). The training ``DataLoader``
is not passed through ``accelerate.prepare`` (for an ``IterableDataset`` it would dispatch rank
0's batches or shard a second time, and ``split_batches`` would cut the built batches); the
trainer also sets ``dispatch_batches=False, split_batches=False``.

DDP needs the same number of steps on every rank: a rank with fewer batches ends its epoch with
empty batches (one item of padding, ``loss_mask`` all false, adding 0 to the loss and to ``N``),
so every cached row is trained once per epoch. The epoch length is the largest rank's unit count
over the planned epochs (from the cache lengths; no data is read).

Resume: ``trainer.train(resume_from_checkpoint=...)`` continues the data stream exactly. Every
checkpoint holds, per rank, the dataset's state and the epoch length (:data:`DATA_STATE_NAME`);
a resumed ``train`` restores them before planning, so the resumed epoch is planned over the same
sequences even when the cache grew (``follow=True`` is refused: Trainer fixes the epoch length
when ``train()`` starts). Trainer's own mid-epoch skip drops the batches already trained; with
``dataloader_num_workers == 0`` they are not read (placeholders stand in for them). A checkpoint
without the file resumes over the cache as it is now, with a warning.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from .dataset import CacheDataset, worker_context
from .errors import ConfigError
from .packing import packed_hidden_states, unwrap_model
from .world import current_worker

__all__ = ["CacheDistillTrainer", "DATA_STATE_NAME", "RankEvenStream", "planned_units"]

#: File of a checkpoint folder holding one rank's data state: ``{"loader": <the dataset's
#: LoaderState dict, items_consumed 0: the position in the epoch is the trainer's global_step>,
#: "units_per_epoch": <batches per epoch of every rank>}``.
DATA_STATE_NAME = "logitcache_data-rank{rank}.json"
#: ``kd_loss`` values of a ``targets="hidden"`` cache (``exact_distill_loss``'s ``loss``).
EXACT_LOSSES = ("forward_kl", "reverse_kl", "jsd")
#: A collated batch of a :class:`CacheDataset`.
Batch = dict[str, Any]


def planned_units(ds: CacheDataset, epoch: int, rank: int) -> int:
    """Units (batches) ``rank`` yields in ``epoch``: ``len(ds)`` as rank ``rank`` of ``ds``'s
    world would see it in ``epoch`` (the dataset's own :meth:`CacheDataset.plan`, lengths only,
    no data read; plans of an epoch other than the current one are dropped at ``set_epoch``)."""
    return -(-ds.num_items(epoch, rank) // (ds.config.batch_size or 1))


class RankEvenStream(IterableDataset):
    """A rank's ``CacheDataset`` batches, then empty batches up to ``units_per_epoch``.

    Iterated by a ``DataLoader(batch_size=None)``; DataLoader worker ``w`` of ``n`` yields the
    units ``i`` with ``i % n == w`` (the dataset does so for its own units; padding units follow),
    so the loader's round-robin keeps the order for any ``num_workers``. ``skip_placeholders``:
    the next iteration first yields that many ``{}`` placeholders instead of reading the first
    units (only with ``num_workers=0``; used when Trainer skips already-trained batches).
    """

    def __init__(self, dataset: CacheDataset, units_per_epoch: int) -> None:
        super().__init__()
        self.dataset = dataset
        self.units_per_epoch = int(units_per_epoch)
        self.skip_placeholders = 0

    def __len__(self) -> int:
        return self.units_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the underlying dataset (its order)."""
        self.dataset.set_epoch(epoch)

    def empty_unit(self) -> dict[str, torch.Tensor]:
        """One item of padding: no token, no row (adds 0 to every loss and to every count)."""
        return self.dataset.padding_unit()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        worker, num_workers = current_worker()
        ds = self.dataset
        real = len(ds)
        if real > self.units_per_epoch:
            raise ConfigError(
                f"epoch {ds.epoch} has {real} batches on rank {ds.rank}, more than the "
                f"{self.units_per_epoch} planned: was the dataset refreshed during training?"
            )
        skip, self.skip_placeholders = self.skip_placeholders, 0
        if skip and num_workers == 1:
            skip = min(skip, real)
            for _ in range(skip):
                yield {}
            if skip:  # resume after the items of those units (all but the last are full)
                items = min(skip * (ds.config.batch_size or 1), ds.num_items())
                ds.load_state_dict(ds.state_dict(items_consumed=items))
        yield from ds
        for i in range(real, self.units_per_epoch):
            if i % num_workers == worker:
                yield self.empty_unit()


class _EpochLoader(DataLoader):
    """``DataLoader(batch_size=None)`` over a :class:`RankEvenStream`; forwards ``set_epoch``."""

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)  # type: ignore[attr-defined]


class _StreamSync(TrainerCallback):
    """Sets the stream's epoch at every epoch start (Trainer's resume path wraps the loader in a
    skipping loader that does not forward ``set_epoch``) and arms the placeholder skip."""

    def __init__(self, trainer: CacheDistillTrainer) -> None:
        self.trainer = trainer
        self.first_epoch = True

    def on_train_begin(self, *_: object, **__: object) -> None:
        self.first_epoch = True

    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: object
    ) -> None:
        stream = self.trainer._stream
        if stream is None:
            return
        steps = self.trainer._steps_per_epoch()
        stream.set_epoch(state.global_step // steps)
        if self.first_epoch and not args.ignore_data_skip and args.dataloader_num_workers == 0:
            done = state.global_step % steps  # optimizer steps of this epoch already trained
            stream.skip_placeholders = done * args.gradient_accumulation_steps
        self.first_epoch = False


class CacheDistillTrainer(Trainer):
    """``transformers.Trainer`` that distils from a :class:`CacheDataset` (module docstring).

    Extra keyword arguments (the rest go to ``Trainer``):

    * ``temperature``: divides the student logits (the teacher is used as cached; a hidden
      cache's teacher logits are divided too, as ``exact_distill_loss`` does); ``T**2`` scales
      the KD term.
    * ``ce_weight``: weight of the hard-label cross-entropy mixed in (0: pure KD).
    * ``kd_loss``: ``"forward_kl"`` (default), ``"reverse_kl"``, ``"renormalized_kl"``, ``"jsd"``
      (with ``beta``); see :func:`~logitcache.client.loss.topk_distill_loss`.
    * ``use_tail``: use the cached tail mass as one more bucket (default true; a sampled
      cache, FORMAT.md 4.4, has none: its batches train with ``targets="sampled"``, forward KL
      against the importance weights, so ``kd_loss`` must stay ``"forward_kl"``).
    * ``loss_impl``, ``chunk_size``: passed to ``topk_distill_loss`` (``chunk_size`` to
      ``exact_distill_loss`` too).

    A ``targets="hidden"`` cache trains with ``exact_distill_loss`` (``kd_loss``
    ``"forward_kl"``, ``"reverse_kl"`` or ``"jsd"``); its teacher head is read once from the
    ``train_dataset``'s source (:func:`~logitcache.client.load_head`, the rows' dtype, on the
    batch's device).

    ``train_dataset`` must be a ``CacheDataset`` with ``batch_size ==
    args.per_device_train_batch_size`` and this process's ``rank``/``world_size``. Refused:
    FSDP / DeepSpeed ZeRO-3 (the loss reads ``lm_head.weight`` outside the forward, where those
    shard it) and evaluation on a ``CacheDataset``. Planning the epoch length plans every
    planned epoch once from the cache's lengths (linear in the number of sequences, no data read).
    """

    loss_is_scaled_for_ga = True

    def __init__(
        self,
        *args: Any,
        temperature: float = 1.0,
        ce_weight: float = 0.0,
        kd_loss: str = "forward_kl",
        beta: float = 0.5,
        use_tail: bool = True,
        loss_impl: str = "auto",
        chunk_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:
            cfg = training_args.accelerator_config
            cfg.dispatch_batches = False
            cfg.split_batches = False
        super().__init__(*args, **kwargs)
        self.temperature = float(temperature)
        self.ce_weight = float(ce_weight)
        self.kd_loss = kd_loss
        self.beta = float(beta)
        self.use_tail = bool(use_tail)
        self.loss_impl = loss_impl
        self.chunk_size = chunk_size
        self._stream: RankEvenStream | None = None
        self._teacher_head: dict[str, Any] | None = None  # a hidden cache's (load_head)
        self._resume_units: int | None = None  # epoch length restored from a checkpoint
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if self.is_fsdp_enabled or getattr(plugin, "zero_stage", 0) == 3:
            raise ConfigError(
                "CacheDistillTrainer reads lm_head.weight outside the forward: FSDP and ZeRO-3 "
                "shard it there (use DDP or ZeRO-1/2)"
            )
        if isinstance(self.train_dataset, CacheDataset):
            self._check_dataset(self.train_dataset)
        self.add_callback(_StreamSync(self))

    # -- data ------------------------------------------------------------------------------
    def _check_dataset(self, ds: CacheDataset) -> None:
        a = self.args
        if ds.config.batch_size is None or ds.config.batch_size != a.per_device_train_batch_size:
            raise ConfigError(
                f"StreamConfig(batch_size={ds.config.batch_size}) must equal "
                f"per_device_train_batch_size={a.per_device_train_batch_size}"
            )
        if (ds.rank, ds.world_size) != (a.process_index, a.world_size):
            raise ConfigError(
                f"the CacheDataset is rank {ds.rank} of {ds.world_size} but this process is rank "
                f"{a.process_index} of {a.world_size}: build it with rank=args.process_index, "
                "world_size=args.world_size (or after TrainingArguments)"
            )
        if ds.target_kind == "hidden" and self.kd_loss not in EXACT_LOSSES:
            raise ConfigError(f"a hidden cache trains with kd_loss in {EXACT_LOSSES}")
        if a.dataloader_persistent_workers:
            raise ConfigError("dataloader_persistent_workers would keep a stale epoch; turn it off")
        if ds.config.follow:
            raise ConfigError(
                "CacheDistillTrainer needs follow=False: Trainer fixes the epoch length when "
                "train() starts (its step schedule and its resume arithmetic assume it), so "
                "sequences committed during the run cannot join a later epoch; to train on what "
                "a job committed since, build a new CacheDataset and start a new train()"
            )

    def _planned_epochs(self, first_len: int) -> int:
        a = self.args
        if a.max_steps and a.max_steps > 0:
            batches = a.max_steps * a.gradient_accumulation_steps
            return max(1, math.ceil(batches / max(first_len, 1)))
        return max(1, math.ceil(a.num_train_epochs))

    def _steps_per_epoch(self) -> int:
        ga = self.args.gradient_accumulation_steps
        n = len(self._stream) if self._stream is not None else 1
        return max(n // ga + int(n % ga > 0), 1)

    def get_train_dataloader(self) -> DataLoader:
        """A rank-local loader over the ``CacheDataset`` (not prepared by accelerate: see the
        module docstring), every rank yielding the same number of batches per epoch."""
        ds = self.train_dataset
        if not isinstance(ds, CacheDataset):
            return super().get_train_dataloader()
        self._check_dataset(ds)
        if self._resume_units is not None:  # the interrupted run's plan (train: checkpoint)
            units = self._resume_units
        else:
            ranks = range(ds.world_size)
            units = max(planned_units(ds, 0, r) for r in ranks)
            epochs = self._planned_epochs(units)
            seen = 1
            while seen < epochs:  # later epochs can plan a few more items on some rank
                units = max(units, *(planned_units(ds, seen, r) for r in ranks))
                seen += 1
                epochs = min(epochs, self._planned_epochs(units))
        self._stream = RankEvenStream(ds, units)
        workers = self.args.dataloader_num_workers
        context = worker_context(ds.source, workers, self.args.dataloader_multiprocessing_context)
        return _EpochLoader(
            self._stream,
            batch_size=None,
            num_workers=workers,
            pin_memory=self.args.dataloader_pin_memory,
            prefetch_factor=self.args.dataloader_prefetch_factor if workers > 0 else None,
            multiprocessing_context=context if workers > 0 else None,
        )

    # -- checkpoints -------------------------------------------------------------------------
    def train(
        self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        """``Trainer.train``; resuming from a checkpoint first restores this rank's data state
        (module docstring: the resumed epoch is planned over the same sequences)."""
        self._resume_units = None
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            from transformers.trainer_utils import get_last_checkpoint

            checkpoint = get_last_checkpoint(self.args.output_dir)  # None: Trainer raises
        if isinstance(checkpoint, (str, os.PathLike)) and isinstance(
            self.train_dataset, CacheDataset
        ):
            self._restore_data_state(os.fspath(checkpoint), self.train_dataset)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _restore_data_state(self, checkpoint: str, ds: CacheDataset) -> None:
        path = os.path.join(checkpoint, DATA_STATE_NAME.format(rank=ds.rank))
        if not os.path.isfile(path):
            warnings.warn(
                f"{path} is missing (a checkpoint written before logitcache saved its data "
                "state): the resumed epoch is planned over the cache as it is now, which "
                "changes its order if the cache grew since",
                stacklevel=3,
            )
            return
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        units = data.get("units_per_epoch") if isinstance(data, dict) else None
        if isinstance(units, bool) or not isinstance(units, int) or units < 1:
            raise ConfigError(f"{path}: 'units_per_epoch' must be an int >= 1, got {units!r}")
        ds.load_state_dict(data.get("loader"))  # StateError on a foreign or damaged state
        self._resume_units = units

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """``Trainer._save_checkpoint``, then this rank's data state (:data:`DATA_STATE_NAME`)."""
        super()._save_checkpoint(model, trial)
        ds = self.train_dataset
        if self._stream is None or not isinstance(ds, CacheDataset):
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = os.path.join(
            self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        )
        os.makedirs(folder, exist_ok=True)
        data = {
            "loader": ds.state_dict(items_consumed=0),
            "units_per_epoch": self._stream.units_per_epoch,
        }
        path = os.path.join(folder, DATA_STATE_NAME.format(rank=ds.rank))
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, path)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        """Refuses a ``CacheDataset``: accelerate would shard it a second time and ranks with
        fewer batches would stall the evaluation gather (evaluate with your own loop)."""
        ds = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(ds, CacheDataset) or (
            isinstance(ds, dict) and any(isinstance(v, CacheDataset) for v in ds.values())
        ):
            raise ConfigError("CacheDistillTrainer does not evaluate on a CacheDataset")
        return super().get_eval_dataloader(eval_dataset)

    def get_batch_samples(
        self, epoch_iterator: Iterator, num_batches: int, device: torch.device
    ) -> tuple[list, torch.Tensor | int | None]:
        """The next ``num_batches`` micro-batches and ``N``: their counted rows (``loss_mask``)
        summed over this step's micro-batches and over all ranks."""
        batches: list = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        if not batches or "loss_mask" not in batches[0]:
            return batches, super()._get_num_items_in_batch(batches, device)
        count = torch.tensor(sum(int(b["loss_mask"].sum()) for b in batches), device=device)
        if self.accelerator.num_processes > 1:
            count = self.accelerator.reduce(count, reduction="sum")
        return batches, count

    # -- loss ------------------------------------------------------------------------------
    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: Batch,
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``sum_rows loss / N * num_processes`` (module docstring); the student's own lm_head."""
        if "topk_ids" not in inputs and "hidden" not in inputs:
            raise ConfigError("CacheDistillTrainer needs CacheDataset batches (topk_ids or hidden)")
        hidden = packed_hidden_states(model, inputs)
        head = unwrap_model(model).get_output_embeddings()
        if "hidden" in inputs:
            total = self._exact_total(hidden, head, inputs)
        else:
            total = self._topk_total(hidden, head, inputs)
        if num_items_in_batch is None:  # e.g. evaluation: this batch's mean
            loss = total / inputs["loss_mask"].sum().clamp_min(1)
        else:
            n = torch.as_tensor(num_items_in_batch, device=total.device).clamp_min(1)
            loss = total / n * self.accelerator.num_processes
        return (loss, {"hidden_states": hidden}) if return_outputs else loss

    def _topk_total(self, hidden: torch.Tensor, head: nn.Linear, inputs: Batch) -> torch.Tensor:
        """Summed loss of a top-k or sampled cache's batch."""
        from .loss import topk_distill_loss

        ds = self.train_dataset
        kind = ds.target_kind if isinstance(ds, CacheDataset) else "topk"
        kind = str(inputs.get("target_kind", kind))
        return topk_distill_loss(
            hidden,
            head.weight,
            inputs["topk_ids"],
            inputs["topk_logprobs"],
            inputs["tail_mass"] if self.use_tail and kind == "topk" else None,
            bias=getattr(head, "bias", None),
            impl=self.loss_impl,
            targets=kind,
            **self._loss_options(inputs),
        )

    def _loss_options(self, inputs: Batch) -> dict[str, Any]:
        """The options the top-k and the exact loss share: labels, mask and this trainer's
        objective, summed over the batch."""
        return {
            "labels": inputs["labels"],
            "mask": inputs["loss_mask"],
            "loss": self.kd_loss,
            "beta": self.beta,
            "temperature": self.temperature,
            "ce_weight": self.ce_weight,
            "reduction": "sum",
            "chunk_size": self.chunk_size,
        }

    def _exact_total(self, hidden: torch.Tensor, head: nn.Linear, inputs: Batch) -> torch.Tensor:
        """Summed exact loss of a hidden cache's batch (the teacher head loaded once)."""
        from .hidden import load_head
        from .loss import exact_distill_loss

        if self._teacher_head is None:
            ds = self.train_dataset
            if not isinstance(ds, CacheDataset):
                raise ConfigError("hidden batches need their CacheDataset as train_dataset")
            self._teacher_head = load_head(
                ds.source, device=hidden.device, dtype=inputs["hidden"].dtype
            )
        return exact_distill_loss(
            hidden,
            head.weight,
            inputs["hidden"],
            student_bias=getattr(head, "bias", None),
            **self._loss_options(inputs),
            **self._teacher_head,
        )


def hf_iterable(ds: CacheDataset) -> Any:
    """``ds`` as a ``datasets.IterableDataset`` (one example per item or batch ``ds`` yields,
    numpy arrays with declared features; ``.with_format("torch")`` gives tensors back)::

        hf = hf_iterable(CacheDataset(url, StreamConfig(tokens_per_item=2048, seed=0)))

    It reads ``ds`` as configured (its rank partition, epoch and resume point) each time it is
    iterated; do not let a second layer shard it again (e.g. ``split_dataset_by_node``). Units
    of a sampled cache keep the full ``k`` columns here (the features fix the shape; no
    ``trim_sampled``) and carry ``target_kind``; a hidden cache's carry it and ``hidden [.., T,
    d]`` as float32 (Arrow has no bfloat16; exact: ``.bfloat16()`` gives the rows back)."""
    import datasets

    t, k = ds.config.tokens_per_item, ds.k
    ids = "int64" if ds.config.ids_dtype == torch.int64 else "int32"
    lead = () if ds.config.batch_size is None else (None,)

    def arr(dtype: str, *shape: int) -> Any:
        dims = (*lead, *shape)
        if len(dims) == 1:
            return datasets.Sequence(datasets.Value(dtype), length=dims[0] or -1)
        return getattr(datasets, f"Array{len(dims)}D")(shape=dims, dtype=dtype)

    targets = {"topk_ids": arr(ids, t, k), "topk_logprobs": arr("float32", t, k)}
    targets["tail_mass"] = arr("float32", t)
    if ds.hidden_dim is not None:
        targets = {"hidden": arr("float32", t, ds.hidden_dim)}
    tokens = ("input_ids", "labels", "attention_mask", "position_ids", "segment_ids")
    features = datasets.Features(
        {**{n: arr("int64", t) for n in tokens}, **targets, "loss_mask": arr("bool", t)}
    )
    if ds.target_kind != "topk":  # sampled and hidden units carry their kind
        features["target_kind"] = datasets.Value("string")
    return datasets.IterableDataset.from_generator(
        _numpy_items, gen_kwargs={"ds": ds}, features=features
    )


def _numpy_items(ds: CacheDataset) -> Iterator[dict[str, np.ndarray]]:
    # full width: the features declare [..., k] (a sampled cache's units are not trimmed here)
    for unit in ds._iterate(trim=False):
        if "hidden" in unit:  # bfloat16 widened to the declared float32 (exact)
            unit["hidden"] = unit["hidden"].float()
        yield {n: v.numpy() if isinstance(v, torch.Tensor) else v for n, v in unit.items()}


def hf_sequences(url: str, storage_options: dict | None = None) -> Any:
    """The cache's sequences as a ``datasets.IterableDataset``, one example per cached sequence
    (``key``, ``input_ids [L]``, ``topk_ids [L-1, k]``, ``topk_logprobs [L-1, k]``,
    ``tail_mass [L-1]``; row ``j`` is the distribution of token ``j + 1``)::

        seqs = hf_sequences("./caches/corpus-k20")

    Unpacked and unsharded (a ``datasets`` pipeline, ``split_dataset_by_node`` or ``map`` decide);
    for training batches use :class:`CacheDataset` / :func:`hf_iterable`."""
    import datasets
    from logitcache.cache_format import CacheReader

    k = int(CacheReader(url, storage_options).manifest.k)
    features = datasets.Features(
        {
            "key": datasets.Value("string"),
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "topk_ids": datasets.Array2D(shape=(None, k), dtype="int32"),
            "topk_logprobs": datasets.Array2D(shape=(None, k), dtype="float32"),
            "tail_mass": datasets.Sequence(datasets.Value("float32")),
        }
    )
    shards = {"url": [url], "storage_options": [storage_options]}
    return datasets.IterableDataset.from_generator(
        _sequence_examples, gen_kwargs=shards, features=features
    )


def _sequence_examples(url: list[str], storage_options: list[dict | None]) -> Iterator[dict]:
    from logitcache.cache_format import CacheReader

    for u, opts in zip(url, storage_options, strict=True):
        reader = CacheReader(u, opts)
        n = reader.num_sequences
        for start in range(0, n, 256):
            for rec in reader.sequences(range(start, min(start + 256, n))):
                yield {
                    "key": rec.key or "",
                    "input_ids": rec.input_ids,
                    "topk_ids": rec.topk_ids,
                    "topk_logprobs": rec.topk_logprobs.astype(np.float32),
                    "tail_mass": rec.tail_or_computed().astype(np.float32),
                }
