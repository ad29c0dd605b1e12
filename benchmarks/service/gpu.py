"""A teacher job on one GPU with the transformers backend, against the bare model in the same run.

Per teacher shape (``--shapes``: ``8b`` = Llama-3-8B, ``1b`` = Llama-3.2-1B, ``tiny`` for the CPU
test, ``small`` a CPU-sized teacher): a model directory of random bf16 weights a user could serve;
**bare** (the backend's engine in this process: ``device``, ``device_entropy``, ``engine`` rates);
**inproc** (the same engine
object behind the service in this process, the job path's CPU measured by stage and by thread as
:func:`benchmarks.service.cpu.job_run` measures it: the job path is the process's CPU less the
engine's ``device`` and ``engine`` stages; after an untimed warm-up job of ``--inproc-warmup``
sequences, whose figure the JSON keeps apart); **job** (``logitcache-server --backend hf`` in a
subprocess scores ``--sequences`` x ``--seq-len`` random ids through ``POST /v1/jobs``; its server
CPU less the bare engine's share is the ``..._subtraction`` estimate); the cache read back
(bytes/position, tail mass, top-k ids vs the bare engine's). What each phase times:
``benchmarks/results/service.md``, section "The transformers backend on one GPU".

Usage (GPU box, through the harness's device runner; wheels as in
benchmarks/results/service.md, section ``gpu``, msgspec among them: ``fast_paths`` in the JSON
says whether the job path's compiled passes were there)::

    python -m benchmarks.harness device WHEELS -- -m benchmarks.service gpu --shapes 1b 8b \\
        --sequences 1000 --seq-len 2048 --k 100 --json benchmarks/results/service_gpu.json

CPU smoke (tests/repo/test_bench_gpu_suites.py)::

    python -m benchmarks.service gpu --shapes tiny --sequences 6 --seq-len 64 --k 8 \\
        --bare-sequences 2 --inproc-sequences 4 --json /tmp/tj.json --csv /tmp/rows.csv
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import (
    Recorder,
    Sampler,
    free_memory,
    free_port,
    machine,
    md_table,
    options,
    proc_cpu,
    server_process,
    sync,
    thread_cpu,
)
from benchmarks.service.common import mode_parser, parse, run_job, write_jsonl


@dataclass(frozen=True)
class Shape:
    """A Llama-style decoder's shape."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool

    def config(self, max_len: int) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden, num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, intermediate_size=self.ffn, vocab_size=self.vocab,
            tie_word_embeddings=self.tied, max_position_embeddings=max_len, rope_theta=500000.0,
            bos_token_id=0, eos_token_id=1, pad_token_id=None, dtype="bfloat16",
        )  # fmt: skip


SHAPES = {
    "8b": Shape(4096, 32, 32, 8, 14336, 128256, tied=False),  # Llama-3-8B
    "1b": Shape(2048, 16, 32, 8, 8192, 128256, tied=True),  # Llama-3.2-1B
    "small": Shape(512, 8, 8, 2, 1536, 32000, tied=True),  # ~0.2 s per 128-token forward on CPU
    "tiny": Shape(64, 2, 4, 2, 128, 512, tied=False),
}


def word_tokenizer(vocab: int) -> Any:
    """A word-level tokenizer of exactly ``vocab`` tokens ``<t0> .. <t{vocab-1}>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"<t{i}>": i for i in range(vocab)}, unk_token="<t2>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<t0>", eos_token="<t1>", unk_token="<t2>"
    )


def bf16_llama(config: Any, device: Any) -> Any:
    """A ``LlamaForCausalLM`` of ``config`` with random bf16 weights made on ``device``."""
    import torch
    from transformers import LlamaForCausalLM

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)


def make_model_dir(shape: Shape, path: Path, device: str, max_len: int, seed: int = 0) -> dict:
    """config.json + tokenizer + random bf16 weights made on ``device`` (timed)."""
    import torch

    path.mkdir(parents=True, exist_ok=True)
    word_tokenizer(shape.vocab).save_pretrained(path)
    config = shape.config(max_len)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    model = bf16_llama(config, device)
    sync(device.startswith("cuda"))
    t1 = time.perf_counter()
    model.save_pretrained(path)
    t2 = time.perf_counter()
    params = sum(p.numel() for p in model.parameters())
    del model
    free_memory(device.startswith("cuda"))
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return {"params": params, "init_s": t1 - t0, "save_s": t2 - t1, "weights_bytes": size}


def gpu_sampler() -> Sampler:
    """GPU utilisation (%) sampled through NVML every 0.2 s while active (none without NVML)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        return Sampler(lambda: int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu), 0.2)
    except Exception:
        return Sampler(None, 0.2)


