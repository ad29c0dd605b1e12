"""``python -m benchmarks.loss exact --kernel-configs ...`` (CUDA): median ms of one chunk's row
passes of the exact loss per launch geometry (:class:`ExactKernelConfig`) beside a copy of one
table, each config checked against the default's numbers, and per objective the fastest config
that agrees (run by the ``..._kbest`` variants).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Callable
from typing import Any

import torch
from logitcache.client.loss import EXACT_LOSS_KINDS, ExactKernelConfig, LossInputError
from logitcache.client.loss.exact_kernels import DEFAULT_CONFIG as EXACT_DEFAULT_CONFIG

from benchmarks.harness import median_time


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def kernel_configs(spec: str) -> list[str]:
    """``--kernel-configs``: comma-separated ``default``,
    ``S<block>x<cols>w<warps>[p<stages>]-G<block>x<cols>w<warps>[p<stages>]`` (statistics
    passes, then gradient pass); see :class:`ExactKernelConfig`. Each is checked here."""
    names = [n for n in spec.split(",") if n]
    for n in names:
        parse_kernel_config(n)
    return names


def parse_kernel_config(name: str) -> ExactKernelConfig:
    if name == "default":
        return EXACT_DEFAULT_CONFIG
    split = re.fullmatch(r"S(\d+)x(\d+)w(\d+)(?:p(\d+))?-G(\d+)x(\d+)w(\d+)(?:p(\d+))?", name)
    try:
        if split is not None:
            return ExactKernelConfig(*[int(g) if g else 1 for g in split.groups()])
    except LossInputError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    raise argparse.ArgumentTypeError(f"bad kernel config {name!r} (see --kernel-configs)")


EXACT_KERNEL_CONFIGS = [
    "default",
    "S2048x16384w4-G2048x16384w8",
    "S2048x131072w4-G2048x131072w8",
    "S4096x16384w8-G4096x4096w8",
    "S2048x16384w8-G4096x16384w8",
    "S1024x8192w4-G1024x8192w4",
    "S2048x16384w4p3-G2048x16384w8p3",
]


def pass_sweep(
    names: list[str], rows: int, vocab: int, device: str
) -> tuple[list[dict], dict[str, ExactKernelConfig]]:
    """Median ms of one chunk's row passes (``[rows, vocab]`` bf16 teacher and student logits)
    per kernel config, beside a copy of one table (read + write) as the bandwidth reference;
    and per objective the fastest config (split passes: the fastest statistics settings with
    the fastest gradient settings)."""
    from logitcache.client.loss import exact_kernels as ek

    g = torch.Generator(device=device).manual_seed(3)
    y = (torch.randn(rows, vocab, generator=g, device=device) * 2).to(torch.bfloat16)
    x0 = (torch.randn(rows, vocab, generator=g, device=device) * 2).to(torch.bfloat16)
    x = x0.clone()
    table = y.numel() * y.element_size()
    cuda = device == "cuda"
    copy_ms = median_time(cuda, lambda: x.copy_(y)) * 1e3
    out = [dict(config="copy", ms=copy_ms, gbps=2 * table / copy_ms / 1e6)]
    tf = ek.Transform(1.0, None, 1.0)
    ok: list[tuple[ExactKernelConfig, dict]] = []
    ref = {loss: chunk_result("default", loss, x, x0, y, tf) for loss in EXACT_LOSS_KINDS}
    for name in names:
        row: dict[str, Any] = dict(config=name)
        try:
            row.update(pass_times(name, x, x0, y, tf, cuda))
            for loss in EXACT_LOSS_KINDS:  # the same numbers as the default config's?
                kd, grad = chunk_result(name, loss, x, x0, y, tf)
                row[f"{loss}_rel_loss"] = rel(kd, ref[loss][0])
                row[f"{loss}_rel_grad"] = rel(grad, ref[loss][1])
        except Exception as e:  # a config that does not compile is a row, not the end
            row["status"] = f"error: {type(e).__name__}: {str(e)[:300]}"
            print("passes", name, row["status"], flush=True)
            out.append(row)
            continue
        row["status"] = "ok"
        row["kl_of_copy_bw"] = 2.5 * copy_ms / row["forward_kl_ms"]  # 5 table transfers vs 2
        print("passes", json.dumps(row), flush=True)
        out.append(row)
        agrees = all(
            row[f"{loss}_rel_loss"] < 1e-4 and row[f"{loss}_rel_grad"] < 2e-2
            for loss in EXACT_LOSS_KINDS
        )
        if agrees:
            ok.append((parse_kernel_config(name), row))
    best = pick_configs(ok)
    out.append(dict(config="best", status="picked", **{k: vars(c) for k, c in best.items()}))
    print("passes", json.dumps(out[-1]), flush=True)
    return out, best


def pick_configs(rows: list[tuple[ExactKernelConfig, dict]]) -> dict[str, ExactKernelConfig]:
    """Per objective, the fastest statistics settings (statistics plus sums pass) with the
    fastest gradient settings of that objective."""
    best: dict[str, ExactKernelConfig] = {}
    if not rows:
        return best
    sc, _ = min(rows, key=lambda cr: cr[1]["stats_ms"] + cr[1]["sums_ms"])
    for loss in EXACT_LOSS_KINDS:
        gc, _ = min(rows, key=lambda cr: cr[1][f"grad_{loss}_ms"])  # noqa: B023
        best[loss] = dataclasses.replace(
            gc, stats_block=sc.stats_block, stats_cols=sc.stats_cols,
            stats_warps=sc.stats_warps, stats_stages=sc.stats_stages,
        )  # fmt: skip
    return best


def chunk_result(
    name: str, loss: str, x: torch.Tensor, x0: torch.Tensor, y: torch.Tensor, tf: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """One config's row losses ``KD [rows]`` (beta 0.5) and gradient table of the chunk."""
    from logitcache.client.loss import exact_kernels as ek

    x.copy_(x0)
    cfg = parse_kernel_config(name)
    st = ek.row_stats(y, x, tf, cfg)
    sums = ek.jsd_sums(y, x, tf, st, cfg) if loss == "jsd" else None
    if sums is not None:
        kd, term = 0.5 * (sums[:, 0] + sums[:, 1]), sums[:, 1].contiguous()
    else:
        kd = term = st[:, 2 if loss == "forward_kl" else 3].contiguous()
    ek.row_grad(y, x, tf, loss, st, term, 1.0, cfg)
    out = kd.clone(), x.clone()
    x.copy_(x0)
    return out


