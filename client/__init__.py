"""logitcache.client: what a trainer imports.

* :class:`TeacherClient` / :class:`AsyncTeacherClient`: the teacher service over HTTP (score on
  demand, batch jobs with a progress bar, caches), with retries and typed errors.
* :class:`CacheDataset` (+ :class:`CacheDataLoader`): a torch ``IterableDataset`` of aligned
  top-k items read from a cache store (local or ``s3://``) or over HTTP; deterministic shuffling,
  rank/worker sharding, exact mid-epoch resume, background prefetch.
* :func:`check_compatible`: the tokenizer / vocab guard the dataset applies.
* The loss (``topk_distill_loss`` ...) is re-exported lazily from :mod:`logitcache.client.loss`.
* :mod:`~logitcache.client.packing`, :mod:`~logitcache.client.hf` (HF ``Trainer``, needs the
  ``hf`` extra), :mod:`~logitcache.client.interop` (parquet for axolotl / DistillKit): imported
  on demand, not by this package.

Never imports ``logitcache.server``, ``vllm`` or ``fastapi``.

Quick start (the training loop is README's "In a trainer" block, executed by
``tests/test_client_hf_readme.py``)::

    import torch
    from logitcache.client import CacheDataLoader, CacheDataset, TeacherClient
    from logitcache.client.loss import topk_distill_loss
    from logitcache.client.packing import packed_hidden_states

    with TeacherClient("http://127.0.0.1:8000", api_key=KEY) as teacher:
        teacher.run_job("corpus", texts=texts)          # tqdm bar over the job's tokens

    ds = CacheDataset("s3://bucket/caches/corpus-k20", tokens_per_item=2048, mode="pack",
                      batch_size=8, seed=0, tokenizer=student_tokenizer, vocab_size=student.config)
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

``packed_hidden_states`` (:mod:`logitcache.client.packing`) keeps the documents of a packed item
apart (position ids, no attention mask, ``use_cache=False``; calling ``student.model(...)``
with the default cache lets them attend to each other) and calls the model it is given, so the
DDP wrapper's hooks run. With the Hugging Face ``Trainer``: :class:`logitcache.client.hf.
CacheDistillTrainer` (README); as a ``datasets.IterableDataset``:
:func:`logitcache.client.hf.hf_iterable`; files for axolotl / DistillKit:
:mod:`logitcache.client.interop` (``logitcache export --format parquet|distillkit``,
``logitcache import``).
"""

from __future__ import annotations

import importlib
from typing import Any

from .collate import IGNORE_INDEX, ITEM_FIELDS
from .dataset import CacheDataLoader, CacheDataset
from .errors import (
    AuthError,
    BadRequestError,
    ClientError,
    ConfigError,
    ConflictError,
    CutSequenceWarning,
    IncompatibleCacheError,
    JobFailedError,
    JobTimeoutError,
    NotFoundError,
    PayloadTooLargeError,
    RateLimitedError,
    ServerError,
    SourceError,
    StateError,
    TeacherHTTPError,
    TransportError,
)
from .guards import check_compatible
from .http import AsyncTeacherClient, TeacherClient
from .sources import CacheSource, HttpSource, LocalSource, open_source
from .state import LoaderState

__all__ = [
    "IGNORE_INDEX",
    "ITEM_FIELDS",
    "AsyncTeacherClient",
    "AuthError",
    "BadRequestError",
    "CacheDataLoader",
    "CacheDataset",
    "CacheSource",
    "ClientError",
    "ConfigError",
    "ConflictError",
    "CutSequenceWarning",
    "HttpSource",
    "IncompatibleCacheError",
    "JobFailedError",
    "JobTimeoutError",
    "LoaderState",
    "LocalSource",
    "NotFoundError",
    "PayloadTooLargeError",
    "RateLimitedError",
    "ServerError",
    "SourceError",
    "StateError",
    "TeacherClient",
    "TeacherHTTPError",
    "TransportError",
    "check_compatible",
    "open_source",
]


def __getattr__(name: str) -> Any:
    """Lazy re-export of the loss package's public names (``from logitcache.client import
    topk_distill_loss``) so that importing the client does not import the loss."""
    if name.startswith("_"):
        raise AttributeError(name)
    try:
        loss = importlib.import_module(f"{__name__}.loss")
    except ImportError as exc:  # the loss package is optional for data-only users
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} ({exc})") from exc
    if name in getattr(loss, "__all__", ()):
        return getattr(loss, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
