"""The worker hook: rows vLLM's own prompt-logprob pass cannot give, computed where it runs.

vLLM computes prompt logprobs in ``GPUModelRunner._get_prompt_logprobs_dict`` (also the CPU
runner's) from the full ``[n, V]`` logits of each prefill chunk, and no temperature or logits
processor reaches prompt positions. :func:`install` wraps that method so a request whose
``SamplingParams.extra_args`` carry this module's keys is answered where the block exists, from
``lp = log_softmax(logits / T)``: sampled rows (:data:`FLAG`, seeded per chunk row so a chunked
prefill draws what one pass would), ``lp`` at chosen ids (:data:`TOKEN_IDS`, after the top
:data:`TOPK`), the top ``prompt_logprobs``, or the hidden states (:data:`HIDDEN`); with
:data:`ENTROPY` one more column holds the row's entropy.

Its tensors then hold ``[L - 1, width + 1]``: column 0 the marker id :data:`MARK` with the row's
logprob of the next prompt token, then the row's ids and values. Every other request takes
vLLM's own code. The engine names :class:`SamplingWorkerExtension` as ``worker_extension_cls`` so
every worker imports this module (which installs the wrapper); the service checks the marker of
every hooked answer, so a worker without the wrapper is an error.
"""

from __future__ import annotations

from typing import Any

from .patching import patch_once

#: ``SamplingParams.extra_args`` key of a sampled request: ``{"seed", "draws", "tau", "head"}``.
FLAG = "logitcache_sampled_targets"
#: ``SamplingParams.extra_args`` key of the temperature ``T`` a request's logits are divided by.
TEMPERATURE = "logitcache_temperature"
#: ``SamplingParams.extra_args`` key of the token ids whose logprobs a request asks for.
TOKEN_IDS = "logitcache_token_ids"
#: ``SamplingParams.extra_args`` key of the top-k width asked beside :data:`TOKEN_IDS`.
TOPK = "logitcache_topk"
#: ``SamplingParams.extra_args`` key asking for each row's entropy in a last column.
ENTROPY = "logitcache_entropy"
#: ``SamplingParams.extra_args`` key of a hidden-state request (FORMAT.md 4.10): the hidden size
#: ``d``; the rows are the chunk's hidden states themselves (ids ``0..d-1``).
HIDDEN = "logitcache_hidden"
#: Id written in column 0 of a sampled request's rows (vLLM writes the prompt token there).
MARK = -1
#: ``SamplingParams.prompt_logprobs`` of a sampled request (the runner's own top-n is not used).
PROMPT_LOGPROBS = 1


class SamplingWorkerExtension:
    """vLLM ``worker_extension_cls``: importing its module installs the wrapper in the worker."""


def _spec(request: Any) -> dict[str, Any] | None:
    """The hook's part of a request (its spec with ``"T"`` and ``"entropy"``), or ``None`` for a
    request vLLM answers itself."""
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
    if extra.get(HIDDEN):
        return {"hidden": int(extra[HIDDEN]), "T": 1.0}
    sampled = extra.get(FLAG)
    t = float(extra.get(TEMPERATURE, 1.0))
    ent = bool(extra.get(ENTROPY, False))
    ids = extra.get(TOKEN_IDS)
    if ids is not None:
        return {"ids": list(ids), "k": int(extra.get(TOPK, 0)), "T": t, "entropy": ent}
    if not isinstance(sampled, dict) and t == 1.0 and not ent:
        return None
    return {**(sampled if isinstance(sampled, dict) else {}), "T": t, "entropy": ent}


def _rows(runner: Any, spec: dict[str, Any], hidden: Any, start: int, width: int, nxt: Any) -> Any:
    """``(ids [n, width], values, entropy or None, logprob at next token nxt or None)`` CPU
    tensors of one chunk's hidden states."""
    ids, lps, lp, act = _values(runner, spec, hidden, start, width, nxt)
    if not spec.get("entropy") or lp is None:
        return ids, lps, None, act
    from logitcache.cache_format.sampling import row_entropy

    return ids, lps, row_entropy(lp.float()).to("cpu"), act