def pass_times(
    name: str, x: torch.Tensor, x0: torch.Tensor, y: torch.Tensor, tf: Any, cuda: bool
) -> dict:
    """Median ms of one config's passes: ``<loss>_ms`` (all passes with the gradient) per
    objective; for split passes also ``stats_ms``, ``sums_ms`` (JSD) and ``grad_<loss>_ms``."""
    from logitcache.client.loss import exact_kernels as ek

    def timed(fn: Callable) -> float:
        x.copy_(x0)
        t = median_time(cuda, fn) * 1e3
        x.copy_(x0)
        return t

    cfg = parse_kernel_config(name)

    def stats() -> torch.Tensor:
        return ek.row_stats(y, x, tf, cfg)

    def sums(st: torch.Tensor) -> torch.Tensor:
        return ek.jsd_sums(y, x, tf, st, cfg)

    def grad(loss: str, st: torch.Tensor) -> None:
        ek.row_grad(y, x, tf, loss, st, st[:, 2], 1.0, cfg)

    x.copy_(x0)
    st = stats()
    res = dict(stats_ms=timed(stats), sums_ms=timed(lambda: sums(st)))
    for loss in EXACT_LOSS_KINDS:
        res[f"grad_{loss}_ms"] = timed(lambda: grad(loss, st))  # noqa: B023
    for loss in EXACT_LOSS_KINDS:
        extra = res["sums_ms"] if loss == "jsd" else 0.0
        res[f"{loss}_ms"] = res["stats_ms"] + extra + res[f"grad_{loss}_ms"]
    return res
