"""One distillation training step on one GPU: online KD (teacher in memory, run every step)
against offline KD from a logitcache cache (the student alone).

Student ``--student`` (1B-shaped), teacher ``--teacher`` (8B-shaped), random bf16 weights;
AdamW (fused), activation checkpointing, SDPA. Variants: ``online_dense`` (full teacher logits,
fp32 ``kl_div``), ``online_liger`` (Liger's fused linear JSD, beta 0; CUDA), ``offline_local`` /
``offline_http`` (``CacheDataset`` on local disk / over the service's store route,
``topk_distill_loss``); the cache is written in the same run by the same teacher on the same
ids. Per variant and size: ``--warmup`` steps, then ``--steps`` timed ones (median,
``max_memory_allocated``); an OOM ends the variant. The page:
``benchmarks/results/train_step.md``; ``plot`` redraws ``train_step.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import (
    Recorder,
    add_csv_option,
    free_memory,
    line_plot,
    machine,
    options,
    suite_parser,
    sync,
)
from benchmarks.service.gpu import (
    SHAPES,
    Shape,
    bf16_llama,
    gpu_sampler,
    hf_server,
    make_model_dir,
    util,
)
from benchmarks.synthetic import store_bytes

VARIANTS = ("online_dense", "online_liger", "offline_local", "offline_http")
OFFLINE = ("offline_local", "offline_http")


def make_model(shape_name: str, device: torch.device, seq_len: int, seed: int) -> Any:
    """A random bf16 Llama-style model of ``SHAPES[shape_name]`` made on ``device``."""
    torch.manual_seed(seed)
    config = SHAPES[shape_name].config(max(seq_len, 2048))
    config._attn_implementation = "sdpa"
    return bf16_llama(config, device)


def teacher_topk(teacher: Any, ids: torch.Tensor, k: int, chunk: int = 1024) -> tuple:
    """Top-``k`` ids and logprobs ``[B, T, k]`` of the teacher on ``ids [B, T]``."""
    with torch.no_grad():
        h = teacher.model(input_ids=ids).last_hidden_state.flatten(0, 1)
        out_i, out_v = [], []
        for part in h.split(chunk):
            z = teacher.lm_head(part).float()
            v, i = torch.topk(z, k, dim=-1)
            out_v.append(v - torch.logsumexp(z, dim=-1, keepdim=True))
            out_i.append(i.to(torch.int32))
    shape = (*ids.shape, k)
    return torch.cat(out_i).view(shape), torch.cat(out_v).view(shape)


def write_cache(teacher: Any, tokens: torch.Tensor, k: int, path: Path, batch: int) -> dict:
    """The teacher's top-``k`` of every sequence of ``tokens [S, T]`` into a cache at ``path``
    (row ``j`` of a sequence predicts token ``j + 1``: its last position has no row)."""
    from logitcache.cache_format import CacheWriter, Manifest, SequenceRecord

    manifest = Manifest(
        teacher_model="random-llama-bench-teacher",
        tokenizer_fingerprint="bench-word-level",
        vocab_size=int(teacher.config.vocab_size),
        k=k,
    )
    t0 = time.perf_counter()
    with CacheWriter.open(str(path), manifest) as writer:
        for start in range(0, tokens.shape[0], batch):
            ids = tokens[start : start + batch]
            host = ids.cpu().numpy().astype("int32")
            keys = [f"s{start + r:06d}" for r in range(ids.shape[0])]
            tid, tlp = (t.cpu().numpy() for t in teacher_topk(teacher, ids, k))
            recs = [
                SequenceRecord(key, i, topk_ids=a[:-1], topk_logprobs=b[:-1])
                for key, i, a, b in zip(keys, host, tid, tlp, strict=True)
            ]
            writer.append(recs)
    size = store_bytes(path)
    rows = tokens.shape[0] * (tokens.shape[1] - 1)
    return {"seconds": time.perf_counter() - t0, "rows": rows, "bytes_per_row": size / rows}


def student_hidden(student: Any, ids: torch.Tensor) -> torch.Tensor:
    return student.model(input_ids=ids).last_hidden_state


def online_dense(student: Any, teacher: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        t_logits = teacher.lm_head(teacher.model(input_ids=ids).last_hidden_state)
        t_logp = torch.log_softmax(t_logits.float(), dim=-1).flatten(0, 1)
        del t_logits
    s_logits = student.lm_head(student_hidden(student, ids))
    s_logp = torch.log_softmax(s_logits.float(), dim=-1).flatten(0, 1)
    return torch.nn.functional.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean")


def make_liger() -> Callable[..., torch.Tensor]:
    from liger_kernel.transformers import LigerFusedLinearJSD

    jsd = LigerFusedLinearJSD(jsd_beta=0.0)  # beta 0: forward KL(teacher || student)

    def online_liger(student: Any, teacher: Any, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            th = teacher.model(input_ids=ids).last_hidden_state.flatten(0, 1)
        sh = student_hidden(student, ids).flatten(0, 1)
        return jsd(sh, student.lm_head.weight, th, teacher.lm_head.weight, None)

    return online_liger


def offline(student: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    from logitcache.client.loss import topk_distill_loss

    sh, w = student_hidden(student, batch["input_ids"]), student.lm_head.weight
    return topk_distill_loss(
        sh, w, batch["topk_ids"], batch["topk_logprobs"], mask=batch["loss_mask"]
    )


def loader(source: str, cache: str | None, seqs: int, seq_len: int) -> Iterator[dict]:
    """Batches of ``seqs`` sequences from a ``CacheDataset`` (one pass over the cache)."""
    from logitcache.client import CacheDataset, StreamConfig, open_source

    src = open_source(source, cache=cache) if cache else source
    stream = StreamConfig(tokens_per_item=seq_len, mode="pad", batch_size=seqs, seed=0)
    return iter(CacheDataset(src, stream))


def measure(
    step: Callable[[], torch.Tensor], opt: Any, device: torch.device, warmup: int, steps: int
) -> dict:
    """``warmup`` + ``steps`` optimizer steps of ``step()``'s loss; median time, peak memory."""

    def one() -> float:
        t0 = time.perf_counter()
        loss = step()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device.type == "cuda")
        if not torch.isfinite(loss.detach()).item():
            raise FloatingPointError(f"loss {loss.item()}")
        return time.perf_counter() - t0

    for _ in range(warmup):
        one()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with gpu_sampler() as gpu:
        times = [one() for _ in range(steps)]
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return {
        "step_s": statistics.median(times),
        "step_s_all": times,
        "peak_gib": None if peak is None else peak / 2**30,
        "gpu_util": util(gpu),
    }


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def run_variant(
    name: str,
    sizes: list[int],
    make_step: Callable[[int], Callable[[], torch.Tensor]],
    opt: Any,
    device: torch.device,
    args: argparse.Namespace,
    out: dict,
) -> None:
    """Every size of one variant; an OOM (or other failure) ends the variant."""
    out[name] = {}
    for tokens in sizes:
        failed = None
        try:
            r = measure(make_step(tokens), opt, device, args.warmup, args.steps)
            r["tokens_per_s"] = tokens / r["step_s"]
            out[name][str(tokens)] = r
            print(f"[{name}] {tokens}: {json.dumps(r)}", flush=True)
        except Exception as e:  # OOM ends the variant; anything else is recorded too
            failed = {"oom" if is_oom(e) else "error": f"{type(e).__name__}: {e}"[:300]}
        opt.zero_grad(set_to_none=True)
        # outside the except block: its traceback no longer holds the tensors
        free_memory(device.type == "cuda")
        if failed is not None:
            out[name][str(tokens)] = failed
            print(f"[{name}] {tokens}: {failed}", flush=True)
        if args.json:
            args.json.write_text(json.dumps(args.result, indent=1))
        if failed is not None:
            break