def _values(
    runner: Any, spec: dict[str, Any], hidden: Any, start: int, width: int, nxt: Any
) -> Any:
    """``(ids, logprobs)`` of :func:`_rows`, the chunk's full ``lp`` and its values at
    ``nxt``."""
    import torch
    from logitcache.cache_format.sampling import sample_rows, seeded_uniforms

    if "hidden" in spec:  # the states the head turns into logits (FORMAT.md 4.10)
        d = int(hidden.shape[1])
        ids = torch.arange(d, dtype=torch.int32).expand(int(hidden.shape[0]), d)
        return ids, hidden.to("cpu", torch.float32), None, None
    logits = runner.model.compute_logits(hidden)
    if spec["T"] != 1.0:
        logits = logits.to(torch.float32) / spec["T"]
    lp = runner.sampler.compute_logprobs(logits)
    at = torch.as_tensor(nxt, dtype=torch.long, device=lp.device)[:, None]
    act = lp.gather(1, at)[:, 0].to("cpu", torch.float32)  # FORMAT.md 4.12
    if "ids" in spec:
        idx = torch.as_tensor(spec["ids"], dtype=torch.long, device=lp.device)
        ids_out = idx.expand(lp.shape[0], -1)
        lps_out = lp[:, idx]
        if spec["k"]:  # the top k first, then the chosen ids
            values, top = torch.topk(lp, spec["k"], dim=-1)
            ids_out, lps_out = torch.cat([top, ids_out], 1), torch.cat([values, lps_out], 1)
        return ids_out.to("cpu", torch.int32), lps_out.to("cpu", torch.float32), lp, act
    if "draws" not in spec:
        values, ids = torch.topk(lp, width, dim=-1)
        return ids.to("cpu", torch.int32), values.to("cpu", torch.float32), lp, act
    draws = int(spec["draws"])
    u = seeded_uniforms(int(spec["seed"]), start + int(hidden.shape[0]), draws)[start:]
    ids_np, lw = sample_rows(lp, u, float(spec["tau"]), k=width, head=int(spec.get("head", 0)))
    return torch.from_numpy(ids_np), torch.from_numpy(lw), lp, act


def _width(spec: dict[str, Any], k: int) -> int:
    """Entries per row: the chosen ids (after the top ``k`` if asked), ``head + draws`` of a
    sampled request, else its ``prompt_logprobs``."""
    if "hidden" in spec:
        return int(spec["hidden"])
    if "ids" in spec:
        return int(spec["k"]) + len(spec["ids"])
    if "draws" in spec:
        return int(spec.get("head", 0)) + int(spec["draws"])
    return k


def _hooked_chunks(
    runner: Any,
    specs: dict[str, dict[str, Any]],
    ks: dict[str, int],
    hidden_states: Any,
    scheduled: dict[str, int],
) -> tuple[dict[str, Any], list[str]]:
    """The rows of this step's chunk of every hooked request (mirrors vLLM's loop; ``ks``: their
    ``prompt_logprobs``): ``(finished request -> LogprobsTensors, finished ids)``."""
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
        width = _width(spec, ks[req_id])
        rows = len(request.prompt_token_ids) - 1
        tensors = request.in_progress_prompt_logprobs_cpu
        if tensors is None:  # the marker, the row, the entropy if asked
            tensors = LogprobsTensors.empty_cpu(rows, width + 1 + int(bool(spec.get("entropy"))))
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
        nxt = request.prompt_token_ids[start + 1 : start + 1 + n]
        chunk = hidden_states[offset : offset + n]
        ids, lps, ent, act = _rows(runner, spec, chunk, start, width, nxt)
        part = slice(start, start + n)
        tensors.logprob_token_ids[part, 0] = MARK
        tensors.logprob_token_ids[part, 1 : width + 1] = ids
        tensors.logprobs[part, 0] = 0.0 if act is None else act
        tensors.logprobs[part, 1 : width + 1] = lps
        if ent is not None:
            tensors.logprob_token_ids[part, width + 1] = MARK
            tensors.logprobs[part, width + 1] = ent
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
            sampled, finished = _hooked_chunks(
                self, specs, kept, hidden_states, num_scheduled_tokens
            )
        finally:
            pending.update(kept)
        for rid in finished:
            del pending[rid]
            self.requests[rid].in_progress_prompt_logprobs_cpu = None
        result.update(sampled)
        return result

    GPUModelRunner._get_prompt_logprobs_dict = get_prompt_logprobs_dict


install()