def util(gpu: Sampler) -> dict | None:
    """The sampled utilisation's mean (None if nothing was sampled)."""
    return (
        {"mean_pct": float(np.mean(gpu.samples)), "samples": len(gpu.samples)}
        if gpu.samples
        else None
    )


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` sequences of ``length`` uniform random token ids (ids 0..2 are special)."""
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab, size=(n, length)).tolist()


# ------------------------------------------------------------------------------------- bare


def bare(
    model: Path,
    prompts: list[list[int]],
    k: int,
    args: argparse.Namespace,
    inproc: list[list[int]] | None = None,
) -> dict:
    """The backend's engine in this process: device-only rate, then the engine's scoring call;
    then, with ``inproc``, a job over those sequences through the service in this process
    (:func:`inproc_job`)."""
    import torch
    from logitcache.server.engine import build_engine

    t0 = time.perf_counter()
    engine: Any = build_engine(
        model=str(model),
        backend="hf",
        max_k=k,
        dtype="bfloat16",
        max_seq_len=args.seq_len,
    )
    load_s = time.perf_counter() - t0
    positions = sum(len(p) - 1 for p in prompts)
    device = str(engine.device)

    def with_entropy(ps: list[list[int]]) -> None:
        plain = engine.cfg
        engine.cfg = replace(plain, entropy=True)
        try:
            device_only(ps)
        finally:
            engine.cfg = plain

    def device_only(ps: list[list[int]]) -> None:
        with torch.inference_mode():
            for batch in engine._batches(ps):
                hidden = engine._hidden([ps[i] for i in batch])
                rows = torch.cat([hidden[r, : len(ps[i]) - 1] for r, i in enumerate(batch)])
                engine._topk_rows(rows, k, 1.0)
        sync(device.startswith("cuda"))

    out: dict[str, Any] = {"load_s": load_s, "positions": positions, "device": device}
    from logitcache.server.engine.protocol import check_prompts

    checked = check_prompts(prompts, engine.info, engine.array_prompts)  # as score hands them
    warm = checked[:64]  # one job batch
    device_only(warm)
    with_entropy(warm)

    def scored(ps: list[list[int]]) -> list[Any]:
        """The engine's rows of ``ps`` on this thread (a tree whose ``_score_sync`` leaves the
        last batch to its caller: converted here)."""
        got = engine._score_sync(ps, k, 1.0)
        if isinstance(got, tuple):
            got, last = got
            if last is not None:
                last.collect(ps, got)
        return got

    scored(warm)
    for name, fn in (
        ("device", device_only),
        ("device_entropy", with_entropy),
        ("engine", scored),
    ):
        with gpu_sampler() as gpu:
            c0, t0 = time.process_time(), time.perf_counter()
            res = fn(checked)
            sync(device.startswith("cuda"))
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        out[name] = {
            "wall_s": wall,
            "tokens_per_s": sum(len(p) for p in prompts) / wall,
            "positions_per_s": positions / wall,
            "host_cpu_s": cpu,
            "host_cpu_us_per_position": 1e6 * cpu / positions,
            "gpu_util": util(gpu),
        }
        if name == "engine":
            out["rows"] = [(s.topk_ids.copy(), s.topk_logprobs.copy()) for s in res[:4]]
    if inproc:
        out["inproc"] = inproc_job(engine, inproc, k, args)
    return out


def inproc_job(engine: Any, prompts: list[list[int]], k: int, args: argparse.Namespace) -> dict:
    """A job over ``prompts`` through the service in this process behind ``engine``, measured
    as the ``cpu`` mode measures the job path (:func:`benchmarks.service.cpu.job_run`), with the
    server's job settings, as the subprocess server has them."""
    from benchmarks.service import cpu

    settings_kw = {"k": k, "log_level": "warning"}
    warm: dict[str, Any] = {}
    if args.inproc_warmup:  # the first job of a process pays first calls (the cpu mode's warmup)
        warm = cpu.job_run(k, prompts[: args.inproc_warmup], settings_kw, engine)
    with gpu_sampler() as gpu:
        out = cpu.job_run(k, prompts, settings_kw, engine)
    out["gpu_util"] = util(gpu)
    if warm:
        out["warmup"] = {x: warm[x] for x in ("positions", "outside_engine_us_per_position")}
        out["warmup"]["stage_us_per_position"] = warm["stage_us_per_position"]
    out["tokens_per_s"] = sum(len(p) for p in prompts) / out["wall_s"]
    return out


# -------------------------------------------------------------------------------------- job


@contextlib.contextmanager
def hf_server(model: Path, work: Path, *flags: str, timeout: float = 3600) -> Iterator[tuple]:
    """``logitcache-server --backend hf`` as a user would start it, over ``work``'s caches, data
    and state, with more ``flags``: a context yielding ``(process, url, command)``."""
    exe = shutil.which("logitcache-server")
    port, log = free_port(), work / "server.log"
    cmd = [exe] if exe else [sys.executable, "-m", "logitcache.server"]
    cmd += ["--backend", "hf", "--model", str(model), "--store-root", str(work / "caches")]
    cmd += ["--data-dir", str(work / "data"), "--state-dir", str(work / "state")]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *flags]
    url = f"http://127.0.0.1:{port}"
    with server_process(cmd, url + "/health", log=log, timeout=timeout, every=0.25) as proc:
        yield proc, url, cmd


def job(
    model: Path, prompts: list[list[int]], work: Path, args: argparse.Namespace, inflight: int
) -> dict:
    """The service in a subprocess runs one job over ``prompts`` with ``inflight`` batches in the
    engine at once; its rate and host CPU."""
    import httpx

    write_jsonl(work / "data", prompts)
    flags = ["--dtype", "bfloat16", "-k", str(args.k), "--max-seq-len", str(args.seq_len)]
    flags += ["--job-inflight-batches", str(inflight)]  # the server's job batching otherwise
    t0 = time.perf_counter()
    with hf_server(model, work, *flags) as (proc, url, cmd):
        start_s = time.perf_counter() - t0
        with httpx.Client(base_url=url, timeout=60.0) as c, gpu_sampler() as gpu:
            threads0, cpu0 = thread_cpu(proc.pid), proc_cpu(proc.pid)
            st = run_job(c, "bench", args.k, poll=1.0, log=work / "server.log")
            cpu, threads1 = proc_cpu(proc.pid) - cpu0, thread_cpu(proc.pid)
    positions = sum(len(p) - 1 for p in prompts)
    per_thread = {n: round(v - threads0.get(n, 0.0), 3) for n, v in threads1.items()}
    return {
        "command": " ".join(cmd),
        "server_start_s": start_s,
        "tokens": st["tokens_total"],
        "positions": positions,
        **{x: st[x] for x in ("job_s", "client_wall_s", "tokens_per_s")},
        "positions_per_s": positions / st["job_s"],
        "server_cpu_s": cpu,
        "server_cpu_us_per_position": 1e6 * cpu / positions,
        "server_cores": cpu / st["client_wall_s"],
        "busiest_threads_cpu_s": dict(sorted(per_thread.items(), key=lambda x: -x[1])[:6]),
        "threads_seen": len(per_thread),
        "gpu_util": util(gpu),
    }


def cache_stats(root: Path, bare_rows: list, sample: int) -> dict:
    """Bytes per position on disk, tail-mass quantiles, agreement with the bare engine's ids."""
    from logitcache.cache_format import CacheReader

    reader = CacheReader(str(root))
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    tails = []
    keys = sorted(reader.keys)
    for key in keys[:sample]:
        rec = reader.get(key)
        tails.append(1.0 - np.exp(rec.topk_logprobs.astype(np.float64)).sum(axis=1))
    tail = np.concatenate(tails)
    same, total, lp_err = 0, 0, 0.0
    for i, (ids, lps) in enumerate(bare_rows):
        rec = reader.get(f"s{i:06d}")
        same += int((rec.topk_ids[:, :10] == ids[:, :10]).sum())
        total += ids[:, :10].size
        lp_err = max(lp_err, float(np.abs(rec.topk_logprobs[:, 0] - lps[:, 0]).max()))
    q = [0.0, 0.01, 0.1, 0.5, 0.9, 0.99, 1.0]
    return {
        "rows": int(reader.num_rows),
        "bytes_on_disk": size,
        "bytes_per_position": size / max(1, reader.num_rows),
        "tail_mass": {
            "rows_read": int(tail.size),
            "mean": float(tail.mean()),
            "quantiles": {str(x): float(np.quantile(tail, x)) for x in q},
        },
        "top10_ids_equal_to_bare": same / max(1, total),
        "top1_logprob_max_abs_diff_vs_bare": lp_err,
    }


# ------------------------------------------------------------------------------------- main


def run_shape(name: str, args: argparse.Namespace, work: Path) -> dict:
    import torch

    shape = SHAPES[name]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = work / f"model-{name}"
    made = make_model_dir(shape, model, device, max(args.seq_len, 2048))
    print(f"[{name}] weights made and saved: {made}", flush=True)
    prompts = make_prompts(args.sequences, args.seq_len, shape.vocab, seed=1)
    inproc = prompts[: args.inproc_sequences]
    b = bare(model, prompts[: args.bare_sequences], args.k, args, inproc)
    free_memory(device.startswith("cuda"))  # the bare engine is gone with bare()'s frame
    rows = b.pop("rows")
    ip = b.get("inproc", {})
    shown = {x: y for x, y in b.items() if x != "inproc"}
    print(f"[{name}] bare: {json.dumps(shown)}", flush=True)
    if ip:
        stages = {x: round(y, 3) for x, y in ip["stage_us_per_position"].items()}
        print(
            f"[{name}] inproc: {ip['outside_engine_us_per_position']:.2f} CPU-us/position of "
            f"job path ({ip['us_per_position']:.2f} with the engine's host work; device "
            f"{ip['device_us_per_position']:.2f}), {ip['tokens_per_s']:.0f} tok/s, "
            f"{ip['appends']} appends; stages {stages}; untimed warm-up job before it: "
            f"{ip.get('warmup', {}).get('outside_engine_us_per_position', float('nan')):.2f}",
            flush=True,
        )
    jobs = {}
    for inflight in args.job_inflight_batches:  # the first is the reported job
        j = job(model, prompts, work / f"job-{name}-{inflight}", args, inflight)
        shown = {x: y for x, y in j.items() if x != "command"}
        print(f"[{name}] job, {inflight} batches in flight: {json.dumps(shown)}", flush=True)
        jobs[inflight] = j
    inflight = args.job_inflight_batches[0]
    j = jobs[inflight]
    stats = cache_stats(
        work / f"job-{name}-{inflight}" / "caches" / "bench", rows, args.tail_sequences
    )
    eng = b["engine"]
    eng_cores = eng["host_cpu_s"] / eng["wall_s"]
    engine_share_s = eng_cores * j["job_s"]  # the engine works from start to finish
    result = {
        "shape": shape.__dict__,
        "made": made,
        "bare": b,
        "job": j,
        "jobs_by_inflight_batches": {
            str(n): {"tokens_per_s": x["tokens_per_s"], "server_cores": x["server_cores"]}
            | {"ratio_vs_bare_device": x["tokens_per_s"] / b["device"]["tokens_per_s"]}
            for n, x in jobs.items()
        },
        "cache": stats,
        "ratio_job_vs_bare_device": j["tokens_per_s"] / b["device"]["tokens_per_s"],
        "ratio_job_vs_bare_engine": j["tokens_per_s"] / b["engine"]["tokens_per_s"],
        "ratio_entropy_vs_device": b["device_entropy"]["tokens_per_s"]
        / b["device"]["tokens_per_s"],
        "bare_engine_cores": eng_cores,
        "job_path_cpu_us_per_position_subtraction": (
            1e6 * (j["server_cpu_s"] - engine_share_s) / j["positions"]
        ),
        "job_path_cpu_us_per_position_per_position_subtraction": (
            j["server_cpu_us_per_position"] - eng["host_cpu_us_per_position"]
        ),
        "job_path_cores_subtraction": (j["server_cpu_s"] - engine_share_s) / j["job_s"],
    }
    if ip:  # measured thread by thread (the cpu mode's figure)
        result["job_path_cpu_method"] = "inproc, per thread and stage"
        result["job_path_cpu_us_per_position"] = ip["outside_engine_us_per_position"]
        result["job_path_cpu_us_per_position_with_engine_host"] = ip["us_per_position"]
        per_position = ip["outside_engine_us_per_position"]
        result["job_path_cores"] = per_position * ip["positions_per_s"] / 1e6
    else:
        result["job_path_cpu_method"] = "subprocess, engine share subtracted"
        result["job_path_cpu_us_per_position"] = result["job_path_cpu_us_per_position_subtraction"]
        result["job_path_cores"] = result["job_path_cores_subtraction"]
    shutil.rmtree(model, ignore_errors=True)
    return result


def fast_paths() -> dict[str, bool]:
    """Whether this environment has the job path's compiled passes, which its CPU per position
    depends on: the writer's encode (numba; without it the numpy pass, ~2.5x the encode stage)
    and the JSONL input-ids reader (msgspec + numba; without them each line of the input goes
    through ``json``: the ``submit`` stage 0.12-0.13 instead of 0.04 CPU-us/position at 2,048
    tokens per sequence, measured on the VM)."""
    from logitcache.cache_format import fastencode
    from logitcache.server.inputs import jsonids

    return {"encode_numba": fastencode.ready(), "jsonl_ids_msgspec": jsonids.ready()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = mode_parser("gpu", __doc__)
    options(p, shapes=(["1b", "8b"], None, {"choices": sorted(SHAPES)}), sequences=1000)
    options(p, seq_len=2048, k=100, bare_sequences=128)
    options(
        p,
        inproc_sequences=(256, "sequences of the in-process job measured stage by stage (0: none)"),
        inproc_warmup=(16, "sequences of an untimed in-process job before it (0: none)"),
        tail_sequences=(64, "sequences read for tail mass"),
        job_inflight_batches=(
            [2],
            "the HTTP job once per value: job batches in the engine at "
            "once (the server's --job-inflight-batches); the first is reported",
        ),
        work=(None, "scratch folder (default: a temp dir)", {"type": Path}),
    )
    return parse(p, argv)


def main(argv: list[str] | None = None) -> dict:
    from benchmarks.service import cpu

    args = parse_args(argv)
    cpu._track_thread_ends()  # the in-process job's writer thread ends inside the job
    work = args.work or Path(tempfile.mkdtemp(prefix="teacher-job-"))
    given = sys.argv[1:] if argv is None else ["gpu", *argv]
    command = " ".join(["python -m benchmarks.service", *given])
    rec = Recorder("service", "gpu", csv_path=args.csv, command=command)
    result: dict[str, Any] = {"command": rec.command, "machine": machine(), "shapes": {}}
    result["fast_paths"] = fast_paths()
    print(f"fast paths: {json.dumps(result['fast_paths'])}", flush=True)
    for name in args.shapes:
        result["shapes"][name] = run_shape(name, args, work)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1))
    head = ["shape", "bare tok/s", "job tok/s", "ratio", "job us/pos", "cores", "B/pos", "tail p50"]
    rows = [
        [name, f"{r['bare']['device']['tokens_per_s']:.0f}", f"{r['job']['tokens_per_s']:.0f}"]
        + [f"{r['ratio_job_vs_bare_device']:.3f}", f"{r['job_path_cpu_us_per_position']:.2f}"]
        + [f"{r['job']['server_cores']:.2f}", f"{r['cache']['bytes_per_position']:.0f}"]
        + [f"{r['cache']['tail_mass']['quantiles']['0.5']:.4f}"]
        for name, r in result["shapes"].items()
    ]
    print(md_table(head, rows))
    for name, r in result["shapes"].items():
        record(rec, name, r, args)
    rec.finish(result, args.json, indent=1, show=-1)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return result


def record(rec: Recorder, name: str, r: dict, args: argparse.Namespace) -> None:
    """The CSV rows of one teacher shape."""
    config = {"shape": name, "k": args.k, "seq_len": args.seq_len, "sequences": args.sequences}
    cpu_config = config | {"job_path_cpu_method": r["job_path_cpu_method"]}
    bare, job, cache = r["bare"], r["job"], r["cache"]
    for metric, unit, value in (
        ("bare_device_tokens_per_s", "tok/s", bare["device"]["tokens_per_s"]),
        ("bare_engine_tokens_per_s", "tok/s", bare["engine"]["tokens_per_s"]),
        ("job_tokens_per_s", "tok/s", job["tokens_per_s"]),
        ("entropy_vs_device", "x", r["ratio_entropy_vs_device"]),
        ("job_vs_bare_device", "x", r["ratio_job_vs_bare_device"]),
    ):
        rec.add(name, metric, unit, value, config=config)
    for metric, unit, value in (
        ("job_path_cpu_per_position", "us", r["job_path_cpu_us_per_position"]),
        (
            "job_path_cpu_per_position_subtraction",
            "us",
            r["job_path_cpu_us_per_position_subtraction"],
        ),
        ("server_cores", "cores", job["server_cores"]),
        ("bytes_per_position", "B", cache["bytes_per_position"]),
        ("tail_mass_p50", "", cache["tail_mass"]["quantiles"]["0.5"]),
    ):
        rec.add(name, metric, unit, value, config=cpu_config)


if __name__ == "__main__":
    main()
