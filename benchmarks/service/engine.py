"""Teacher-engine benchmark: engine time vs the conversion of vLLM's output to numpy.

Run (2-core CPU box; the tiny fixture is built first if needed):

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_HOST_IP=127.0.0.1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \\
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \\
    python -m benchmarks.service engine --prompts 64 --length 256 --ks 20 100

For each k, on the same prompts (windows of the held-out token stream) and in the same process:

* ``score``: :meth:`VllmEngine.score` end to end, split into the engine's time (awaiting vLLM)
  and our conversion (``FlatLogprobs`` -> ``[L-1, k]`` arrays + tail mass);
* ``convert fast`` vs ``convert per-position``: the reshape fast path against the per-position
  rank-sorting fallback, on the very same vLLM outputs (the baseline a naive loop would pay);
* ``vLLM default params``: the engine with vLLM's default output path (``flat_logprobs=False``,
  ``detokenize=True``) plus the per-position conversion: what the flags save;
* ``transformers``: the plain-transformers backend on the same prompts (chunked lm-head top-k).

Writes ``engine.json`` and ``engine.md`` under ``--out`` (default: a temporary folder).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import Recorder, add_csv_option, machine_line

for _k, _v in {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}.items():
    os.environ.setdefault(_k, _v)

RESULTS = Path("/tmp/lc-engine-bench")


def _windows(tiny: Any, n: int, length: int) -> list[list[int]]:
    stream = tiny.token_stream("heldout")
    if len(stream) < n * length:
        stream = __import__("numpy").concatenate([stream, tiny.token_stream("train")])
    return [stream[i * length : (i + 1) * length].tolist() for i in range(n)]


def _best(fn: Any, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out)


async def _raw_outputs(engine: Any, prompts: list[list[int]], params: Any) -> list[Any]:
    return await asyncio.gather(*(engine._one_inproc(p, params) for p in prompts))


class _VllmPythonize:
    """Times vLLM's own ``LogprobsProcessor._update_prompt_logprobs`` (``tolist()`` + building
    ``FlatLogprobs``), measurement only: the wrapped method is called unchanged."""

    def __init__(self) -> None:
        from vllm.v1.engine.logprobs import LogprobsProcessor

        self.cls = LogprobsProcessor
        self.orig = LogprobsProcessor._update_prompt_logprobs
        self.seconds = 0.0
        orig, outer = self.orig, self

        def timed(self_: Any, tensors: Any) -> None:
            t = time.perf_counter()
            try:
                orig(self_, tensors)
            finally:
                outer.seconds += time.perf_counter() - t

        LogprobsProcessor._update_prompt_logprobs = timed  # type: ignore[method-assign]

    def close(self) -> None:
        self.cls._update_prompt_logprobs = self.orig  # type: ignore[method-assign]


def bench_k(vllm: Any, hf: Any, prompts: list[list[int]], k: int, repeats: int) -> dict[str, Any]:
    from logitcache.server.engine.vllm import rows_from_dicts, rows_from_flat
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    rows = sum(len(p) - 1 for p in prompts)
    tokens = sum(len(p) for p in prompts)
    asyncio.run(vllm.score(prompts[:2], k))  # warm-up
    eng, conv, pyth = [], [], []
    for _ in range(repeats):
        vllm.timings.reset()
        timer = _VllmPythonize()
        try:
            asyncio.run(vllm.score(prompts, k))
        finally:
            timer.close()
        eng.append(vllm.timings.engine)
        conv.append(vllm.timings.convert)
        pyth.append(timer.seconds)
    outs = asyncio.run(_raw_outputs(vllm, prompts, vllm._params(k)))
    lens = [len(p) for p in prompts]
    fast = _best(
        lambda: [rows_from_flat(o.prompt_logprobs, k, n) for o, n in zip(outs, lens, strict=True)],
        3,
    )
    dicts = [list(o.prompt_logprobs) for o in outs]  # the dict view, built outside the timing
    slow = _best(lambda: [rows_from_dicts(d, k, n) for d, n in zip(dicts, lens, strict=True)], 3)

    default = SamplingParams(
        max_tokens=1, temperature=0.0, prompt_logprobs=k, output_kind=RequestOutputKind.FINAL_ONLY
    )
    t = time.perf_counter()
    douts = asyncio.run(_raw_outputs(vllm, prompts, default))
    t_default_engine = time.perf_counter() - t
    t = time.perf_counter()
    for o, n in zip(douts, lens, strict=True):
        rows_from_dicts(o.prompt_logprobs, k, n)
    t_default_conv = time.perf_counter() - t

    asyncio.run(hf.score(prompts[:2], k))
    t_hf = _best(lambda: asyncio.run(hf.score(prompts, k)), repeats)
    e, c = min(eng), min(conv)
    return {
        "k": k,
        "prompts": len(prompts),
        "tokens": tokens,
        "rows": rows,
        "score_engine_s": e,
        "vllm_pythonize_s": pyth[eng.index(e)],
        "score_convert_s": c,
        "convert_share": c / (e + c),
        "tokens_per_s": tokens / (e + c),
        "convert_fast_s": fast,
        "convert_per_position_s": slow,
        "convert_speedup": slow / fast,
        "convert_fast_rows_per_s": rows / fast,
        "vllm_default_engine_s": t_default_engine,
        "vllm_default_convert_s": t_default_conv,
        "fast_path_speedup_vs_default": (t_default_engine + t_default_conv) / (e + c),
        "hf_s": t_hf,
        "hf_tokens_per_s": tokens / t_hf,
    }


def render(res: dict[str, Any]) -> str:
    lines = [
        "# Teacher engine: engine time vs conversion to numpy",
        "",
        f"Machine: {res['machine']}. Teacher: tiny fixture ({res['teacher']}), float32, "
        f"held-out ppl {res['teacher_ppl']:.1f}. Inputs: {res['prompts']} prompts x "
        f"{res['length']} tokens (held-out windows). vLLM {res['vllm']} in-process "
        f"(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), torch threads {res['torch_threads']}. "
        f"Best of {res['repeats']}. 1-min load average at the end: {res['load_avg_1m']:.1f} "
        "(the 2 cores were shared with other jobs: compare columns within a row, not absolute "
        "times across runs).",
        "",
        f"Command: `{res['command']}`",
        "",
        "| k | engine s | of which vLLM tolist+FlatLogprobs s | convert s | convert share "
        "| prompt tok/s | fast convert rows/s "
        "| per-position convert s | fast vs per-position | vLLM default params s | "
        "ours vs default | transformers backend tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    nan = float("nan")
    for r in res["runs"]:
        lines.append(
            f"| {r['k']} | {r['score_engine_s']:.3f} | {r.get('vllm_pythonize_s', nan):.3f} "
            f"| {r['score_convert_s']:.4f} | "
            f"{100 * r['convert_share']:.2f}% | {r['tokens_per_s']:,.0f} | "
            f"{r['convert_fast_rows_per_s']:,.0f} | {r['convert_per_position_s']:.3f} | "
            f"{r['convert_speedup']:.1f}x | "
            f"{r['vllm_default_engine_s'] + r['vllm_default_convert_s']:.3f} | "
            f"{r['fast_path_speedup_vs_default']:.2f}x | {r['hf_tokens_per_s']:,.0f} |"
        )
    lines += [
        "",
        "- *engine s*: awaiting vLLM for all prompts (in flight together); includes vLLM's own",
        "  output processing (`LogprobsTensors.tolist()` and building `FlatLogprobs`), which no",
        "  public API lets us skip (its share is the third column, timed by wrapping",
        "  `LogprobsProcessor._update_prompt_logprobs`).",
        "- *convert s*: ours, `FlatLogprobs` -> `[L-1, k]` int32/float32 + tail mass (reshape;",
        "  no per-position loop). *per-position*: the rank-sorting fallback on the same outputs.",
        "- *vLLM default params*: `flat_logprobs=False`, `detokenize=True` + per-position",
        "  conversion, i.e. what the two flags save end to end.",
        "- *transformers backend*: `TransformersEngine` (chunked lm-head + top-k) on the same",
        "  prompts; it shares the process' torch threads with vLLM.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--render", type=Path, help="only re-render an engine.json to markdown")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--ks", type=int, nargs="+", default=[20, 100])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS)
    add_csv_option(p)
    a = p.parse_args(argv)
    if a.render:
        res = json.loads(a.render.read_text())
        (a.render.parent / "engine.md").write_text(render(res))
        return

    import torch
    import vllm as vllm_mod
    from logitcache.fixtures.tiny import build_tiny_models
    from logitcache.server.engine import build_engine

    tiny = build_tiny_models(verbose=True)
    prompts = _windows(tiny, a.prompts, a.length)
    kw = dict(model=str(tiny.teacher_dir), max_k=max(a.ks), dtype="float32")
    vllm = build_engine(backend="vllm", options={"vllm_mode": "inproc"}, **kw)
    hf = build_engine(backend="transformers", **kw)
    try:
        runs = [bench_k(vllm, hf, prompts, k, a.repeats) for k in a.ks]
    finally:
        asyncio.run(vllm.aclose())
        asyncio.run(hf.aclose())
    res = {
        "machine": machine_line(),
        "command": "python -m benchmarks.service engine "
        + f"--prompts {a.prompts} --length {a.length} --ks {' '.join(map(str, a.ks))} "
        + f"--repeats {a.repeats}",
        "teacher": f"{tiny.summary['params']['teacher']:,} params, vocab {tiny.vocab_size}",
        "teacher_ppl": tiny.teacher_heldout_ppl,
        "prompts": a.prompts,
        "length": a.length,
        "repeats": a.repeats,
        "vllm": vllm_mod.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_avg_1m": os.getloadavg()[0],
        "runs": runs,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "engine.json").write_text(json.dumps(res, indent=2) + "\n")
    (a.out / "engine.md").write_text(render(res))
    print(render(res))
    rec = Recorder("service", "engine", csv_path=a.csv)
    for run in runs:
        rec.add_flat(f"k={run.get('k')}", run, config={"prompts": a.prompts, "length": a.length})
    rec.save()


if __name__ == "__main__":
    main()
