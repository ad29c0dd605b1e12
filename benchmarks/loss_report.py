"""Render the JSON written by ``loss_bench.py`` as Markdown tables (no GPU needed).

    python benchmarks/loss_report.py benchmarks/results/loss.json > /tmp/tables.md

``ideal`` is inputs + bf16 grads (``grad_h``, ``grad_W``) + one chunk of bf16 logits at the
automatic chunk size; ``% GEMM`` is the achieved 6NdV rate over the bf16 GEMM rate of the
lm-head shape measured in the same run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GIB = 1 << 30
ORDER = [
    "fused_chunked",
    "fused_chunked_c8192",
    "fused_chunked_recompute",
    "fused_chunked_torchpath",
    "forward_chunked",
    "dense",
    "torch_dense_gather",
    "liger_kl_dense_target",
]


def auto_chunk(vocab: int) -> int:
    """The default chunk on CUDA for bf16 logits (mirrors ``dispatch.auto_chunk_size``)."""
    return max(256, (1 << 30) // (vocab * 2) // 256 * 256)


def ideal_gib(row: dict, chunk: int) -> float:
    n, d, vocab = row["n"], row["d"], row["vocab"]
    grads = (n * d + vocab * d) * 2
    return (row["input_gib"] * GIB + grads + min(chunk, n) * vocab * 2) / GIB


def sweep_table(result: dict) -> str:
    gemm = result["gemm_tflops"]
    lines = []
    for vocab in sorted({r["vocab"] for r in result["sweep"]}):
        rate = gemm[str(vocab)]
        lines += [
            f"\n**V = {vocab}** (bf16 GEMM [8192x4096]x[4096x{vocab}] in this run: "
            f"{rate:.0f} TFLOP/s)\n",
            "| variant | N | ms fwd+bwd | TFLOP/s (6NdV) | % GEMM | peak GiB | delta GiB | "
            "ideal GiB | peak - ideal |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        rows = [r for r in result["sweep"] if r["vocab"] == vocab]
        rows.sort(key=lambda r: (ORDER.index(r["variant"]), r["n"]))
        for r in rows:
            if r["status"] != "ok":
                lines.append(f"| {r['variant']} | {r['n']} | {r['status']} | | | | | | |")
                continue
            chunk = 8192 if r["variant"].endswith("c8192") else auto_chunk(vocab)
            fused = r["variant"].startswith("fused")
            ideal = ideal_gib(r, chunk) if fused else None
            extra = "" if ideal is None else f"{ideal:.2f} | {r['peak_gib'] - ideal:+.2f}"
            lines.append(
                f"| {r['variant']} | {r['n']} | {r['ms']:.1f} | {r['tflops']:.0f} | "
                f"{100 * r['tflops'] / rate:.0f}% | {r['peak_gib']:.2f} | {r['delta_gib']:.2f} | "
                + (extra if extra else " | ")
                + " |"
            )
    return "\n".join(lines)


def check_table(check: dict) -> str:
    lines = [
        "| objective | variant | loss | float64 loss | rel err loss | grad_h | grad_W |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for c in check["small"]:
        lines.append(
            f"| {c['config']} | {c['variant']} | {c['loss']:.6f} | {c['loss_ref']:.6f} | "
            f"{c['rel_loss']:.1e} | {c['rel_grad_h']:.1e} | {c['rel_grad_w']:.1e} |"
        )
    large = check.get("large")
    if large:
        lines.append(
            f"\nLarge N = {large['n']}: fused_chunked (bf16, Triton) against the same loss in "
            f"float32 (torch path, TF32 off): rel err loss {large['rel_loss']:.1e}, grad_h "
            f"{large['rel_grad_h']:.1e}, grad_W {large['rel_grad_w']:.1e} (grad_W accumulated by "
            f"the GEMM's fp32 epilogue: {large['fp32_epilogue']})."
        )
    return "\n".join(lines)


def main() -> None:
    result = json.loads(Path(sys.argv[1]).read_text())
    if "check" in result:
        print(check_table(result["check"]))
    print(sweep_table(result))


if __name__ == "__main__":
    main()
