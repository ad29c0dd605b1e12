"""The batch-job path versus vLLM called directly, on the same prompts.

``--sequences`` windows of ``--length`` tokens of the tiny fixture's training text: **direct**, a
long-lived process that builds ``vllm.LLM`` once with the service's engine settings and times one
``LLM.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=k, ...))`` over every prompt
per run (idle on stdin while the job runs); **job**, the real service running a batch job over
the same prompts into a Zarr cache (``tokens_total / (finished_at - started_at)``). ``--repeats``
pairs per ``k``, the order alternating; per ``k`` the median and minimum job/direct ratio, each
figure beside the load average before it. ``--modes``: ``inproc`` (engine core in the server
process) and ``async`` (``AsyncLLM``, engine core in its own process).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import load1
from benchmarks.service.common import parse, recorded, run_job, write_jsonl
from tests.server_support import VLLM_ENV, ServerProcess


def direct_engine_kwargs(settings: dict) -> dict:
    """``vllm.LLM`` arguments equal to what the service's ``VllmEngine`` passes to ``EngineArgs``
    for these settings (``server/engine/vllm.py``)."""
    from logitcache.server.engine import engine_config, model_max_len
    from logitcache.server.engine.vllm import resolve_seq_len

    model, max_k, dtype, max_seq_len = (settings[x] for x in ("model", "k", "dtype", "max_seq_len"))
    cfg = engine_config(None, model=model, max_k=max_k, dtype=dtype, max_seq_len=max_seq_len)
    _, engine_len = resolve_seq_len(cfg.max_seq_len, model_max_len(cfg.model))
    return dict(
        dtype=cfg.dtype, max_model_len=engine_len, logprobs_mode="raw_logprobs",
        enable_prefix_caching=False, gpu_memory_utilization=cfg.memory_share,
        max_num_seqs=cfg.max_num_seqs, seed=cfg.seed, enforce_eager=True, disable_log_stats=True,
    )  # fmt: skip


def make_inputs(length: int, count: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens from the fixture's training token stream."""
    from logitcache.fixtures.tiny import build_tiny_models

    tiny = build_tiny_models()
    tok = tiny.load_tokenizer()
    stream: list[int] = []
    for text in tiny.texts("train"):
        stream.extend(tok(text)["input_ids"])
        if len(stream) >= length * count:
            break
    if len(stream) < length * count:
        raise SystemExit(f"corpus too small for {count} x {length} tokens")
    return [stream[i * length : (i + 1) * length] for i in range(count)]


def direct_worker(args: argparse.Namespace) -> None:
    """The baseline process: build ``vllm.LLM`` once, then for every ``run K`` line on stdin time
    one ``LLM.generate`` over all prompts and print a JSON line."""
    from vllm import LLM, SamplingParams

    prompts = [{"prompt_token_ids": p} for p in json.loads(Path(args.prompts).read_text())]
    llm = LLM(model=args.model, max_logprobs=args.k[0], **json.loads(args.engine_kwargs))

    def generate(k: int, which: list[dict]) -> list[Any]:
        sp = SamplingParams(max_tokens=1, prompt_logprobs=k, detokenize=False,
                            flat_logprobs=True, temperature=1.0)  # fmt: skip
        return llm.generate(which, sp, use_tqdm=False)

    generate(args.k[0], prompts[:8])  # warm-up
    tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    print("READY", flush=True)
    for line in sys.stdin:
        if not line.startswith("run "):
            break
        t0 = time.perf_counter()
        outs = generate(int(line.split()[1]), prompts)
        seconds = time.perf_counter() - t0
        assert all(len(o.prompt_logprobs) == len(p["prompt_token_ids"])
                   for o, p in zip(outs, prompts, strict=True))  # fmt: skip
        print(json.dumps({"tokens": tokens, "seconds": seconds}), flush=True)


