"""Sampled targets inside vLLM's worker: draws from the full distribution at prompt positions.

vLLM 0.32 computes prompt logprobs in the model runner
(``vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._get_prompt_logprobs_dict``, also used by
the CPU runner): per request and prefill chunk it takes the chunk's hidden states, computes the
full ``[n, V]`` logits and log-softmax, and keeps the top ``prompt_logprobs`` of each row
(``Sampler.gather_logprobs``). Its logits processors (``vllm.v1.sample.logits_processor``) only
see the positions being *generated*, never prompt positions, so no public hook reaches the whole
distribution of a prompt position; asking for ``prompt_logprobs = V`` does, but ships ``V``
values per position out of the engine (measured 14.8x the time of top-k scoring,
``benchmarks/distill_vllm_sampling.py``).

:func:`install` wraps ``_get_prompt_logprobs_dict`` (once per process) so that for a request
whose ``SamplingParams.extra_args`` carry :data:`FLAG` = ``{"seed", "draws", "tau", "head"}`` it
samples right where the ``[n, V]`` block exists:
``sample_rows(log_softmax(logits), u, tau, head=head)`` (``head`` absent: 0)
of :mod:`logitcache.cache_format.sampling` (FORMAT.md 4.4), with ``u`` the rows
``[start, start + n)`` of :func:`~logitcache.cache_format.sampling.seeded_uniforms` of the
request's sequence seed, so a chunked prefill draws exactly what one pass would. The request's
prompt-logprob tensors then hold ``[L - 1, head + draws + 1]``: column 0 the marker id
:data:`MARK` (``-1``; vLLM puts the prompt token there), columns ``1..head + draws`` the row's ids
and their log-weights. Every other request takes vLLM's own code unchanged. Only
``head + draws + 1`` values per position leave the worker, like top-k scoring at
``k = head + draws``.

The wrapper must be installed in the process that runs the model runner. The engine names
:class:`SamplingWorkerExtension` as vLLM's ``worker_extension_cls``; vLLM imports it in every
worker process it starts (``WorkerWrapperBase.init_worker``), and importing this module
installs the wrapper there. The service checks the marker column of every answer, so a worker
without the wrapper is an :class:`~.protocol.EngineError`, never top-k rows taken for samples.
"""

from __future__ import annotations

from typing import Any

from .patching import patch_once

#: ``SamplingParams.extra_args`` key of a sampled request: ``{"seed", "draws", "tau", "head"}``.
FLAG = "logitcache_sampled_targets"
#: Id written in column 0 of a sampled request's rows (vLLM writes the prompt token there).
MARK = -1
#: ``SamplingParams.prompt_logprobs`` of a sampled request (the runner's own top-n is not used).
PROMPT_LOGPROBS = 1


class SamplingWorkerExtension:
    """vLLM ``worker_extension_cls``: importing this class's module installs the wrapper in the
    worker process (the class itself adds nothing to the worker)."""


def _spec(request: Any) -> dict[str, Any] | None:
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
    spec = extra.get(FLAG)
    return spec if isinstance(spec, dict) else None


def _sampled_chunks(
    runner: Any, specs: dict[str, dict[str, Any]], hidden_states: Any, scheduled: dict[str, int]
) -> tuple[dict[str, Any], list[str]]:
    """Sampled rows of this step's chunk of every flagged request (mirrors vLLM's loop):
    ``(finished request -> LogprobsTensors, finished ids)``."""
    import torch
    from logitcache.cache_format.sampling import sample_rows, seeded_uniforms
    from vllm.v1.outputs import LogprobsTensors

    out: dict[str, Any] = {}
    finished: list[str] = []
    for req_id, spec in specs.items():
        num_tokens = scheduled.get(req_id)
        if num_tokens is None:  # preempted in prefill
            continue
        request = runner.requests[req_id]
        if request.prompt_token_ids is None:
            continue
        draws = int(spec["draws"])
        head = int(spec.get("head", 0))
        rows = len(request.prompt_token_ids) - 1
        tensors = request.in_progress_prompt_logprobs_cpu
        if tensors is None:
            tensors = LogprobsTensors.empty_cpu(rows, head + draws + 1)
            request.in_progress_prompt_logprobs_cpu = tensors
        start = request.num_computed_tokens
        remaining = rows - start
        if num_tokens <= remaining:
            n = num_tokens
        else:
            n = remaining
            finished.append(req_id)
            out[req_id] = tensors
        if n <= 0:
            continue
        offset = runner.query_start_loc.np[runner.input_batch.req_id_to_index[req_id]].item()
        logits = runner.model.compute_logits(hidden_states[offset : offset + n])
        lp = runner.sampler.compute_logprobs(logits)
        u = seeded_uniforms(int(spec["seed"]), start + n, draws)[start:]
        ids, lw = sample_rows(lp, u, float(spec["tau"]), k=head + draws, head=head)
        part = slice(start, start + n)
        tensors.logprob_token_ids[part, 0] = MARK
        tensors.logprob_token_ids[part, 1:] = torch.from_numpy(ids)
        tensors.logprobs[part, 0] = 0.0
        tensors.logprobs[part, 1:] = torch.from_numpy(lw)
        tensors.selected_token_ranks[part] = 0
    return out, finished


@patch_once
def install() -> None:
    """Wrap the model runner's prompt-logprob pass (once per process,
    :func:`.patching.patch_once`): ``install()`` is False if this vLLM lacks it."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._get_prompt_logprobs_dict

    def get_prompt_logprobs_dict(
        self: Any, hidden_states: Any, num_scheduled_tokens: dict[str, int]
    ) -> dict[str, Any]:
        pending = self.num_prompt_logprobs
        specs = {
            rid: spec
            for rid in list(pending)
            if (spec := _spec(self.requests.get(rid))) is not None
        }
        if not specs:
            return original(self, hidden_states, num_scheduled_tokens)
        kept = {rid: pending.pop(rid) for rid in specs}
        try:
            result = original(self, hidden_states, num_scheduled_tokens)
            sampled, finished = _sampled_chunks(self, specs, hidden_states, num_scheduled_tokens)
        finally:
            pending.update(kept)
        for rid in finished:
            del pending[rid]
            self.requests[rid].in_progress_prompt_logprobs_cpu = None
        result.update(sampled)
        return result

    GPUModelRunner._get_prompt_logprobs_dict = get_prompt_logprobs_dict


install()
