"""Prompt logprobs as arrays, straight from the engine core's tensors (no Python lists).

vLLM 0.32's output processor (``vllm/v1/engine/logprobs.py::LogprobsProcessor``, in the
process that owns the ``LLMEngine``/``AsyncLLM``) receives each prefill chunk's prompt logprobs
as tensors ``token_ids [n, k+1]``, ``logprobs [n, k+1]`` (column 0: the actual next token, then
the top-k by rank) and turns them into a ``FlatLogprobs`` of Python lists, one object per value;
the service then reads those lists back into arrays. Both steps cost tens of CPU-us per position
at k=100 (benchmarks/results/server.md). :func:`install` wraps two methods of that class, once
per process, so that a request whose ``SamplingParams.extra_args`` carry :data:`FLAG` keeps the
chunks as numpy arrays in a :class:`TensorPromptLogprobs` instead; every other request (any
other vLLM user in the process) takes vLLM's own path unchanged.

If the vLLM in use lacks the hooks (another version), :func:`install` returns False and the
engine keeps asking for the list form.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .patching import patch_once

#: ``SamplingParams.extra_args`` key that selects the array form for a request.
FLAG = "logitcache_prompt_logprob_arrays"


class TensorPromptLogprobs:
    """The prompt logprobs of one request, chunk by chunk, as the rows the cache stores: per
    chunk ``token_ids`` int32 and ``logprobs`` float32 arrays ``[n_chunk, k]`` (C order; row
    ``j`` of the concatenation is prompt position ``j + 1``; the top-k by descending logprob),
    and ``first`` int64 ``[n_chunk]``, the engine core's column 0 (the actual token, or the
    sampling hook's marker, ``vllm_sampling.MARK``).

    ``add`` copies each chunk once, straight into those dtypes and without column 0 (issue #19:
    the int64 copy, then its int32 cast and the logprobs' contiguous copy in ``make_scores``
    cost ~1 CPU-us/position at k=100); token ids are below the vocabulary size, so int32 holds
    them (an id past it is refused by the writer's checks, FORMAT.md W1)."""

    def __init__(self) -> None:
        self.token_ids: list[np.ndarray] = []
        self.logprobs: list[np.ndarray] = []
        self.first: list[np.ndarray] = []

    def add(self, token_ids: Any, logprobs: Any) -> None:
        # copies: the tensors may be views of buffers the engine reuses
        ids = token_ids.numpy()
        self.first.append(np.array(ids[:, 0], dtype=np.int64, copy=True))
        self.token_ids.append(np.array(ids[:, 1:], dtype=np.int32, order="C", copy=True))
        self.logprobs.append(
            np.array(logprobs.numpy()[:, 1:], dtype=np.float32, order="C", copy=True)
        )

    @property
    def num_rows(self) -> int:
        return sum(len(c) for c in self.token_ids)

    def __len__(self) -> int:  # prompt positions, like vLLM's containers (position 0 included)
        return self.num_rows + 1

    def rows(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(topk_ids [L-1, k] int32, topk_logprobs [L-1, k] float32)`` (C order when the
        request asked for ``k``: no copy for a one-chunk prompt)."""
        if not self.token_ids:
            return np.empty((0, k), np.int32), np.empty((0, k), np.float32)
        ids = np.concatenate(self.token_ids) if len(self.token_ids) > 1 else self.token_ids[0]
        lps = np.concatenate(self.logprobs) if len(self.logprobs) > 1 else self.logprobs[0]
        if ids.shape[1] == k:
            return ids, lps
        return ids[:, :k], lps[:, :k]

    def column0(self) -> np.ndarray:
        """The engine core's column 0 of every row (int64 ``[L-1]``)."""
        if not self.first:
            return np.empty(0, np.int64)
        return np.concatenate(self.first) if len(self.first) > 1 else self.first[0]


@patch_once
def install() -> None:
    """Wrap vLLM's ``LogprobsProcessor`` (once per process, :func:`.patching.patch_once`):
    ``install()`` is True when the array form is available, False if this vLLM lacks the
    hooks."""
    from vllm.v1.engine.logprobs import LogprobsProcessor

    original_new = LogprobsProcessor.from_new_request.__func__
    original_update = LogprobsProcessor._update_prompt_logprobs

    def from_new_request(cls: Any, tokenizer: Any, request: Any) -> Any:
        proc = original_new(cls, tokenizer, request)
        extra = getattr(request.sampling_params, "extra_args", None) or {}
        if extra.get(FLAG) and proc.prompt_logprobs is not None:
            proc.prompt_logprobs = TensorPromptLogprobs()
        return proc

    def update_prompt_logprobs(self: Any, tensors: Any) -> None:
        if isinstance(self.prompt_logprobs, TensorPromptLogprobs):
            token_ids, logprobs, *_ = tensors
            self.prompt_logprobs.add(token_ids, logprobs)
            return
        original_update(self, tensors)

    LogprobsProcessor.from_new_request = classmethod(from_new_request)
    LogprobsProcessor._update_prompt_logprobs = update_prompt_logprobs
