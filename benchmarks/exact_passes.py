"""One chunk's row kernel of the exact loss per launch geometry, for ``python -m benchmarks.loss
exact --kernel-configs ...`` (CUDA): median ms per objective (with the gradient) per config
(:class:`ExactKernelConfig`) beside a copy of one table, each config's losses and gradient
against the default config's, and per objective the fastest config that agrees (the
``..._kbest`` variants run it).
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

import torch
from logitcache.client.loss import EXACT_LOSS_KINDS, ExactKernelConfig, LossInputError
from logitcache.client.loss.exact_kernels import DEFAULT_CONFIG as EXACT_DEFAULT_CONFIG

from benchmarks.harness import median_time


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def kernel_configs(spec: str) -> list[str]:
    """``--kernel-configs``: comma-separated ``default`` or ``B<block>w<warps>[r<max_regs>][s]``
    (``s``: ``sync=False``, one launch per step); see :class:`ExactKernelConfig`. Each is
    checked here."""
    names = [n for n in spec.split(",") if n]
    for n in names:
        parse_kernel_config(n)
    return names


def parse_kernel_config(name: str) -> ExactKernelConfig:
    if name == "default":
        return EXACT_DEFAULT_CONFIG
    m = re.fullmatch(r"B(\d+)w(\d+)(?:r(\d+))?(s?)", name)
    try:
        if m is not None:
            block, warps, regs, split = m.groups()
            return ExactKernelConfig(int(block), int(warps), not split, int(regs or 0))
    except LossInputError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    raise argparse.ArgumentTypeError(f"bad kernel config {name!r} (see --kernel-configs)")


EXACT_KERNEL_CONFIGS = [
    "default",
    "B2048w8r64s",
    "B2048w8",
    "B2048w8r80",
    "B2048w4",
    "B1024w4",
    "B1024w4r56",
    "B1024w2",
    "B512w2",
    "B4096w8",
    "B4096w16",
]


def pass_sweep(
    names: list[str], rows: int, vocab: int, device: str
) -> tuple[list[dict], dict[str, ExactKernelConfig]]:
    """Median ms of one chunk's row kernel (``[rows, vocab]`` bf16 teacher and student logits)
    per kernel config and objective, beside a copy of one table (read + write) as the bandwidth
    reference; and per objective the fastest config."""
    g = torch.Generator(device=device).manual_seed(3)
    y = (torch.randn(rows, vocab, generator=g, device=device) * 2).to(torch.bfloat16)
    x0 = (torch.randn(rows, vocab, generator=g, device=device) * 2).to(torch.bfloat16)
    x = x0.clone()
    table = y.numel() * y.element_size()
    cuda = device == "cuda"
    copy_ms = median_time(cuda, lambda: x.copy_(y)) * 1e3
    out = [dict(config="copy", ms=copy_ms, gbps=2 * table / copy_ms / 1e6)]
    ok: list[tuple[ExactKernelConfig, dict]] = []
    ref = {loss: chunk_result("default", loss, x, x0, y) for loss in EXACT_LOSS_KINDS}
    for name in names:
        row: dict[str, Any] = dict(config=name)
        try:
            for loss in EXACT_LOSS_KINDS:
                row[f"{loss}_ms"] = pass_time(name, loss, x, x0, y, cuda)
                kd, grad = chunk_result(name, loss, x, x0, y)  # the default config's numbers?
                row[f"{loss}_rel_loss"] = rel(kd, ref[loss][0])
                row[f"{loss}_rel_grad"] = rel(grad, ref[loss][1])
                # 3 table transfers (2 reads, 1 write) vs the copy's 2
                row[f"{loss}_of_copy_bw"] = 1.5 * copy_ms / row[f"{loss}_ms"]
        except Exception as e:  # a config that does not compile is a row, not the end
            row["status"] = f"error: {type(e).__name__}: {str(e)[:300]}"
            print("passes", name, row["status"], flush=True)
            out.append(row)
            continue
        row["status"] = "ok"
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
    """Per objective, the config of the fastest row."""
    return {
        loss: min(rows, key=lambda cr: cr[1][f"{loss}_ms"])[0]  # noqa: B023
        for loss in EXACT_LOSS_KINDS
        if rows
    }


def chunk_result(
    name: str, loss: str, x: torch.Tensor, x0: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One config's row losses ``KD [rows]`` (beta 0.5) and gradient table of the chunk."""
    from logitcache.client.loss import exact_kernels as ek

    x.copy_(x0)
    st, sums = ek.rows(y, x, ek.Transform(1.0, None, 1.0), loss, 1.0, parse_kernel_config(name))
    if sums is not None:
        kd = 0.5 * (sums[:, 0] + sums[:, 1])
    else:
        kd = st[:, 2 if loss == "forward_kl" else 3]
    out = kd.clone(), x.clone()
    x.copy_(x0)
    return out


def pass_time(
    name: str, loss: str, x: torch.Tensor, x0: torch.Tensor, y: torch.Tensor, cuda: bool
) -> float:
    """Median ms of one config's kernel (with the gradient) for one objective."""
    from logitcache.client.loss import exact_kernels as ek

    cfg, tf = parse_kernel_config(name), ek.Transform(1.0, None, 1.0)
    x.copy_(x0)
    t = median_time(cuda, lambda: ek.rows(y, x, tf, loss, 1.0, cfg)) * 1e3
    x.copy_(x0)
    return t
