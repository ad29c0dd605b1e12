"""logitcache.client: what a trainer imports.

* :class:`TeacherClient` / :class:`AsyncTeacherClient`: the teacher service over HTTP (score on
  demand, batch jobs with a progress bar, caches), with retries and typed errors
  (:mod:`logitcache.client.errors`).
* :class:`CacheDataset` (+ :class:`CacheDataLoader`): a torch ``IterableDataset`` of aligned
  top-k items read from a cache store (local or ``s3://``) or over HTTP, shaped by a
  :class:`StreamConfig` (order, packing, sharding) and read as :class:`ReadOptions` say
  (threads, processes, prefetch); deterministic shuffling, exact mid-epoch resume.
* :func:`open_source`: a store location or server URL as a cache source.
* The loss is :mod:`logitcache.client.loss` (``topk_distill_loss``, ``TopKDistillLoss``;
  ``exact_distill_loss`` with :func:`load_head` for a hidden cache, :mod:`.hidden`).
* :mod:`~logitcache.client.packing`, :mod:`~logitcache.client.hf` (HF ``Trainer``, needs the
  ``hf`` extra), :mod:`~logitcache.client.interop` (parquet for axolotl / DistillKit),
  :mod:`~logitcache.client.cli` (the ``logitcache`` command): imported on demand.

Names are loaded on first use, so importing this package (or its CLI) loads neither torch nor
httpx. Never imports ``logitcache.server``, ``vllm`` or ``fastapi``.

Quick start (the training loop is README's "In a trainer" block, executed by
``tests/client/test_client_hf_readme.py``)::

    import torch
    from logitcache.client import CacheDataLoader, CacheDataset, StreamConfig, TeacherClient
    from logitcache.client.loss import topk_distill_loss
    from logitcache.client.packing import packed_hidden_states

    with TeacherClient("http://127.0.0.1:8000", api_key=KEY) as teacher:
        teacher.run_job("corpus", texts=texts)          # tqdm bar over the job's tokens

    ds = CacheDataset("s3://bucket/caches/corpus-k20",
                      StreamConfig(tokens_per_item=2048, mode="pack", batch_size=8, seed=0),
                      tokenizer=student_tokenizer, vocab_size=student.config)
    model = student              # or torch.nn.parallel.DistributedDataParallel(student)
    opt = torch.optim.AdamW(student.parameters(), lr=3e-4)
    loader = CacheDataLoader(ds, num_workers=2)
    for epoch in range(2):
        ds.set_epoch(epoch)
        for batch in loader:     # position t: target token t+1 and cache row t
            h = packed_hidden_states(model, batch)
            loss = topk_distill_loss(h, student.lm_head.weight, batch["topk_ids"],
                                     batch["topk_logprobs"], batch["tail_mass"],
                                     mask=batch["loss_mask"])
            loss.backward()
            opt.step()
            opt.zero_grad()
            state = loader.state_dict()  # save with checkpoints; resume: load_state_dict

``packed_hidden_states`` keeps the documents of a packed item apart and calls the model it is
given, so the DDP wrapper's hooks run (:mod:`logitcache.client.packing`). With the Hugging Face
``Trainer``: :class:`logitcache.client.hf.CacheDistillTrainer` (README).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import ReadOptions, StreamConfig
    from .dataset import CacheDataLoader, CacheDataset
    from .hidden import load_head
    from .http import AsyncTeacherClient, TeacherClient
    from .sources import open_source

#: Public name -> the module defining it (loaded on first use).
_WHERE = {
    "AsyncTeacherClient": "http",
    "CacheDataLoader": "dataset",
    "CacheDataset": "dataset",
    "ReadOptions": "config",
    "StreamConfig": "config",
    "TeacherClient": "http",
    "load_head": "hidden",
    "open_source": "sources",
}

__all__ = [
    "AsyncTeacherClient",
    "CacheDataLoader",
    "CacheDataset",
    "ReadOptions",
    "StreamConfig",
    "TeacherClient",
    "load_head",
    "open_source",
]


def __getattr__(name: str) -> object:
    """Load a public name from its module on first use."""
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
