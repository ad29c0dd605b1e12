"""Distributed student training from one shared logitcache cache (torch.distributed DDP).

Every rank streams its own partition of one cache (``CacheDataset``) and trains a small student
with the fused chunked top-k loss. ``report`` checks, from the delivered tokens (each synthetic
sequence starts with its own index in base ``vocab``): **coverage** (the ranks' epochs are
disjoint and cover every sequence once), **loss agreement** (the DDP curve equals one process
reading all ``W`` partitions), **throughput** (rows/s of 1 and W processes, peak memory, data
wait) and **resume** (a run checkpointed at step ``N`` and resumed replays the same order).
Commands: ``make-cache``, ``train`` (one run: ``--nproc W`` spawns W ranks, or under
``torchrun``), ``report`` (cache + 1-process + W-process + resumed runs), ``summary`` (a one-GPU
run and its resumed run); GPU commands (NCCL, NVLink multicast off): ``results/ddp.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from contextlib import nullcontext, suppress
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from logitcache.client import ReadOptions, StreamConfig

from benchmarks.harness import (
    ROOT,
    Recorder,
    add_csv_option,
    free_port,
    load1,
    machine,
    md_table,
    options,
)
from benchmarks.synthetic import (
    CacheSpec,
    bigram_teacher,
    decode_index,
    header_digits,
    synthetic_records,
)

#: Settings that keep NCCL / symmetric memory off NVLink multicast (NVLS) on GPU boxes.
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}  # fmt: skip

SYNTHETIC_TOKENIZER = "synthetic-bigram-v1"


def make_cache(url: str, spec: CacheSpec, *, batch: int = 512, log: bool = True) -> dict[str, Any]:
    """Write the synthetic cache to ``url`` through ``CacheWriter`` (resumable: keys already
    committed are skipped) and return a summary. ``min_len`` must exceed the header length."""
    from logitcache.cache_format import CacheWriter, Manifest

    digits = header_digits(spec.num_sequences, spec.vocab)
    if spec.min_len < digits + 1 or spec.max_len < spec.min_len:
        raise ValueError(f"need {digits + 1} <= min_len <= max_len, got {spec}")
    manifest = Manifest(
        teacher_model=f"synthetic-bigram-v{spec.vocab}-k{spec.k}-seed{spec.seed}",
        tokenizer_fingerprint=SYNTHETIC_TOKENIZER,
        vocab_size=spec.vocab,
        k=spec.k,
        logprob_dtype=spec.logprob_dtype,
        dataset={"synthetic": asdict(spec)},
    )
    teacher = bigram_teacher(spec.vocab, spec.k, spec.seed)
    t0, added = time.perf_counter(), 0
    with CacheWriter.open(url, manifest) as writer:
        for first in range(0, spec.num_sequences, batch):
            count = min(batch, spec.num_sequences - first)
            if writer.contains(f"seq-{first + count - 1:09d}"):
                continue
            added += writer.append(synthetic_records(spec, first, count, teacher))
            if log:
                print(f"[make-cache] {first + count}/{spec.num_sequences}", file=sys.stderr)
    return {"url": url, "added": added, "seconds": round(time.perf_counter() - t0, 2)}


@dataclass
class TrainConfig:
    """One training run (every field is a ``train`` flag, ``--batch-items`` etc.)."""

    cache: str = ""
    out: str = ""
    nproc: int = 1
    backend: str = "gloo"
    emulate_ranks: int = 1  # one process reads this many partitions, trains on their union
    steps: int = 0  # optimizer steps; 0: until the first rank's epoch runs out
    tokens_per_item: int = 64
    batch_items: int = 2  # items per rank (partition) and step
    mode: str = "pack"
    workers: int = 0
    prefetch: int = 4
    seed: int = 0
    hidden: int = 64
    layers: int = 2
    heads: int = 2
    lr: float = 1e-3
    dtype: str = "float32"  # or bfloat16: autocast body, bf16 hidden/weight into the loss (GPU)
    chunk_size: int = 0  # rows per chunk of the fused loss (0: its default)
    threads: int = 1  # torch CPU threads per process (1: a core per process, as a GPU per rank)
    checkpoint_at: int = 0
    checkpoint_dir: str = ""
    resume: str = ""
    port: int = 0


def _add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, skip: tuple = ()) -> None:
    options(parser, **{f.name: f.default for f in fields(cls) if f.name not in skip})


def _dataclass_argv(obj: Any) -> list[str]:
    return [
        x for f in fields(obj) for x in ("--" + f.name.replace("_", "-"), str(getattr(obj, f.name)))
    ]


class Block(torch.nn.Module):
    """Pre-norm transformer block: attention (SDPA, given boolean mask) then a GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d, bias=False)
        self.proj = torch.nn.Linear(d, d, bias=False)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, d // self.heads).unbind(2)
        att = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
        )
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, d))
        return x + self.mlp(self.ln2(x))