def stand_in_server(work: Path, vocab: int) -> Any:
    """``logitcache-server`` over ``work/caches`` with a tiny stand-in model of ``vocab`` ids: a
    context yielding ``(process, url, command)``."""
    model_dir = work / "stand-in"
    make_model_dir(Shape(64, 1, 4, 2, 128, vocab, tied=True), model_dir, "cpu", 2048)
    return hf_server(model_dir, work, "--engine-options", '{"device": "cpu"}', timeout=300)


def main(argv: list[str] | None = None) -> dict | None:
    given = sys.argv[1:] if argv is None else list(argv)
    p, sub = suite_parser("train_step", __doc__)
    pl = sub.add_parser("plot", help="train_step.png from a result JSON")
    pl.add_argument("result", type=Path)
    pl.add_argument("out_dir", type=Path)
    r = sub.add_parser("run", help="every variant x tokens per step")
    shape = {"choices": sorted(SHAPES)}
    options(r, student=("1b", None, shape), teacher=("8b", None, shape), seq_len=2048, k=100)
    options(r, tokens=[8192, 32768, 65536, 131072], warmup=1, steps=3)
    options(r, variants=(list(VARIANTS), None, {"choices": VARIANTS}))
    options(r, work=(None, None, {"type": Path}), json=(None, None, {"type": Path}))
    add_csv_option(r)
    args = p.parse_args(given)
    if args.mode == "plot":
        print(plot(args.result, args.out_dir))
        return None
    if any(t % args.seq_len for t in args.tokens):
        p.error("every --tokens must be a multiple of --seq-len")
    command = " ".join(["python -m benchmarks.train_step", *given])
    config = {"student": args.student, "teacher": args.teacher, "seq_len": args.seq_len}
    return run(
        args, Recorder("train_step", "run", csv_path=args.csv, command=command, config=config)
    )


