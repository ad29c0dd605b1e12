"""A teacher job on one GPU with the transformers backend, against the bare model in the same run.

Per teacher shape (``--shapes``: ``8b`` = Llama-3-8B, ``1b`` = Llama-3.2-1B; ``small`` and
``tiny`` for CPUs): a model directory of random bf16 weights a user could serve; **bare** (the
backend's engine in this process: ``device`` and ``engine`` rates); **inproc** (the same engine
behind the service in this process after an untimed warm-up job, the job path's CPU measured by
stage and thread as :func:`benchmarks.service.cpu.job_run` does); **job** (``logitcache-server
--backend hf`` in a subprocess scores ``--sequences`` x ``--seq-len`` random ids through ``POST
/v1/jobs``, once per ``--job-inflight-batches``); the cache read back (bytes/position, tail mass,
top-k ids vs the bare engine's). The page: ``benchmarks/results/service.md``, section ``gpu``.

    python -m benchmarks.harness device WHEELS -- -m benchmarks.service gpu --shapes 1b 8b \\
        --sequences 1000 --seq-len 2048 --k 100 --json benchmarks/results/service_gpu.json
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import (
    Sampler,
    free_memory,
    free_port,
    log,
    proc_cpu,
    server_process,
    sync,
    thread_cpu,
)
from benchmarks.service.common import parse, recorded, run_job, write_jsonl
from benchmarks.synthetic import store_bytes


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
    """config.json, a word-level tokenizer of ``shape.vocab`` tokens ``<t0> ..`` and random bf16
    weights made on ``device`` (timed)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    words = {f"<t{i}>": i for i in range(shape.vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<t2>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    special = {"bos_token": "<t0>", "eos_token": "<t1>", "unk_token": "<t2>"}
    PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(path)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    model = bf16_llama(shape.config(max_len), device)
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
    if not gpu.samples:
        return None
    return {"mean_pct": float(np.mean(gpu.samples)), "samples": len(gpu.samples)}


def bare(model: Path, prompts: list[list[int]], args: argparse.Namespace, inproc: list) -> dict:
    """The backend's engine in this process: the device-only rate (decoder forward + chunked
    lm-head top-k, left on the device), the engine's scoring call's; then an in-process job over
    ``inproc`` behind the same engine (:func:`inproc_job`)."""
    import torch
    from logitcache.server.engine import build_engine
    from logitcache.server.engine.protocol import check_prompts

    t0 = time.perf_counter()
    engine: Any = build_engine(
        model=str(model), backend="hf", max_k=args.k, dtype="bfloat16", max_seq_len=args.seq_len
    )
    positions = sum(len(p) - 1 for p in prompts)
    device = str(engine.device)
    out: dict[str, Any] = {"load_s": time.perf_counter() - t0, "positions": positions}

    def device_only(ps: list[list[int]]) -> None:
        with torch.inference_mode():
            for batch in engine._batches(ps):
                hidden = engine._hidden([ps[i] for i in batch])
                rows = torch.cat([hidden[r, : len(ps[i]) - 1] for r, i in enumerate(batch)])
                engine._topk_rows(rows, args.k, 1.0)

    def scored(ps: list[list[int]]) -> list[Any]:
        """The engine's rows of ``ps`` on this thread (its last batch collected here)."""
        got, last = engine._score_sync(ps, args.k, 1.0)
        if last is not None:
            last.collect(ps, got)
        return got

    checked = check_prompts(prompts, engine.info, engine.array_prompts)  # as score hands them
    device_only(checked[:64])  # warm-up: one job batch
    scored(checked[:64])
    for name, fn in (("device", device_only), ("engine", scored)):
        with gpu_sampler() as gpu:
            c0, t0 = time.process_time(), time.perf_counter()
            res = fn(checked)
            sync(device.startswith("cuda"))
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        out[name] = {
            "wall_s": wall, "tokens_per_s": sum(len(p) for p in prompts) / wall,
            "positions_per_s": positions / wall, "host_cpu_s": cpu,
            "host_cpu_us_per_position": 1e6 * cpu / positions, "gpu_util": util(gpu),
        }  # fmt: skip
    out["rows"] = [(s.topk_ids.copy(), s.topk_logprobs.copy()) for s in res[:4]]
    out["inproc"] = inproc_job(engine, inproc, args)
    return out


def inproc_job(engine: Any, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """A job over ``prompts`` through the service in this process behind ``engine``, measured as
    the ``cpu`` mode measures it, with the subprocess server's job settings; first an untimed
    job of ``--inproc-warmup`` sequences (a process's first job pays first calls)."""
    from benchmarks.service import cpu

    settings_kw = {"k": args.k, "log_level": "warning"}
    if args.inproc_warmup:
        warm = cpu.job_run(args.k, prompts[: args.inproc_warmup], settings_kw, engine)
    with gpu_sampler() as gpu:
        out = cpu.job_run(args.k, prompts, settings_kw, engine)
    out["gpu_util"] = util(gpu)
    if args.inproc_warmup:
        keep = ("positions", "outside_engine_us_per_position", "stage_us_per_position")
        out["warmup"] = {x: warm[x] for x in keep}
    out["tokens_per_s"] = sum(len(p) for p in prompts) / out["wall_s"]
    return out


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
    engine at once (the server's job batching otherwise); its rate and host CPU."""
    import httpx

    write_jsonl(work / "data", prompts)
    flags = ["--dtype", "bfloat16", "-k", str(args.k), "--max-seq-len", str(args.seq_len)]
    flags += ["--job-inflight-batches", str(inflight)]
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
        "command": " ".join(cmd), "server_start_s": start_s, "tokens": st["tokens_total"],
        "positions": positions, **{x: st[x] for x in ("job_s", "client_wall_s", "tokens_per_s")},
        "positions_per_s": positions / st["job_s"], "server_cpu_s": cpu,
        "server_cpu_us_per_position": 1e6 * cpu / positions,
        "server_cores": cpu / st["client_wall_s"],
        "busiest_threads_cpu_s": dict(sorted(per_thread.items(), key=lambda x: -x[1])[:6]),
        "threads_seen": len(per_thread), "gpu_util": util(gpu),
    }  # fmt: skip


def cache_stats(root: Path, bare_rows: list, sample: int) -> dict:
    """Bytes per position on disk, tail-mass quantiles, agreement with the bare engine's ids."""
    from logitcache.cache_format import CacheReader

    reader = CacheReader(str(root))
    size = store_bytes(root)
    lps = [reader.get(key).topk_logprobs for key in sorted(reader.keys)[:sample]]
    tail = np.concatenate([1.0 - np.exp(x.astype(np.float64)).sum(axis=1) for x in lps])
    same, total, lp_err = 0, 0, 0.0
    for i, (ids, lp) in enumerate(bare_rows):
        rec = reader.get(f"s{i:06d}")
        same += int((rec.topk_ids[:, :10] == ids[:, :10]).sum())
        total += ids[:, :10].size
        lp_err = max(lp_err, float(np.abs(rec.topk_logprobs[:, 0] - lp[:, 0]).max()))
    q = [0.0, 0.01, 0.1, 0.5, 0.9, 0.99, 1.0]
    return {
        "rows": int(reader.num_rows), "bytes_on_disk": size,
        "bytes_per_position": size / max(1, reader.num_rows),
        "tail_mass": {"rows_read": int(tail.size), "mean": float(tail.mean()),
                      "quantiles": {str(x): float(np.quantile(tail, x)) for x in q}},
        "top10_ids_equal_to_bare": same / max(1, total),
        "top1_logprob_max_abs_diff_vs_bare": lp_err,
    }  # fmt: skip


def run_shape(name: str, args: argparse.Namespace, work: Path) -> dict:
    import torch

    shape = SHAPES[name]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = work / f"model-{name}"
    made = make_model_dir(shape, model, device, max(args.seq_len, 2048))
    log(name, "weights made and saved", made)
    rng = np.random.default_rng(1)  # ids 0..2 are special
    prompts = rng.integers(3, shape.vocab, size=(args.sequences, args.seq_len)).tolist()
    b = bare(model, prompts[: args.bare_sequences], args, prompts[: args.inproc_sequences])
    free_memory(device.startswith("cuda"))  # the bare engine is gone with bare()'s frame
    rows, ip = b.pop("rows"), b["inproc"]
    log(name, "bare", json.dumps({x: y for x, y in b.items() if x != "inproc"}))
    jobs = {}
    for inflight in args.job_inflight_batches:  # the first is the reported job
        j = job(model, prompts, work / f"job-{name}-{inflight}", args, inflight)
        log(name, f"job, {inflight} in flight", json.dumps(j))
        jobs[inflight] = j
    first = args.job_inflight_batches[0]
    j, device_rate = jobs[first], b["device"]["tokens_per_s"]
    stats = cache_stats(
        work / f"job-{name}-{first}" / "caches" / "bench", rows, args.tail_sequences
    )
    shutil.rmtree(model, ignore_errors=True)
    return {
        "shape": shape.__dict__, "made": made, "bare": b, "job": j, "cache": stats,
        "jobs_by_inflight_batches": {
            str(n): {"tokens_per_s": x["tokens_per_s"], "server_cores": x["server_cores"],
                     "ratio_vs_bare_device": x["tokens_per_s"] / device_rate}
            for n, x in jobs.items()
        },
        "ratio_job_vs_bare_device": j["tokens_per_s"] / device_rate,
        "ratio_job_vs_bare_engine": j["tokens_per_s"] / b["engine"]["tokens_per_s"],
        "job_path_cpu_us_per_position": ip["outside_engine_us_per_position"],
        "job_path_cpu_us_per_position_with_engine_host": ip["us_per_position"],
        "job_path_cores": ip["outside_engine_us_per_position"] * ip["positions_per_s"] / 1e6,
    }  # fmt: skip


def fast_paths() -> dict[str, bool]:
    """Whether the job path's compiled passes are here (its CPU per position depends on them):
    the writer's encode (numba) and the JSONL input-ids reader (msgspec + numba)."""
    from logitcache.cache_format import fastencode
    from logitcache.server.inputs import jsonids

    return {"encode_numba": fastencode.ready(), "jsonl_ids_msgspec": jsonids.ready()}


def main(argv: list[str] | None = None) -> dict:
    from benchmarks.service import cpu

    args = parse(
        "gpu", __doc__, argv, shapes=(["1b", "8b"], None, {"choices": sorted(SHAPES)}),
        sequences=1000, seq_len=2048, k=100, bare_sequences=128,
        inproc_sequences=(256, "sequences of the in-process job measured stage by stage"),
        inproc_warmup=(16, "sequences of an untimed in-process job before it (0: none)"),
        tail_sequences=(64, "sequences read for tail mass"),
        job_inflight_batches=([2], "the HTTP job once per value: job batches in the engine at "
                              "once (the server's --job-inflight-batches); the first is reported"),
        work=(None, "scratch folder (default: a temp dir)", {"type": Path}),
    )  # fmt: skip
    cpu.track_thread_ends()  # the in-process job's writer thread ends inside the job
    work = args.work or Path(tempfile.mkdtemp(prefix="teacher-job-"))
    head, rec = recorded("gpu", args)
    result: dict[str, Any] = head | {"fast_paths": fast_paths(), "shapes": {}}
    log("fast paths", json.dumps(result["fast_paths"]))
    for name in args.shapes:
        result["shapes"][name] = r = run_shape(name, args, work)
        if args.json:  # a shape's result is kept if a later one fails
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1))
        bare, job, cache = r["bare"], r["job"], r["cache"]
        config = {"shape": name}
        for metric, unit, value in (
            ("bare_device_tokens_per_s", "tok/s", bare["device"]["tokens_per_s"]),
            ("bare_engine_tokens_per_s", "tok/s", bare["engine"]["tokens_per_s"]),
            ("job_tokens_per_s", "tok/s", job["tokens_per_s"]),
            ("job_vs_bare_device", "x", r["ratio_job_vs_bare_device"]),
            ("job_path_cpu_per_position", "us", r["job_path_cpu_us_per_position"]),
            ("server_cores", "cores", job["server_cores"]),
            ("bytes_per_position", "B", cache["bytes_per_position"]),
            ("tail_mass_p50", "", cache["tail_mass"]["quantiles"]["0.5"]),
        ):
            rec.add(name, metric, unit, value, config=config)
    print(rec.table())
    rec.finish(result, args.json, indent=1, show=-1)
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
