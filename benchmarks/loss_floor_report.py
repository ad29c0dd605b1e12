"""Plot and Markdown tables of a ``loss_floor_bench.py`` result (no torch, no GPU needed).

    python benchmarks/loss_floor_report.py benchmarks/results/loss_floor.json   # PNG + tables

The PNG is written next to the JSON (``loss_floor.json`` -> ``loss_floor.png``): peak memory and
fwd+bwd time vs positions, one column per ``(V, d)`` config, one line per variant, the 6NdV time
at the measured GEMM rate and the 6.8 GiB goal drawn in. ``floor`` in the tables = inputs (as
allocated before the step) + bf16 ``grad_h`` + bf16 ``grad_W``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GIB = 1 << 30
ORDER = ["fp32acc", "bf16acc", "floor", "floor_c2016", "floor_c1984", "floor_c1920", "floor_c1792"]


def _order(name: str) -> tuple[int, str]:
    return (ORDER.index(name) if name in ORDER else len(ORDER), name)


def _configs(result: dict) -> list[tuple[int, int]]:
    return [tuple(c) for c in result["configs"]]


def plot(result: dict, path: Path) -> bool:
    """Peak memory and time vs N, one column per config, one line per variant."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if "peak_gib" not in result["sweep"][0]:
        return False
    fig, axes = plt.subplots(
        2, len(_configs(result)), figsize=(5 * len(_configs(result)), 8), squeeze=False
    )
    for col, (vocab, d) in enumerate(_configs(result)):
        rows = [
            r
            for r in result["sweep"]
            if r["vocab"] == vocab and r["d"] == d and r["status"] == "ok"
        ]
        rate = result["gemm_tflops"].get(f"{vocab}x{d}")
        for name in sorted({r["variant"] for r in rows}, key=_order):
            pts = sorted((r["n"], r["peak_gib"], r["ms"]) for r in rows if r["variant"] == name)
            if not pts:
                continue
            ns = [p[0] for p in pts]
            axes[0][col].plot(ns, [p[1] for p in pts], marker="o", label=name)
            axes[1][col].plot(ns, [p[2] for p in pts], marker="o", label=name)
        if rate:
            ns = sorted({r["n"] for r in rows})
            axes[1][col].plot(
                ns,
                [6 * n * d * vocab / (rate * 1e12) * 1e3 for n in ns],
                "k--",
                label="6NdV at the GEMM rate",
            )
        if vocab == 128256 and d == 4096:
            axes[0][col].axhline(6.8, color="r", ls=":", label="goal 6.8 GiB @256K")
        axes[0][col].set_title(f"V={vocab}, d={d}: peak memory")
        axes[1][col].set_title(f"V={vocab}, d={d}: fwd+bwd time")
        for ax, lab in ((axes[0][col], "peak GiB"), (axes[1][col], "ms")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("positions N")
            ax.set_ylabel(lab)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        axes[1][col].set_yscale("log")
    fig.suptitle(
        f"top-k distillation loss, fwd+bwd, k={result['k']}, bf16, {result['meta']['device']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def tables(result: dict) -> str:
    lines = []
    for vocab, d in _configs(result):
        rate = result["gemm_tflops"][f"{vocab}x{d}"]
        lines += [
            f"\n**V = {vocab}, d = {d}** (bf16 GEMM [8192x{d}]x[{d}x{vocab}] in this run: "
            f"{rate:.0f} TFLOP/s)\n",
            "| variant | chunk | N | ms fwd+bwd | TFLOP/s | % GEMM | peak GiB | floor GiB "
            "| peak - floor |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in result["sweep"]:
            if (r["vocab"], r["d"]) != (vocab, d):
                continue
            if r["status"] != "ok":
                lines.append(
                    f"| {r['variant']} | {r['chunk']} | {r['n']} | {r['status']} | | | | | |"
                )
                continue
            if "peak_gib" not in r:
                continue
            floor = (r["input_gib"] * GIB + (r["n"] * d + vocab * d) * 2) / GIB
            lines.append(
                f"| {r['variant']} | {r['chunk']} | {r['n']} | {r['ms']:.1f} | {r['tflops']:.0f} | "
                f"{100 * r['tflops'] / rate:.1f}% | {r['peak_gib']:.3f} | {floor:.3f} | "
                f"{r['peak_gib'] - floor:+.3f} |"
            )
    return "\n".join(lines)


def main() -> None:
    path = Path(sys.argv[1])
    result = json.loads(path.read_text())
    png = path.with_suffix(".png")
    print("plot:", png if plot(result, png) else "matplotlib missing")
    print(tables(result))


if __name__ == "__main__":
    main()