def run(args: argparse.Namespace, rec: Recorder) -> dict:
    """Online variants, the cache, offline variants; the result (also in ``--json``)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    work = args.work or Path(tempfile.mkdtemp(prefix="train-step-"))
    result: dict[str, Any] = {"command": rec.command, "machine": machine()}
    result |= {"student": args.student, "teacher": args.teacher, "seq_len": args.seq_len}
    result |= {"k": args.k, "variants": {}}
    args.result = result
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
    sizes = sorted(args.tokens)
    seqs_max = sizes[-1] // args.seq_len
    n_seqs = seqs_max * (args.warmup + args.steps)
    vocab = SHAPES[args.teacher].vocab
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, vocab, (n_seqs, args.seq_len), generator=gen).to(device)

    student = make_model(args.student, device, args.seq_len, seed=0)
    student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    student.config.use_cache = False
    student.train()
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(student.parameters(), lr=1e-5, fused=fused)
    teacher = make_model(args.teacher, device, args.seq_len, seed=1).eval()
    teacher.requires_grad_(False)
    sync(device.type == "cuda")
    base = torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else None
    result["memory_before_gib"] = {"student_and_teacher_weights": base}

    def batch_of(n: int) -> Callable[[], torch.Tensor]:
        state = {"i": 0}

        def ids() -> torch.Tensor:
            s = (state["i"] * n) % n_seqs
            state["i"] += 1
            return tokens[s : s + n]

        return ids

    online: dict[str, Callable[..., torch.Tensor]] = {}
    if "online_dense" in args.variants:
        online["online_dense"] = online_dense
    if "online_liger" in args.variants and device.type != "cuda":
        result["variants"]["online_liger"] = {"skipped": "needs CUDA (Triton)"}
    elif "online_liger" in args.variants:
        online["online_liger"] = make_liger()
    for name, fn in online.items():

        def make_step(t: int, fn: Any = fn) -> Callable[[], torch.Tensor]:
            ids = batch_of(t // args.seq_len)
            return lambda: fn(student, teacher, ids())

        run_variant(name, sizes, make_step, opt, device, args, result["variants"])

    cache_dir = work / "caches" / "bench"
    if {"offline_local", "offline_http"} & set(args.variants):
        result["cache"] = write_cache(teacher, tokens, args.k, cache_dir, batch=4)
        print(f"[cache] {result['cache']}", flush=True)
    teacher = None  # the offline variants run without it
    free_memory(device.type == "cuda")
    result["memory_before_gib"]["student_only"] = (
        torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else None
    )

    sources: dict[str, tuple[str, str | None]] = {}
    servers = contextlib.ExitStack()
    if "offline_local" in args.variants:
        sources["offline_local"] = (str(cache_dir), None)
    if "offline_http" in args.variants:
        try:
            _, url, _ = servers.enter_context(stand_in_server(work, vocab))
            sources["offline_http"] = (url, "bench")
        except Exception as e:
            result["variants"]["offline_http"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    with servers:
        for name, (source, cache) in sources.items():

            def make_offline_step(t: int, source: str = source, cache: str | None = cache) -> Any:
                it = loader(source, cache, t // args.seq_len, args.seq_len)

                def step() -> torch.Tensor:
                    b = {
                        k: v.to(device, non_blocking=True)
                        for k, v in next(it).items()
                        if isinstance(v, torch.Tensor)
                    }
                    return offline(student, b)

                return step

            run_variant(name, sizes, make_offline_step, opt, device, args, result["variants"])

    summarize(result, sizes)
    for name, runs in result["variants"].items():
        for t, r in runs.items():
            if isinstance(r, dict) and "step_s" in r:
                rec.add(f"{name}/{t}", "step_time", "s", r["step_s"], samples=args.steps)
                rec.add(f"{name}/{t}", "tokens_per_s", "tok/s", r["tokens_per_s"])
                if r["peak_gib"] is not None:
                    rec.add(f"{name}/{t}", "peak_memory", "GiB", r["peak_gib"])
    rec.finish(result, args.json, indent=1, show=-1)
    return result


def plot(result_json: Path, out_dir: Path) -> Path:
    """``train_step.png``: step time and peak memory of every variant vs tokens per step."""
    result = json.loads(Path(result_json).read_text())
    time_s: dict[str, list[tuple[float, float]]] = {}
    for name, runs in result["variants"].items():
        for t, r in runs.items():
            if isinstance(r, dict) and "step_s" in r:
                time_s.setdefault(f"{name} (s)", []).append((int(t), r["step_s"]))
                if r.get("peak_gib") is not None:
                    time_s.setdefault(f"{name} peak (GiB/10)", []).append(
                        (int(t), r["peak_gib"] / 10)
                    )
    m = result["machine"]
    return line_plot(
        Path(out_dir) / "train_step.png",
        time_s,
        title=f"1B student step, {result['teacher']} teacher online vs cache (k={result['k']})",
        xlabel="tokens per step",
        ylabel="step time (s); peak memory (GiB / 10)",
        logx=True,
        note=f"{result['command'][:110]} | {m.get('gpu', '')} torch {m.get('torch', '')}",
        size=(7.5, 4.8),
    )


def summarize(result: dict, sizes: list[int]) -> None:
    """Ratios offline/online per size, the largest size each variant fits."""
    v = result["variants"]
    ratios: dict[str, dict[str, float]] = {}
    for off in OFFLINE:
        for on in ("online_dense", "online_liger"):
            for t in map(str, sizes):
                a, b = v.get(off, {}).get(t, {}), v.get(on, {}).get(t, {})
                if "step_s" in a and "step_s" in b:
                    ratios.setdefault(f"{on}/{off}", {})[t] = b["step_s"] / a["step_s"]
    result["speedup_online_over_offline_step_time"] = ratios
    result["largest_fit"] = {
        name: max((int(t) for t, r in runs.items() if "step_s" in r), default=None)
        for name, runs in v.items()
        if isinstance(runs, dict) and "skipped" not in runs and "error" not in runs
    }


if __name__ == "__main__":
    main()
