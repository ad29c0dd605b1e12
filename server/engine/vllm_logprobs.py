"""Prompt logprobs as arrays, straight from the engine core's tensors (no Python lists).

vLLM's ``LogprobsProcessor`` turns each prefill chunk's ``[n, k+1]`` tensors into Python lists,
one object per value. :func:`install` wraps it so a request whose ``extra_args`` carry
:data:`FLAG` keeps the chunks as numpy arrays in a :class:`TensorPromptLogprobs`; every other
request takes vLLM's path. A vLLM without the hooks makes :func:`install` False.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .patching import patch_once

#: ``SamplingParams.extra_args`` key that selects the array form for a request.
FLAG = "logitcache_prompt_logprob_arrays"


#: vLLM release series whose prompt-logprob tensors the hook may keep as views. In
#: these, the model runner (``GPUModelRunner._get_prompt_logprobs_dict``, also the CPU runner's)
#: allocates one ``LogprobsTensors.empty_cpu(L - 1, k + 1)`` per request (int32 ids, float32
#: logprobs), fills it chunk by chunk, hands it over once, when the prompt is complete, and drops
#: its own reference (``in_progress_prompt_logprobs_cpu = None``); in the multiprocess mode the
#: client's decoder makes the tensors views of their received message frames, one per message.
#: Neither buffer is written again, and a view keeps it alive. Another series: copies.
VIEW_SERIES = ("0.32.",)
_views: list[bool] = []  # the answer for the vLLM in this process, once asked


def keep_views() -> bool:
    """Whether :meth:`TensorPromptLogprobs.add` keeps views (the installed vLLM is of a
    :data:`VIEW_SERIES`), decided once per process."""
    if not _views:
        try:
            from vllm import __version__ as version
        except ImportError:
            version = ""
        _views.append(str(version).startswith(VIEW_SERIES))
    return _views[0]


class TensorPromptLogprobs:
    """The prompt logprobs of one request, chunk by chunk, as the rows the cache stores: per chunk
    int32 ``token_ids`` and float32 ``logprobs`` ``[n_chunk, k + 1]``, column 0 the engine core's
    (the actual token, or the hook's marker), columns ``1..k`` the top-k. ``add`` keeps the
    engine's buffers as views when :func:`keep_views` allows (else copies each chunk once);
    :meth:`rows` gives columns ``1..k`` as strided views the writer's encode reads in place."""

    def __init__(self) -> None:
        self.token_ids: list[np.ndarray] = []
        self.logprobs: list[np.ndarray] = []

    def add(self, token_ids: Any, logprobs: Any) -> None:
        ids, lps = token_ids.numpy(), logprobs.numpy()
        if not (
            keep_views()
            and ids.dtype == np.int32
            and lps.dtype == np.float32
            and ids.flags.c_contiguous
            and lps.flags.c_contiguous
        ):
            ids = np.array(ids, dtype=np.int32, order="C", copy=True)
            lps = np.array(lps, dtype=np.float32, order="C", copy=True)
        self.token_ids.append(ids)
        self.logprobs.append(lps)

    @property
    def num_rows(self) -> int:
        return sum(len(c) for c in self.token_ids)

    def __len__(self) -> int:  # prompt positions, like vLLM's containers (position 0 included)
        return self.num_rows + 1

    @property
    def width(self) -> int:
        """The engine's row width, ``k + 1`` (0 before any chunk)."""
        return int(self.token_ids[0].shape[1]) if self.token_ids else 0

    def rows(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(topk_ids [L-1, k] int32, topk_logprobs [L-1, k] float32)``: columns ``1..k``
        (views with strided rows for a one-chunk prompt; concatenated, C order, otherwise)."""
        if not self.token_ids:
            return np.empty((0, k), np.int32), np.empty((0, k), np.float32)
        if len(self.token_ids) == 1:
            return self.token_ids[0][:, 1 : k + 1], self.logprobs[0][:, 1 : k + 1]
        ids = np.concatenate([c[:, 1 : k + 1] for c in self.token_ids])
        return ids, np.concatenate([c[:, 1 : k + 1] for c in self.logprobs])

    def last_column(self) -> tuple[np.ndarray, np.ndarray]:
        """The ids (int64) and values (float32) of every row's last column, ``[L-1]`` each."""
        if not self.token_ids:
            return np.empty(0, np.int64), np.empty(0, np.float32)
        ids = np.concatenate([c[:, -1] for c in self.token_ids], dtype=np.int64)
        return ids, np.concatenate([c[:, -1] for c in self.logprobs], dtype=np.float32)

    def column0_values(self) -> np.ndarray:
        """The engine core's column 0 values of every row (float32 ``[L-1]``): the logprob of
        the row's next prompt token (vLLM's, and the worker hook's)."""
        if not self.logprobs:
            return np.empty(0, np.float32)
        return np.concatenate([c[:, 0] for c in self.logprobs], dtype=np.float32)

    def column0(self) -> np.ndarray:
        """The engine core's column 0 of every row (int64 ``[L-1]``)."""
        if not self.token_ids:
            return np.empty(0, np.int64)
        return np.concatenate([c[:, 0] for c in self.token_ids], dtype=np.int64)


@patch_once
def install() -> None:
    """Wrap vLLM's ``LogprobsProcessor`` (once per process); True when the array form is
    available."""
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
