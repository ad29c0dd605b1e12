"""Teacher-service benchmark: the batch-job path versus vLLM called directly.

Same inputs for both (``--sequences`` windows of ``--length`` tokens of the tiny fixture's
training split): **direct**, a long-lived process that builds ``vllm.LLM`` once with the
service's engine settings and times one ``LLM.generate(prompts, SamplingParams(max_tokens=1,
prompt_logprobs=k, detokenize=False, flat_logprobs=True))`` over every prompt per run (nothing
converted or stored; idle on stdin while the job runs), and **job**, the real service running a
batch job over the same prompts as JSONL into a Zarr cache (rate: ``tokens_total /
(finished_at - started_at)``). ``--repeats`` pairs per ``k``, the order alternating (the load
drifts); per ``k`` the median and minimum job/direct ratio, each figure beside the load average
read just before it. ``--modes``: ``inproc`` (engine core in the server process; direct with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and ``async`` (``AsyncLLM``, engine core in its own
process). The idle-machine figure (about 6 minutes on an idle 2-core box)::

    python -m benchmarks.service jobs --sequences 256 --length 256 --k 20 100 \
        --modes inproc async --repeats 5 --json benchmarks/results/service_jobs.json
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
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.harness import Recorder, load1, machine_line, options
from benchmarks.service.common import mode_parser, parse
from tests.server_support import VLLM_ENV, ServerProcess, wait_job


def direct_engine_kwargs(settings: dict) -> dict:
    """``vllm.LLM`` arguments equal to what the service's ``VllmEngine`` passes to ``EngineArgs``
    for these settings (see ``server/engine/vllm.py::VllmEngine._engine_args``)."""
    from logitcache.server.engine import engine_config, model_max_len
    from logitcache.server.engine.vllm import resolve_seq_len

    keys = ("model", "k", "dtype", "max_seq_len")
    model, max_k, dtype, max_seq_len = (settings[key] for key in keys)
    cfg = engine_config(None, model=model, max_k=max_k, dtype=dtype, max_seq_len=max_seq_len)
    _, engine_len = resolve_seq_len(cfg.max_seq_len, model_max_len(cfg.model))
    return dict(
        dtype=cfg.dtype,
        max_model_len=engine_len,
        logprobs_mode="raw_logprobs",
        enable_prefix_caching=False,
        gpu_memory_utilization=cfg.memory_share,
        max_num_seqs=cfg.max_num_seqs,
        seed=cfg.seed,
        enforce_eager=True,
        disable_log_stats=True,
    )


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
    """Phase 1 in its own long-lived process: build ``vllm.LLM`` once, then for every ``run``
    line on stdin time one ``LLM.generate`` over all prompts and print a JSON line."""
    from vllm import LLM, SamplingParams

    prompts = json.loads(Path(args.prompts).read_text())
    engine_kwargs = json.loads(args.engine_kwargs)
    llm = LLM(model=args.model, max_logprobs=args.k, **engine_kwargs)

    def params(k: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=1, prompt_logprobs=k, detokenize=False, flat_logprobs=True, temperature=1.0
        )

    as_inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(as_inputs[:8], params(args.k), use_tqdm=False)  # warm-up
    tokens = sum(len(p) for p in prompts)
    print("READY", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] != "run":
            break
        sp = params(int(words[1]) if len(words) > 1 else args.k)
        t0 = time.perf_counter()
        outs = llm.generate(as_inputs, sp, use_tqdm=False)
        seconds = time.perf_counter() - t0
        assert all(len(o.prompt_logprobs) == len(p) for o, p in zip(outs, prompts, strict=True))
        print(json.dumps({"tokens": tokens, "seconds": seconds}), flush=True)


class DirectWorker:
    """The baseline process (see :func:`direct_worker`); idle (blocked on stdin) between runs."""

    def __init__(
        self, model: str, prompts_file: Path, k: int, engine_kwargs: dict, mode: str = "inproc"
    ):
        env = {**os.environ, **VLLM_ENV}
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if mode == "inproc" else "1"
        cmd = [sys.executable, "-m", "benchmarks.service.jobs", "--direct-worker"]
        cmd += ["--model", model, "--prompts", str(prompts_file), "--k", str(k)]
        cmd += ["--engine-kwargs", json.dumps(engine_kwargs)]
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self._read_until("READY")

    def _read_until(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line
        raise SystemExit(f"direct worker exited with {self.proc.wait()}")

    def run(self, k: int) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"run {k}\n")
        self.proc.stdin.flush()
        res = json.loads(self._read_until("{"))
        res["tokens_per_s"] = res["tokens"] / res["seconds"]
        return res

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(120)


def job_rate(job: dict) -> float:
    started = datetime.fromisoformat(job["started_at"])
    finished = datetime.fromisoformat(job["finished_at"])
    return job["tokens_total"] / (finished - started).total_seconds()


def run_job(client, cache: str, k: int | None = None) -> dict:
    t0 = time.perf_counter()
    body: dict = {"cache": cache, "file": {"path": "bench.jsonl"}}
    if k is not None:
        body["k"] = k
    r = client.post("/v1/jobs", json=body)
    r.raise_for_status()
    job = wait_job(client, r.json()["id"], timeout=3600, interval=0.5)
    wall = time.perf_counter() - t0
    if job["state"] != "succeeded":
        raise SystemExit(f"job failed: {job}")
    return {"tokens": job["tokens_total"], "tokens_per_s": job_rate(job), "client_wall_s": wall}


def run_pairs(
    worker: DirectWorker, server: ServerProcess, ks: list[int], repeats: int, mode: str
) -> dict:
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
                    res = (
                        worker.run(k) if what == "direct" else run_job(c, f"b-{mode}-{k}-{rep}", k)
                    )
                    got[what] = {**res, "load_avg_1min_before": before}
                ratio = got["job"]["tokens_per_s"] / got["direct"]["tokens_per_s"]
                pair = {"k": k, "order": list(order), **got, "ratio": ratio}
                out.setdefault(str(k), {"pairs": []})["pairs"].append(pair)
                print(
                    f"{mode} k={k} pair {rep} ({order[0]} first): direct "
                    f"{got['direct']['tokens_per_s']:,.0f} tok/s (load "
                    f"{got['direct']['load_avg_1min_before']}), job "
                    f"{got['job']['tokens_per_s']:,.0f} tok/s (load "
                    f"{got['job']['load_avg_1min_before']}), job/direct {ratio:.3f}",
                    flush=True,
                )
    for row in out.values():
        ratios = [p["ratio"] for p in row["pairs"]]
        loads = [p[w]["load_avg_1min_before"] for p in row["pairs"] for w in ("direct", "job")]
        row.update(median_ratio=statistics.median(ratios), min_ratio=min(ratios))
        for w in ("direct", "job"):
            rates = [p[w]["tokens_per_s"] for p in row["pairs"]]
            row[f"{w}_median_tokens_per_s"] = statistics.median(rates)
        row["load_avg_1min_range"] = [min(loads), max(loads)]
    return out


def main(argv: list[str] | None = None) -> None:
    p = mode_parser("jobs", __doc__)
    options(p, sequences=512, length=256, k=([8], "one or more k (pairs per k)"))
    options(p, modes=(["inproc"], "engine driver", {"choices": ["inproc", "async"]}))
    options(p, repeats=(2, "pairs (direct, job) per k and mode"))
    from logitcache.server.settings import ServerSettings

    default = {n: f.default for n, f in ServerSettings.model_fields.items()}
    for flag, name in (
        ("--batch-sequences", "job_batch_sequences"),
        ("--batch-tokens", "job_batch_tokens"),
        ("--inflight", "job_inflight_batches"),
    ):
        p.add_argument(
            flag, type=int, default=default[name], help=f"server {name} (default: the service's)"
        )
    hidden = argparse.SUPPRESS
    options(p, direct_worker=(False, hidden), model=(None, hidden), prompts=(None, hidden))
    options(p, engine_kwargs=("{}", hidden))
    args = parse(p, argv)
    if args.direct_worker:
        args.k = args.k[0]
        direct_worker(args)
        return
    if args.sequences < 1 or args.length < 2 or args.repeats < 1 or min(args.k) < 1:
        p.error("need --sequences >= 1, --length >= 2, --repeats >= 1 and --k >= 1")

    from logitcache.fixtures.tiny import build_tiny_models

    t_start = time.perf_counter()
    rec = Recorder("service", "jobs", csv_path=args.csv)
    tiny = build_tiny_models()
    prompts = make_inputs(args.length, args.sequences)
    work = Path(tempfile.mkdtemp(prefix="server-bench-"))
    (work / "data").mkdir()
    (work / "data" / "bench.jsonl").write_text(
        "\n".join(json.dumps({"id": f"w{i}", "input_ids": x}) for i, x in enumerate(prompts))
    )
    prompts_file = work / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    kmax = max(args.k)
    settings = dict(
        model=str(tiny.teacher_dir),
        k=kmax,
        dtype="float32",
        max_seq_len=max(args.length, 512),
        job_batch_sequences=args.batch_sequences,
        job_batch_tokens=args.batch_tokens,
        job_inflight_batches=args.inflight,
    )
    engine_kwargs = direct_engine_kwargs(settings)
    print(
        f"inputs: {args.sequences} x {args.length} tokens, k={args.k}, modes {args.modes}; "
        f"engine {engine_kwargs}; load {load1()}",
        flush=True,
    )

    modes: dict[str, dict] = {}
    for mode in args.modes:
        worker = DirectWorker(str(tiny.teacher_dir), prompts_file, kmax, engine_kwargs, mode)
        server = ServerProcess(
            work / mode, **settings, engine_options=json.dumps({"vllm_mode": mode})
        )
        (work / mode / "data").mkdir(parents=True, exist_ok=True)
        (work / mode / "data" / "bench.jsonl").write_text(
            (work / "data" / "bench.jsonl").read_text()
        )
        server.start()
        try:
            modes[mode] = run_pairs(worker, server, args.k, args.repeats, mode)
            worker.close()
        finally:
            server.stop()
            if worker.proc.poll() is None:
                worker.proc.kill()
    result: dict[str, Any] = {
        "machine": machine_line(rec.machine),
        "command": rec.command,
        "inputs": {"sequences": args.sequences, "length": args.length, "k": args.k},
        "modes": modes,
        "settings": settings,
        "engine_kwargs": engine_kwargs,
        "wall_s": time.perf_counter() - t_start,
    }
    for mode, per_k in modes.items():
        for k, row in per_k.items():
            print(
                f"{mode} k={k}: job/direct median {row['median_ratio']:.3f}, min "
                f"{row['min_ratio']:.3f} over {len(row['pairs'])} pairs (direct median "
                f"{row['direct_median_tokens_per_s']:,.0f} tok/s, job median "
                f"{row['job_median_tokens_per_s']:,.0f}); load average "
                f"{row['load_avg_1min_range'][0]}-{row['load_avg_1min_range'][1]}"
            )
    print(f"wall {result['wall_s']:.0f} s")
    for mode, per_k in modes.items():
        for k, row in per_k.items():
            cfg = result["inputs"] | {"k": int(k), "mode": mode, "pairs": len(row["pairs"])}
            ratios = [p["ratio"] for p in row["pairs"]]
            case, n = f"{mode} k={k}", len(ratios)
            rec.add(case, "job_over_direct", "ratio", row["median_ratio"], config=cfg,
                    p20=min(ratios), p80=max(ratios), samples=n)  # fmt: skip
            for side in ("direct", "job"):
                value = row[f"{side}_median_tokens_per_s"]
                rec.add(case, f"{side}_tokens_per_s", "tok/s", value, config=cfg)
    rec.finish(result, args.json, show=-1)


if __name__ == "__main__":
    main()