class Student(torch.nn.Module):
    """A small GPT-style student; ``forward`` returns the final hidden states ``[B, T, d]``.

    The lm head (``self.lm_head``, untied) is applied inside the fused loss, never here. Packed
    items keep their boundaries: token ``i`` attends to token ``j`` only if ``j <= i`` and both
    carry the same ``segment_ids`` (padding, segment 0, only attends to padding, so no row is
    fully masked); positions are ``position_ids``, which restart at 0 on every piece.
    """

    def __init__(self, vocab: int, cfg: TrainConfig, max_len: int) -> None:
        super().__init__()
        torch.manual_seed(cfg.seed)
        self.tok = torch.nn.Embedding(vocab, cfg.hidden)
        self.pos = torch.nn.Embedding(max_len, cfg.hidden)
        self.blocks = torch.nn.ModuleList(Block(cfg.hidden, cfg.heads) for _ in range(cfg.layers))
        self.norm = torch.nn.LayerNorm(cfg.hidden)
        self.lm_head = torch.nn.Linear(cfg.hidden, vocab, bias=False)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, segment_ids: torch.Tensor
    ) -> torch.Tensor:
        T = input_ids.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril()
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal
        x = self.tok(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x, mask[:, None])
        return self.norm(x)


@dataclass
class Part:
    """One partition of the cache read by this process: its dataset, loader and item cursor."""

    dataset: Any
    loader: Any
    iterator: Any = None
    next_item: int = 0

    def pieces(self, unit: dict[str, torch.Tensor]) -> tuple[list[int], list[int]]:
        """``(sequences whose first piece is in unit, decoded headers of those pieces)``.

        The first list comes from the dataset's plan (bookkeeping); the second from the tokens
        the unit actually holds (each synthetic sequence starts with its index in base V).
        """
        n_items = int(unit["input_ids"].shape[0])
        plan = self.dataset.plan()
        planned: list[int] = []
        for item in range(self.next_item, self.next_item + n_items):
            span = plan.item_pieces(item)
            for seq, start in zip(plan.piece_seq[span], plan.piece_start[span], strict=True):
                if int(start) == 0:
                    planned.append(int(seq))
        self.next_item += n_items
        return planned, self._headers(unit, plan, n_items)

    def _headers(self, unit: dict[str, torch.Tensor], plan: Any, n_items: int) -> list[int]:
        info = self.dataset.manifest.dataset
        if not (isinstance(info, dict) and "synthetic" in info):
            return []
        spec = CacheSpec(**info["synthetic"])
        digits = header_digits(spec.num_sequences, spec.vocab)
        ids = unit["input_ids"].numpy()
        starts = (unit["position_ids"] == 0) & (unit["attention_mask"] == 1)
        first = self.next_item - n_items
        out: list[int] = []
        for b in range(n_items):
            span = plan.item_pieces(first + b)
            piece_starts = plan.piece_start[span].tolist()
            for p, pos in enumerate(np.nonzero(starts[b].numpy())[0].tolist()):
                if piece_starts[p] == 0:
                    out.append(decode_index(ids[b, pos : pos + digits], spec.vocab))
        return out


