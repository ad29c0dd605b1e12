"""The plain-transformers teacher backend: a PyTorch forward with a chunked lm-head top-k.

Prompts are right-padded and grouped by length under a token budget; the decoder's last hidden
states are computed once per batch, then ``chunk_rows`` positions at a time ``z = h W^T (+ b)``,
``log_softmax(z / T)`` and ``torch.topk`` (peak extra memory ``chunk_rows x V`` floats). Sampled
rows, entropy and the next token's logprob come from the same chunks. Models whose head does
more than a linear map are refused.

Every torch call runs on one dedicated thread (``logitcache-forward``): one OpenMP team, one
core fewer than the usable ones (:func:`intra_op_threads`), so the server's threads have a core.
On a GPU a batch's top-k reaches the host by an asynchronous copy into pinned memory, converted
while the device runs the next batch.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from .base import BaseEngine
from .config import EngineConfig, HfOptions, engine_info
from .protocol import EngineConfigError, SampledTargets, TeacherScores, make_scores

#: Config attributes that mean the logits are not just ``h W^T + b``.
_HEAD_EXTRAS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
_DTYPES.update({"float16": "float16", "fp16": "float16", "half": "float16"})

_T = TypeVar("_T")


def _torch_dtype(name: str, config: Any) -> Any:
    import torch

    if name == "auto":
        # CPU: float32 unless the checkpoint says bf16 (fp16 matmuls are slow on CPU).
        cfg_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if cfg_dtype in (torch.bfloat16, "bfloat16"):
            return torch.bfloat16
        if torch.cuda.is_available() and cfg_dtype in (torch.float16, "float16"):
            return torch.float16
        return torch.float32
    try:
        return getattr(torch, _DTYPES[name.lower()])
    except KeyError:
        raise EngineConfigError(f"unsupported dtype {name!r}") from None


class TransformersEngine(BaseEngine):
    """A :class:`~logitcache.server.engine.TeacherEngine` on ``transformers`` + PyTorch."""

    def __init__(self, cfg: EngineConfig):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        super().__init__()
        self.cfg = cfg
        self.options = HfOptions.parse(cfg.options)
        self.chunk_rows = self.options.chunk_rows
        self.batch_tokens = self.options.batch_tokens
        device = self.options.device or ("cuda" if torch.cuda.is_available() else "cpu")
        opts = dict(self.options.model_kwargs)
        if cfg.tensor_parallel_size != 1 or cfg.pipeline_parallel_size != 1:
            raise EngineConfigError("the transformers backend runs on one device (no TP/PP)")
        revision = None if _is_dir(cfg.model) else cfg.revision
        config = AutoConfig.from_pretrained(cfg.model, revision=revision)
        extras = [a for a in _HEAD_EXTRAS if getattr(config, a, None) not in (None, 1, 1.0)]
        if extras:
            raise EngineConfigError(
                f"the model's head uses {extras}; the chunked lm-head would differ. Use vLLM."
            )
        self.dtype = _torch_dtype(cfg.dtype, config)
        self.device = torch.device(device)
        model: Any = AutoModelForCausalLM.from_pretrained(
            cfg.model, revision=revision, dtype=self.dtype, **opts
        )
        self.model = model.to(self.device).eval()
        self.decoder = model.get_decoder()
        head = model.get_output_embeddings()
        if head is None:
            raise EngineConfigError("the model has no output embedding (lm head)")
        self.head_weight = head.weight
        self.head_bias = getattr(head, "bias", None)
        self.model_config = config
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.model)
        vocab = int(self.head_weight.shape[0])
        model_max = int(getattr(config, "max_position_embeddings", 0) or 0) or None
        if cfg.max_seq_len is None and model_max is None:
            raise EngineConfigError("max_seq_len unknown: set it (the model config has none)")
        max_seq_len = min(x for x in (cfg.max_seq_len, model_max) if x is not None)
        self.info = engine_info(
            cfg,
            tokenizer=self.tokenizer,
            vocab_size=vocab,
            max_seq_len=max_seq_len,
            backend="transformers",
            dtype=str(self.dtype).removeprefix("torch."),
        )
        # The one thread of every torch call after loading (the module docstring says why).
        self._torch = ThreadPoolExecutor(1, thread_name_prefix="logitcache-forward")
        self._on_torch_sync(torch.set_num_threads, intra_op_threads(torch.get_num_threads()))

    async def _on_torch(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` on the engine's forward thread, awaited."""
        return await asyncio.get_running_loop().run_in_executor(self._torch, fn, *args)

    def _on_torch_sync(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` on the engine's forward thread, waited for."""
        if threading.current_thread().name.startswith("logitcache-forward"):
            return fn(*args)
        return self._torch.submit(fn, *args).result()

    #: Prompts arrive as int64 arrays (tensors are made of them without a Python int per token).
    array_prompts = True

    # --- compute ----------------------------------------------------------------------------

    def _topk_rows(
        self, hidden: Any, k: int, temperature: float, targets: Any = None
    ) -> tuple[Any, Any, Any, Any, Any]:
        """Top-k of ``log_softmax((h W^T + b) / T)`` for ``hidden [n, d]``, chunk by chunk on the
        device: ``(ids, logprobs, tail, entropy or None, logprob at targets or None)``."""
        import torch
        from logitcache.cache_format.sampling import row_entropy

        ids_out, lps_out, tails, ent_out, act_out = [], [], [], [], []
        parts: list[Any] = [None] * len(hidden.split(self.chunk_rows))
        if targets is not None:
            parts = list(targets.split(self.chunk_rows))
        for h, t in zip(hidden.split(self.chunk_rows), parts, strict=True):
            z = torch.nn.functional.linear(h, self.head_weight, self.head_bias).float()
            if temperature != 1.0:
                z.div_(temperature)
            v, i = torch.topk(z, k, dim=-1, sorted=True)
            lse = torch.logsumexp(z, dim=-1, keepdim=True)
            v.sub_(lse)
            if t is not None:
                act_out.append((z.gather(1, t[:, None]) - lse)[:, 0])
            if self.cfg.entropy:
                ent_out.append(row_entropy(z.sub_(lse)))
            ids_out.append(i.to(torch.int32))
            lps_out.append(v)
            tails.append(_tail(v))
            del z
        ent = torch.cat(ent_out) if ent_out else None
        act = torch.cat(act_out) if act_out else None
        return torch.cat(ids_out), torch.cat(lps_out), torch.cat(tails), ent, act

    def _sampled_rows(
        self, hidden: Any, key: str, targets: SampledTargets, temperature: float
    ) -> TeacherScores:
        """Sampled rows of ``hidden [n, d]``, ``chunk_rows`` rows at a time."""
        from logitcache.cache_format.sampling import uniforms

        u = uniforms(targets.seed, key, int(hidden.shape[0]), targets.draws)
        ent: list[Any] | None = [] if self.cfg.entropy else None
        ids, lw = sample_from_hidden(
            hidden,
            self.head_weight,
            u,
            bias=self.head_bias,
            temperature=temperature,
            proposal_temperature=targets.proposal_temperature,
            chunk_rows=self.chunk_rows,
            head=targets.head,
            entropy=ent,
        )
        return make_scores(ids, lw, entropy=_joined(ent))

    def _id_rows(self, hidden: Any, ids: list[int], temperature: float) -> Any:
        """``log_softmax((h W^T + b) / T)`` at ``ids`` for ``hidden [n, d]``, chunk by chunk
        (float32 numpy ``[n, len(ids)]``)."""
        import torch

        idx = torch.as_tensor(ids, dtype=torch.long, device=hidden.device)
        out = []
        for h in hidden.split(self.chunk_rows):
            z = torch.nn.functional.linear(h, self.head_weight, self.head_bias).float()
            if temperature != 1.0:
                z.div_(temperature)
            out.append((z[:, idx] - torch.logsumexp(z, dim=-1, keepdim=True)).cpu())
        return torch.cat(out).numpy()

    def _batches(self, prompts: list[Any]) -> list[list[int]]:
        """Prompt indices grouped by length (longest first) so padded tokens stay under
        ``batch_tokens`` (a longer prompt gets a batch of its own)."""
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        batches: list[list[int]] = []
        cur: list[int] = []
        for i in order:
            width = len(prompts[cur[0]]) if cur else len(prompts[i])
            if cur and width * (len(cur) + 1) > self.batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
        return batches

    def _hidden(self, seqs: list[Any]) -> Any:
        """The decoder's last hidden states ``[B, width, d]`` of right-padded ``seqs`` (a batch
        of equal lengths without a padding mask)."""
        import torch

        width = max(len(s) for s in seqs)
        pin = self.device.type == "cuda"
        ids = torch.zeros((len(seqs), width), dtype=torch.long, pin_memory=pin)
        for r, s in enumerate(seqs):
            ids[r, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        kwargs: dict[str, Any] = {"input_ids": ids.to(self.device, non_blocking=True)}
        if any(len(s) != width for s in seqs):
            mask = torch.zeros((len(seqs), width), dtype=torch.long, pin_memory=pin)
            for r, s in enumerate(seqs):
                mask[r, : len(s)] = 1
            kwargs["attention_mask"] = mask.to(self.device, non_blocking=True)
        return self.decoder(**kwargs).last_hidden_state

    def _score_sync(
        self, prompts: list[Any], k: int, temperature: float
    ) -> tuple[list[TeacherScores | None], _Pending | None]:
        """Top-k rows of every prompt, on the forward thread; batch ``i`` converted while the
        device runs ``i + 1``, and on a GPU the last batch returned unconverted."""
        import torch

        out: list[TeacherScores | None] = [None] * len(prompts)
        last: _Pending | None = None
        with torch.inference_mode():
            for batch in self._batches(prompts):
                hidden = self._hidden([prompts[i] for i in batch])
                rows = torch.cat([hidden[r, : len(prompts[i]) - 1] for r, i in enumerate(batch)])
                nxt = torch.cat([torch.as_tensor(prompts[i][1:]) for i in batch])
                top = self._topk_rows(rows, k, temperature, nxt.to(self.device, non_blocking=True))
                del hidden, rows
                if last is not None:
                    last.collect(prompts, out)
                last = _Pending.start(batch, *top, device=self.device)
        if last is not None and last.event is None:  # CPU rows: nothing left to overlap
            last.collect(prompts, out)
            last = None
        return out, last

    def _forward_rows(self, prompts: list[Any], rows: Any) -> list[Any]:
        """``rows(i, hidden [L_i - 1, d])`` of every prompt after batched decoder forwards."""
        import torch

        out: list[Any] = [None] * len(prompts)
        with torch.inference_mode():
            for batch in self._batches(prompts):
                hidden = self._hidden([prompts[i] for i in batch])
                for r, i in enumerate(batch):
                    out[i] = rows(i, hidden[r, : len(prompts[i]) - 1])
        return [s for s in out if s is not None]

    async def _generate(
        self, prompts: list[Any], k: int, temperature: float
    ) -> list[TeacherScores]:
        """The forward on the forward thread, the last batch converted on another."""
        out, last = await self._on_torch(self._score_sync, prompts, k, temperature)
        if last is not None:
            await asyncio.to_thread(last.collect, prompts, out)
        return [s for s in out if s is not None]

    async def _generate_sampled(
        self, prompts: list[Any], keys: list[str], targets: SampledTargets, temperature: float
    ) -> list[TeacherScores]:
        """Sampled rows from the chunked lm-head pass, on the forward thread."""

        def sampled(i: int, hidden: Any) -> TeacherScores:
            return self._sampled_rows(hidden, keys[i], targets, temperature)

        return await self._on_torch(self._forward_rows, prompts, sampled)

    async def _generate_ids(
        self, prompts: list[Any], ids: list[list[int]], temperature: float
    ) -> list[Any]:
        """Logprobs at the chosen ids from the chunked lm-head pass, on the forward thread."""

        def at_ids(i: int, hidden: Any) -> Any:
            return self._id_rows(hidden, ids[i], temperature)

        return await self._on_torch(self._forward_rows, prompts, at_ids)

    async def _generate_with_ids(
        self, prompts: list[Any], k: int, ids: list[list[int]], temperature: float
    ) -> tuple[list[TeacherScores], list[Any]]:
        """Top-k rows and the logprobs at the chosen ids from one decoder forward per batch."""

        def both(i: int, hidden: Any) -> tuple[TeacherScores, Any]:
            import torch

            nxt = torch.as_tensor(prompts[i][1:]).to(hidden.device)
            top = self._topk_rows(hidden, k, temperature, nxt)
            tid, tlp, tail, ent, act = (None if x is None else x.cpu().numpy() for x in top)
            assert tid is not None and tlp is not None
            rows = make_scores(tid, tlp, tail, ent, act)
            return rows, self._id_rows(hidden, ids[i], temperature)

        out = await self._on_torch(self._forward_rows, prompts, both)
        return [r for r, _ in out], [a for _, a in out]

    async def _generate_hidden(self, prompts: list[Any]) -> list[Any]:
        """The lm head's input at every prompt's first ``L - 1`` positions (float32, host)."""

        def states(i: int, hidden: Any) -> Any:
            return hidden.float().cpu().numpy()

        return await self._on_torch(self._forward_rows, prompts, states)

    def teacher_head(self) -> Any:
        """The lm head as a :class:`~logitcache.cache_format.TeacherHead`, made once."""
        from .hidden import head_of

        if getattr(self, "_teacher_head", None) is None:
            self._teacher_head = self._on_torch_sync(
                head_of, self.head_weight, self.head_bias, self.model_config
            )
        return self._teacher_head

    async def _close(self) -> None:
        """Drop the model after the forwards already queued, and end the forward thread."""

        def drop() -> None:
            self.model = self.decoder = self.head_weight = self.head_bias = None

        await self._on_torch(drop)
        self._torch.shutdown(wait=False)


def _joined(parts: list[Any] | None) -> Any:
    """The per-chunk arrays of ``parts`` joined (``None`` stays ``None``)."""
    import numpy as np

    if parts is None:
        return None
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def intra_op_threads(default: int) -> int:
    """The engine's intra-op (OpenMP) threads: ``default``, at most the usable cores less one
    (left to the server's own threads; OpenMP barriers spin when a peer is descheduled), at
    least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(default, (cores or 1) - 1))


def _is_dir(path: str) -> bool:
    from pathlib import Path

    return Path(path).is_dir()


def _tail(lp: Any) -> Any:
    """``clip(1 - sum_k exp(lp), 0, 1)`` per row of sorted logprobs ``lp [n, k]`` on their
    device, as ``tail_from_logprobs`` computes it."""
    import torch

    m = lp[:, :1]
    rest = torch.exp(lp[:, 1:] - m).sum(dim=-1)
    return (-torch.expm1(m[:, 0] + torch.log1p(rest))).clamp_(0.0, 1.0)


class _Pending:
    """One decoder batch's rows on their way to the host: pinned tensors filled by an
    asynchronous copy, and its done event (``None`` on the CPU)."""

    def __init__(
        self, members: list[int], ids: Any, lps: Any, tail: Any, ent: Any, act: Any, event: Any
    ) -> None:
        self.members, self.ids, self.lps, self.tail = members, ids, lps, tail
        self.ent, self.act, self.event = ent, act, event

    @classmethod
    def start(
        cls, members: list[int], ids: Any, lps: Any, tail: Any, ent: Any, act: Any, device: Any
    ) -> _Pending:
        import torch

        if device.type != "cuda":
            return cls(members, ids, lps, tail, ent, act, None)

        def pinned(t: Any) -> Any:
            if t is None:
                return None
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

        h_ids, h_lps, h_tail, h_ent, h_act = (pinned(t) for t in (ids, lps, tail, ent, act))
        event = torch.cuda.Event(blocking=True)
        event.record()
        return cls(members, h_ids, h_lps, h_tail, h_ent, h_act, event)

    def collect(self, prompts: list[Any], out: list[Any]) -> None:
        """Wait for the copy, then put each member prompt's rows into ``out`` (any thread)."""
        if self.event is not None:
            self.event.synchronize()
        ids, lps, tail = self.ids.numpy(), self.lps.numpy(), self.tail.numpy()
        ent, act = (None if x is None else x.numpy() for x in (self.ent, self.act))
        start = 0
        for i in self.members:
            end = start + len(prompts[i]) - 1
            e, a = (None if x is None else x[start:end] for x in (ent, act))
            out[i] = make_scores(ids[start:end], lps[start:end], tail[start:end], e, a)
            start = end


def sample_from_hidden(
    hidden: Any,
    weight: Any,
    u: Any,
    *,
    bias: Any = None,
    temperature: float = 1.0,
    proposal_temperature: float = 1.0,
    chunk_rows: int = 256,
    k: int | None = None,
    head: int = 0,
    entropy: list[Any] | None = None,
) -> tuple[Any, Any]:
    """Sampled targets from a teacher's final hidden states, ``chunk_rows`` positions at a time
    (``lp = log_softmax((h W^T + b) / temperature)``, then the format's ``sample_rows``), so at
    most ``chunk_rows x V`` logits exist at once; equal to ``sample_rows`` on the whole block.
    ``entropy``: a list that receives each chunk's ``row_entropy``."""
    import numpy as np
    import torch
    from logitcache.cache_format.sampling import check_head, row_entropy, sample_rows

    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    head = check_head(head, int(u.shape[1]), int(weight.shape[0]))
    ids, lws = [], []
    with torch.no_grad():
        for s in range(0, int(hidden.shape[0]), chunk_rows):
            z = hidden[s : s + chunk_rows].float() @ weight.float().T
            if bias is not None:
                z = z + bias.float()
            lp = torch.log_softmax(z / temperature, -1)
            i, w = sample_rows(lp, u[s : s + chunk_rows], proposal_temperature, k, head)
            if entropy is not None:
                entropy.append(row_entropy(lp).cpu().numpy())
            ids.append(i)
            lws.append(w)
    n = head + int(u.shape[1]) if k is None else int(k)
    if not ids:
        return np.zeros((0, n), np.int32), np.zeros((0, n), np.float32)
    return np.concatenate(ids), np.concatenate(lws)