class DirectWorker:
    """The baseline process (:func:`direct_worker`); blocked on stdin between runs."""

    def __init__(self, model: str, prompts: Path, k: int, engine_kwargs: dict, mode: str):
        env = {**VLLM_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if mode == "inproc" else "1"}
        cmd = [sys.executable, "-m", "benchmarks.service.jobs", "--direct-worker", "--model"]
        cmd += [model, "--prompts", str(prompts), "--k", str(k)]
        cmd += ["--engine-kwargs", json.dumps(engine_kwargs)]
        self.proc = subprocess.Popen(cmd, env=os.environ | env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)  # fmt: skip
        self._read_until("READY")

    def _read_until(self, prefix: str) -> str:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            if line.startswith(prefix):
                return line
        raise SystemExit(f"direct worker exited with {self.proc.wait()}")

    def run(self, k: int) -> dict:
        self.proc.stdin.write(f"run {k}\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        res = json.loads(self._read_until("{"))
        return res | {"tokens_per_s": res["tokens"] / res["seconds"]}


def run_pairs(worker: DirectWorker, server: Any, ks: list[int], repeats: int, mode: str) -> dict:
    """``repeats`` pairs (direct, job) per ``k``, order alternating; per ``k``: the pairs and
    the median and minimum paired ratio job/direct."""
    out: dict[str, dict] = {}
    with server.client() as c:
        c.post("/v1/score", json={"input_ids": [[1, 2, 3, 4]], "k": ks[0]}).raise_for_status()
        for rep in range(repeats):
            for k in ks:
                order = ("direct", "job") if rep % 2 == 0 else ("job", "direct")
                got: dict[str, dict] = {}
                for what in order:
                    before = load1()
                    if what == "direct":
                        res = worker.run(k)
                    else:
                        job = run_job(c, f"b-{mode}-{k}-{rep}", k)
                        res = {x: job[x] for x in ("tokens_per_s", "client_wall_s")}
                        res["tokens"] = job["tokens_total"]
                    got[what] = {**res, "load_avg_1min_before": before}
                d, j = got["direct"], got["job"]
                ratio = j["tokens_per_s"] / d["tokens_per_s"]
                pair = {"k": k, "order": list(order), **got, "ratio": ratio}
                out.setdefault(str(k), {"pairs": []})["pairs"].append(pair)
                print(f"{mode} k={k} pair {rep} ({order[0]} first): direct "
                      f"{d['tokens_per_s']:,.0f} tok/s (load {d['load_avg_1min_before']}), job "
                      f"{j['tokens_per_s']:,.0f} tok/s (load {j['load_avg_1min_before']}), "
                      f"job/direct {ratio:.3f}", flush=True)  # fmt: skip
    for row in out.values():
        ratios = [p["ratio"] for p in row["pairs"]]
        loads = [p[w]["load_avg_1min_before"] for p in row["pairs"] for w in ("direct", "job")]
        row.update(median_ratio=statistics.median(ratios), min_ratio=min(ratios))
        for w in ("direct", "job"):
            row[f"{w}_median_tokens_per_s"] = statistics.median(
                p[w]["tokens_per_s"] for p in row["pairs"]
            )
        row["load_avg_1min_range"] = [min(loads), max(loads)]
    return out


def main(argv: list[str] | None = None) -> None:
    hidden = argparse.SUPPRESS
    args = parse(
        "jobs", __doc__, argv, sequences=512, length=256, k=([8], "one or more k (pairs per k)"),
        modes=(["inproc"], "engine driver", {"choices": ["inproc", "async"]}),
        repeats=(2, "pairs (direct, job) per k and mode"), direct_worker=(False, hidden),
        model=(None, hidden), prompts=(None, hidden), engine_kwargs=("{}", hidden),
    )  # fmt: skip
    if args.direct_worker:
        return direct_worker(args)
    if args.sequences < 1 or args.length < 2 or args.repeats < 1 or min(args.k) < 1:
        raise SystemExit("need --sequences >= 1, --length >= 2, --repeats >= 1 and --k >= 1")
    from logitcache.fixtures.tiny import build_tiny_models

    t_start = time.perf_counter()
    model = str(build_tiny_models().teacher_dir)
    prompts = make_inputs(args.length, args.sequences)
    work = Path(tempfile.mkdtemp(prefix="server-bench-"))
    prompts_file = work / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    settings = {
        "model": model,
        "k": max(args.k),
        "dtype": "float32",
        "max_seq_len": max(args.length, 512),
    }  # the server's job batching otherwise
    engine_kwargs = direct_engine_kwargs(settings)
    print(f"inputs: {args.sequences} x {args.length} tokens, k={args.k}, modes {args.modes}; "
          f"engine {engine_kwargs}; load {load1()}", flush=True)  # fmt: skip
    modes: dict[str, dict] = {}
    for mode in args.modes:
        worker = DirectWorker(model, prompts_file, max(args.k), engine_kwargs, mode)
        write_jsonl(work / mode / "data", prompts)
        try:
            engine_options = json.dumps({"vllm_mode": mode})
            with ServerProcess(work / mode, **settings, engine_options=engine_options) as server:
                modes[mode] = run_pairs(worker, server, args.k, args.repeats, mode)
            worker.proc.stdin.close()  # type: ignore[union-attr]
            worker.proc.wait(120)
        finally:
            if worker.proc.poll() is None:
                worker.proc.kill()
    head, rec = recorded("jobs", args)
    for mode, per_k in modes.items():
        for k, row in per_k.items():
            cfg = {"k": int(k), "mode": mode, "pairs": len(row["pairs"])}
            ratios = [p["ratio"] for p in row["pairs"]]
            rec.add(f"{mode} k={k}", "job_over_direct", "ratio", row["median_ratio"], config=cfg,
                    p20=min(ratios), p80=max(ratios), samples=len(ratios))  # fmt: skip
            for side in ("direct", "job"):
                value = row[f"{side}_median_tokens_per_s"]
                rec.add(f"{mode} k={k}", f"{side}_tokens_per_s", "tok/s", value, config=cfg)
    result = head | {"modes": modes, "settings": settings, "engine_kwargs": engine_kwargs}
    rec.finish(result | {"wall_s": time.perf_counter() - t_start}, args.json, show=-1)
    print(rec.table())


if __name__ == "__main__":
    main()