def _open_parts(cfg: TrainConfig, rank: int, world: int, vocab: int) -> list[Part]:
    from logitcache.client import CacheDataLoader, CacheDataset

    if cfg.emulate_ranks > 1:
        if world != 1:
            raise ValueError("--emulate-ranks needs --nproc 1")
        ranks, n_parts = list(range(cfg.emulate_ranks)), cfg.emulate_ranks
    else:
        ranks, n_parts = [rank], world
    parts = []
    kw = dict(tokens_per_item=cfg.tokens_per_item, mode=cfg.mode, batch_size=cfg.batch_items)
    read = ReadOptions(prefetch=cfg.prefetch)
    for r in ranks:
        stream = StreamConfig(seed=cfg.seed, rank=r, world_size=n_parts, **kw)
        ds = CacheDataset(cfg.cache, stream, read=read, vocab_size=vocab)
        parts.append(Part(ds, CacheDataLoader(ds, num_workers=cfg.workers)))
    return parts


def _checkpoint(cfg: TrainConfig, rank: int, step: int, model: Any, opt: Any, parts: list) -> None:
    """``trainer.pt`` (model, optimizer, step; rank 0) and ``loader-rank<r>.json`` per rank."""
    ck = Path(cfg.checkpoint_dir)
    ck.mkdir(parents=True, exist_ok=True)
    states = [p.loader.state_dict() for p in parts]
    (ck / f"loader-rank{rank}.json").write_text(json.dumps({"step": step, "loaders": states}))
    if rank == 0:
        torch.save(
            {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
            ck / "trainer.pt",
        )


def _resume(cfg: TrainConfig, rank: int, model: Any, opt: Any, parts: list, device: Any) -> int:
    ck = Path(cfg.resume)
    trainer = torch.load(ck / "trainer.pt", map_location=device, weights_only=True)
    model.load_state_dict(trainer["model"])
    opt.load_state_dict(trainer["optimizer"])
    loaders = json.loads((ck / f"loader-rank{rank}.json").read_text())
    if loaders["step"] != trainer["step"] or len(loaders["loaders"]) != len(parts):
        raise ValueError(f"checkpoint {ck} is inconsistent for rank {rank}")
    for part, state in zip(parts, loaders["loaders"], strict=True):
        part.loader.load_state_dict(state)
        part.next_item = int(state["items_consumed"])
    return int(trainer["step"])


def _peak_memory(device: torch.device) -> dict[str, float]:
    """Peak resident memory of this process since :func:`train_rank` reset it: ``VmHWM`` (reset
    by exec, unlike ``ru_maxrss``, which a child inherits from its parent), else ``ru_maxrss``;
    on CUDA also the peak allocated."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with suppress(OSError):
        status = Path("/proc/self/status").read_text().splitlines()
        rss = next((int(x.split()[1]) / 1024 for x in status if x.startswith("VmHWM:")), rss)
    out = {"peak_rss_mib": round(rss, 1)}
    if device.type == "cuda":
        out["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    return out


def train_rank(cfg: TrainConfig, rank: int, world: int, device: torch.device) -> dict[str, Any]:
    """Train on this rank's partition(s); return its step log, drained leftovers and figures."""
    import torch.distributed as dist
    from logitcache.cache_format import CacheReader
    from logitcache.client.loss import topk_distill_loss
    from torch.nn.parallel import DistributedDataParallel as DDP

    with suppress(OSError):  # a new VmHWM window: not what the process did before (the cache)
        Path("/proc/self/clear_refs").write_text("5")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    reader = CacheReader(cfg.cache)
    vocab = int(reader.manifest.vocab_size)
    parts = _open_parts(cfg, rank, world, vocab)
    model = Student(vocab, cfg, cfg.tokens_per_item).to(device)
    body: Any = model
    if world > 1:
        body = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    step = _resume(cfg, rank, model, opt, parts, device) if cfg.resume else 0
    bf16 = cfg.dtype == "bfloat16"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    for part in parts:
        part.iterator = iter(part.loader)
    log: list[dict[str, Any]] = []
    leftovers: list[list[dict[str, torch.Tensor]]] = [[] for _ in parts]
    while cfg.steps == 0 or step < cfg.steps:
        t0 = time.perf_counter()
        units = [next(p.iterator, None) for p in parts]
        t_data = time.perf_counter() - t0
        have = torch.tensor([int(all(u is not None for u in units))], device=device)
        if world > 1:
            dist.all_reduce(have, op=dist.ReduceOp.MIN)
        if not int(have.item()):
            for i, u in enumerate(units):
                if u is not None:
                    leftovers[i].append(u)
            break
        got = [u for u in units if u is not None]  # every part has one here
        seen = [p.pieces(u) for p, u in zip(parts, got, strict=True)]
        batch = {k: torch.cat([u[k] for u in got]).to(device, non_blocking=True) for k in got[0]}
        with autocast:
            hidden = body(batch["input_ids"], batch["position_ids"], batch["segment_ids"])
        weight = model.lm_head.weight
        if bf16:
            hidden, weight = hidden.to(torch.bfloat16), weight.to(torch.bfloat16)
        else:
            hidden = hidden.float()
        targets = (batch["topk_ids"], batch["topk_logprobs"], batch["tail_mass"])
        loss_sum = topk_distill_loss(
            hidden, weight, *targets, mask=batch["loss_mask"], reduction="sum",
            impl="fused_chunked", chunk_size=cfg.chunk_size or None,
        )  # fmt: skip
        counts = torch.stack([batch["loss_mask"].sum(), batch["attention_mask"].sum()]).to(
            torch.float64
        )
        if world > 1:
            dist.all_reduce(counts)
        # DDP averages gradients over ranks: scale so the result is the gradient of the global
        # mean over all supervised positions (the same objective as the one-process reference).
        (loss_sum * (world / counts[0])).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss_sum.detach().to(torch.float64).reshape(1)
        if world > 1:
            dist.all_reduce(total)
        global_loss = float(total.item() / counts[0].item())
        step += 1
        rows, tokens = int(counts[0].item()), int(counts[1].item())
        step_s = time.perf_counter() - t0
        planned, headers = [s[0] for s in seen], [s[1] for s in seen]
        log.append(dict(step=step, loss=global_loss, rows=rows, tokens=tokens, data_s=t_data,
                        step_s=step_s, planned=planned, headers=headers))  # fmt: skip
        if cfg.checkpoint_at and step == cfg.checkpoint_at:
            _checkpoint(cfg, rank, step, model, opt, parts)
    drained = []  # epoch mode: read (not train) the rest of each rank's epoch, for coverage
    for part, extra in zip(parts, leftovers, strict=True):
        units = extra + (list(part.iterator) if cfg.steps == 0 else [])
        drained.append([part.pieces(u) for u in units])
    return {
        "rank": rank,
        "parts": [p.dataset.rank for p in parts],
        "items_per_epoch": [p.dataset.num_items() for p in parts],
        "log": log,
        "drained_planned": [[s for pl, _ in d for s in pl] for d in drained],
        "drained_headers": [[s for _, hd in d for s in hd] for d in drained],
        "memory": _peak_memory(device),
        "threads": torch.get_num_threads(),
    }


def _run_process(rank: int, world: int, local_rank: int, cfg: TrainConfig, init: str) -> None:
    """Body of one rank: set up the process group, train, gather everything on rank 0."""
    import torch.distributed as dist

    for key, value in NVLS_OFF.items():
        os.environ.setdefault(key, value)
    # Rank 0 may be the caller's own process (a test, a notebook): give its thread count back.
    threads_before = torch.get_num_threads()
    torch.set_num_threads(max(1, cfg.threads))
    device = torch.device("cpu")
    if cfg.backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if world > 1:
        dist.init_process_group(cfg.backend, init_method=init, rank=rank, world_size=world)
    try:
        result = train_rank(cfg, rank, world, device)
        results: list[Any] = [None] * world
        if world > 1:
            dist.all_gather_object(results, result)
        else:
            results = [result]
        if rank == 0 and cfg.out:
            Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
            run = {"config": asdict(cfg), "world": world, "ranks": results, "env": _env(device)}
            Path(cfg.out).write_text(json.dumps(run) + "\n")
    finally:
        if world > 1:
            dist.destroy_process_group()
        torch.set_num_threads(threads_before)


def launch(cfg: TrainConfig) -> None:
    """Run ``cfg``: under torchrun use its environment; else this process is rank 0 and
    ``cfg.nproc - 1`` spawned processes are the other ranks."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        cfg.nproc = world
        local = int(os.environ.get("LOCAL_RANK", 0))
        _run_process(int(os.environ["RANK"]), world, local, cfg, "env://")
        return
    init = f"tcp://127.0.0.1:{cfg.port or free_port()}"
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    others = [
        ctx.Process(target=_run_process, args=(r, cfg.nproc, r, cfg, init), daemon=True)
        for r in range(1, cfg.nproc)
    ]
    for proc in others:
        proc.start()
    try:
        _run_process(0, cfg.nproc, 0, cfg, init)
    finally:
        for proc in others:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.terminate()
    failed = [p.exitcode for p in others if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"ranks exited with codes {failed}")


def _env(device: torch.device) -> dict[str, Any]:
    """The harness's machine row, the device this rank trained on and the NVLS settings."""
    nvls = {k: os.environ.get(k) for k in NVLS_OFF}
    return machine() | {"device": str(device), "load_average_1min": load1(), "nvls": nvls}


def _flat(lists: list[list[int]]) -> list[int]:
    return [x for sub in lists for x in sub]


def coverage(run: dict[str, Any], num_sequences: int, key: str = "headers") -> dict[str, Any]:
    """Which sequences each rank saw over the epoch (trained steps + drained leftovers)."""
    per_rank = []
    for r in run["ranks"]:
        seen = _flat([_flat(e[key]) for e in r["log"]]) + _flat(r[f"drained_{key}"])
        per_rank.append(seen)
    sets = [set(s) for s in per_rank]
    overlap = sum(len(a & b) for i, a in enumerate(sets) for b in sets[i + 1 :])
    union = set().union(*sets)
    trained = [len(_flat([_flat(e[key]) for e in r["log"]])) for r in run["ranks"]]
    return {
        "sequences_per_rank": [len(s) for s in per_rank],
        "trained_per_rank": trained,
        "duplicates_within_ranks": sum(len(s) - len(set(s)) for s in per_rank),
        "overlap_between_ranks": overlap,
        "missing": num_sequences - len(union & set(range(num_sequences))),
        "foreign": len(union - set(range(num_sequences))),
        "exactly_once": overlap == 0
        and len(union) == num_sequences
        and sum(len(s) for s in per_rank) == num_sequences,
    }


def throughput(run: dict[str, Any], warmup: int) -> dict[str, float]:
    """Global rows/s and tokens/s over steps after ``warmup`` (rank 0's clock), data-wait share
    per rank (time blocked in ``next(loader)`` / step time)."""
    log = run["ranks"][0]["log"][warmup:]
    if not log:
        raise ValueError(f"no steps after {warmup} warm-up steps")
    secs = sum(e["step_s"] for e in log)
    shares = []
    for r in run["ranks"]:
        lg = r["log"][warmup:]
        shares.append(sum(e["data_s"] for e in lg) / sum(e["step_s"] for e in lg))
    return {
        "rows_per_s": sum(e["rows"] for e in log) / secs,
        "tokens_per_s": sum(e["tokens"] for e in log) / secs,
        "step_ms_median": 1000 * float(np.median([e["step_s"] for e in log])),
        "data_wait_share_per_rank": shares,
        "timed_steps": len(log),
    }


def resume_check(full: dict[str, Any], resumed: dict[str, Any], at: int) -> dict[str, Any]:
    """Compare, rank by rank, the steps after ``at`` of the uninterrupted and the resumed run."""
    same_order, same_headers, diffs, steps = [], [], [], []
    for a, b in zip(full["ranks"], resumed["ranks"], strict=True):
        tail_a = [e for e in a["log"] if e["step"] > at]
        tail_b = b["log"]
        steps.append(len(tail_b))
        same_order.append(
            [e["planned"] for e in tail_a] == [e["planned"] for e in tail_b]
            and a["drained_planned"] == b["drained_planned"]
        )
        same_headers.append([e["headers"] for e in tail_a] == [e["headers"] for e in tail_b])
        if len(tail_a) == len(tail_b):
            diffs += [abs(x["loss"] - y["loss"]) for x, y in zip(tail_a, tail_b, strict=True)]
    return {
        "checkpoint_step": at,
        "resumed_steps_per_rank": steps,
        "same_order_per_rank": same_order,
        "same_tokens_per_rank": same_headers,
        "max_abs_loss_diff": max(diffs) if diffs else None,
    }


def loss_agreement(one: dict[str, Any], ddp: dict[str, Any]) -> dict[str, Any]:
    a = [e["loss"] for e in one["ranks"][0]["log"]]
    b = [e["loss"] for e in ddp["ranks"][0]["log"]]
    n = min(len(a), len(b))
    diff = [abs(x - y) for x, y in zip(a[:n], b[:n], strict=True)]
    same_batches = all(
        sorted(_flat(x["planned"]))
        == sorted(_flat([_flat(r["log"][i]["planned"]) for r in ddp["ranks"]]))
        for i, x in enumerate(one["ranks"][0]["log"][:n])
    )
    return {
        "steps": [len(a), len(b)],
        "same_global_batches": same_batches,
        "max_abs_diff": max(diff) if diff else None,
        "max_rel_diff": max(d / abs(x) for d, x in zip(diff, a, strict=False)) if diff else None,
        "first_last_one_process": [a[0], a[-1]] if a else None,
        "first_last_ddp": [b[0], b[-1]] if b else None,
        "curve_one_process": a,
        "curve_ddp": b,
    }


def summary(
    full: dict[str, Any], resumed: dict[str, Any], num_sequences: int, warmup: int
) -> dict[str, Any]:
    """Coverage, throughput, data-wait share, memory and resume checks of a ``train`` run that
    checkpointed at step N and of the run resumed from that checkpoint."""
    at = int(full["config"]["checkpoint_at"])
    log = full["ranks"][0]["log"]
    shares = [e["data_s"] / e["step_s"] for e in log[warmup:]]
    a = {e["step"]: e["loss"] for e in log}
    diffs = [abs(a[e["step"]] - e["loss"]) for e in resumed["ranks"][0]["log"]]
    return {
        "steps": len(log),
        "coverage": coverage(full, num_sequences),
        "throughput": throughput(full, warmup),
        "throughput_resumed": throughput(resumed, min(warmup, len(diffs) // 2)),
        "data_wait_share_max_step": max(shares),
        "memory": full["ranks"][0]["memory"],
        "resume": resume_check(full, resumed, at),
        "resume_loss_diff_first_max": [diffs[0], max(diffs)],
    }


def _train_subprocess(cfg: TrainConfig) -> dict[str, Any]:
    """Run ``train`` in fresh processes (as a restart would) and load its JSON."""
    cmd = [sys.executable, "-m", "benchmarks.ddp", "train", *_dataclass_argv(cfg)]
    proc = subprocess.run(cmd, check=False, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"train run failed (exit {proc.returncode}): {' '.join(cmd)}")
    return json.loads(Path(cfg.out).read_text())


def report(base: TrainConfig, spec: CacheSpec, workdir: Path, warmup: int) -> dict[str, Any]:
    """make-cache (if absent), then: the one-process reference over the W partitions, the
    W-process DDP run (checkpointing half way), and a resumed W-process run from that checkpoint."""
    from logitcache.cache_format import CacheReader

    world = base.nproc
    cache = base.cache or str(workdir / "cache")
    made = None if base.cache else make_cache(cache, spec)
    reader = CacheReader(cache)
    n_seq = reader.num_sequences
    one_cfg = replace(
        base, cache=cache, nproc=1, emulate_ranks=world, out=str(workdir / "one_process.json")
    )
    launch(one_cfg)  # the reference runs in this process
    one = json.loads(Path(one_cfg.out).read_text())
    at = base.checkpoint_at or max(1, len(one["ranks"][0]["log"]) // 2)
    ckpt = str(workdir / "checkpoint")
    ddp_cfg = replace(one_cfg, nproc=world, emulate_ranks=1, out=str(workdir / "ddp.json"))
    ddp_cfg = replace(ddp_cfg, checkpoint_at=at, checkpoint_dir=ckpt)  # checkpoint half way
    ddp = _train_subprocess(ddp_cfg)
    res_cfg = replace(
        ddp_cfg, checkpoint_at=0, checkpoint_dir="", resume=ckpt, out=str(workdir / "resumed.json")
    )
    resumed = _train_subprocess(res_cfg)
    t_one, t_ddp = throughput(one, warmup), throughput(ddp, warmup)
    man = reader.manifest
    return {
        "cache": {"url": cache, "num_sequences": n_seq, "num_rows": reader.num_rows,
                  "vocab": man.vocab_size, "k": man.k, "made": made},
        "world": world, "config": asdict(base),
        "coverage": coverage(ddp, n_seq), "coverage_planned": coverage(ddp, n_seq, key="planned"),
        "loss_agreement": loss_agreement(one, ddp),
        "throughput": {"one_process": t_one, "ddp": t_ddp,
                       "ratio_rows_per_s": t_ddp["rows_per_s"] / t_one["rows_per_s"]},
        "memory": {"one_process": [r["memory"] for r in one["ranks"]],
                   "ddp": [r["memory"] for r in ddp["ranks"]]},
        "resume": resume_check(ddp, resumed, at), "env": ddp["env"],
        "load_average": [r["env"]["load_average_1min"] for r in (one, ddp, resumed)],
        "threads": {"one_process": one["ranks"][0]["threads"],
                    "ddp": [r["threads"] for r in ddp["ranks"]]},
        "runs": {"one_process": one_cfg.out, "ddp": ddp_cfg.out, "resumed": res_cfg.out},
    }  # fmt: skip


def markdown(rep: dict[str, Any], command: str) -> str:
    """The results page for one report."""
    c, cov, la = rep["cache"], rep["coverage"], rep["loss_agreement"]
    tp, mem, rs, env, w = rep["throughput"], rep["memory"], rep["resume"], rep["env"], rep["world"]
    mem_key = "peak_gpu_gib" if "peak_gpu_gib" in mem["ddp"][0] else "peak_rss_mib"

    def rate(t: dict) -> str:
        return (f"{t['rows_per_s']:,.0f} (tokens/s {t['tokens_per_s']:,.0f}, median step "
                f"{t['step_ms_median']:.1f} ms)")  # fmt: skip

    def pct(xs: list[float]) -> str:
        return "[" + ", ".join(f"{100 * x:.1f}%" for x in xs) + "]"

    rows = [
        ["epoch coverage (from delivered tokens)", f"sequences per rank "
         f"{cov['sequences_per_rank']}, overlap {cov['overlap_between_ranks']}, duplicates "
         f"{cov['duplicates_within_ranks']}, missing {cov['missing']}: exactly once = "
         f"**{cov['exactly_once']}**"],
        ["trained vs drained", f"trained {cov['trained_per_rank']} sequences per rank before the "
         "first rank ran out; the rest was drained (read, not trained)"],
        [f"loss curve, 1 process vs {w} (same global batches: {la['same_global_batches']})",
         f"max abs diff {la['max_abs_diff']:.3g}, max rel diff {la['max_rel_diff']:.3g} over "
         f"{la['steps'][1]} steps (loss {la['first_last_ddp'][0]:.4f} -> "
         f"{la['first_last_ddp'][1]:.4f})"],
        ["rows/s, 1 process", rate(tp["one_process"])],
        [f"rows/s, {w} processes", rate(tp["ddp"])],
        [f"ratio {w} / 1", f"**{tp['ratio_rows_per_s']:.2f}x**"],
        [f"peak memory ({mem_key})", f"1 process {[m[mem_key] for m in mem['one_process']]}, per "
         f"rank {[m[mem_key] for m in mem['ddp']]}"],
        ["data-wait share of step time", f"1 process "
         f"{pct(tp['one_process']['data_wait_share_per_rank'])}, per rank "
         f"{pct(tp['ddp']['data_wait_share_per_rank'])}"],
        [f"resume at step {rs['checkpoint_step']}", f"same remaining order per rank "
         f"{rs['same_order_per_rank']}, same tokens {rs['same_tokens_per_rank']}, max abs loss "
         f"diff {rs['max_abs_loss_diff']} over {rs['resumed_steps_per_rank']} steps"],
    ]  # fmt: skip
    return (
        f"- machine: {env['device']}, {env['cpu_count']} CPU cores, torch {env['torch']}; backend "
        f"{rep['config']['backend']}; threads per process: 1-process "
        f"{rep['threads']['one_process']}, DDP {rep['threads']['ddp']}; 1-min load average at the "
        f"end of the runs: {rep['load_average']} (shared machine)\n"
        f"- cache: {c['num_sequences']} sequences, {c['num_rows']} rows (positions), vocab "
        f"{c['vocab']}, k {c['k']} (synthetic bigram teacher written through CacheWriter)\n"
        f"- command: `{command}`\n\n" + md_table(["check", "result"], rows)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.ddp", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    mk = sub.add_parser("make-cache", help="write a synthetic cache")
    mk.add_argument("--url", required=True)
    _add_dataclass_flags(mk, CacheSpec)
    tr = sub.add_parser("train", help="one run (spawned ranks, or under torchrun)")
    _add_dataclass_flags(tr, TrainConfig)
    rp = sub.add_parser("report", help="cache + 1-process + DDP + resumed runs, then the report")
    _add_dataclass_flags(rp, TrainConfig, skip=("out", "emulate_ranks", "checkpoint_dir", "resume"))
    _add_dataclass_flags(rp, CacheSpec, skip=("seed",))
    rp.add_argument("--workdir", required=True)
    rp.add_argument("--warmup", type=int, default=2, help="steps left out of the timings")
    rp.add_argument("--json", default="", help="write the report JSON here")
    rp.add_argument("--md", default="", help="write the markdown table here")
    add_csv_option(rp)
    sm = sub.add_parser("summary", help="a train run and its resumed run (one GPU)")
    for name in ("--full", "--resumed"):
        sm.add_argument(name, type=Path, required=True)
    sm.add_argument("--num-sequences", type=int, required=True)
    sm.add_argument("--warmup", type=int, default=20)
    args = vars(parser.parse_args(argv))
    command = args.pop("command")
    if command == "summary":
        full, resumed = (json.loads(args[k].read_text()) for k in ("full", "resumed"))
        print(json.dumps(summary(full, resumed, args["num_sequences"], args["warmup"]), indent=1))
    elif command == "make-cache":
        print(json.dumps(make_cache(args.pop("url"), CacheSpec(**args))))
    elif command == "train":
        launch(TrainConfig(**args))
    if command != "report":
        return 0
    spec_names = {f.name for f in fields(CacheSpec)} - {"seed"}
    spec = CacheSpec(seed=args["seed"], **{k: args.pop(k) for k in list(args) if k in spec_names})
    workdir, warmup = Path(args.pop("workdir")), args.pop("warmup")
    json_out, md_out, csv_path = args.pop("json"), args.pop("md"), args.pop("csv")
    workdir.mkdir(parents=True, exist_ok=True)
    rep = report(TrainConfig(**args), spec, workdir, warmup)
    command_line = "python -m benchmarks.ddp " + " ".join(argv or sys.argv[1:])
    rep["command"] = command_line
    config = {k: v for k, v in args.items() if isinstance(v, int | float | str)}
    rec = Recorder("ddp", "report", csv_path=csv_path, command=command_line, config=config)
    rec.add_flat(f"{args['nproc']} ranks {args['backend']}", rep["throughput"])
    rec.save()
    text = markdown(rep, command_line)
    print(text)
    if json_out:
        Path(json_out).write_text(json.dumps(rep, indent=1) + "\n")
    if md_out:
        Path(md_out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
