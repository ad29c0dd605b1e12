"""A small plotting helper for benchmark owners: line charts as PNG, from Python or from JSON.

From a benchmark::

    from benchmarks.plots import line_plot     # or: sys.path trick, see below
    line_plot(
        "benchmarks/results/loss_memory.png",
        {"dense": [(1024, 2.1), (4096, 8.3)], "fused": [(1024, 0.4), (4096, 0.9)]},
        title="peak memory vs sequence length", xlabel="positions", ylabel="GiB", logx=True,
    )

From a shell (a JSON file ``{"series": {...}, "title": ..., "xlabel": ..., ...}``, same keys as
the keyword arguments)::

    .venv/bin/python benchmarks/plots.py spec.json out.png

The distillation chart (held-out KL vs bytes/position, from a committed ``distill_bench``
result)::

    .venv/bin/python benchmarks/plots.py distill \\
        benchmarks/results/distill_t128_24seeds.json benchmarks/results/distill_kl_bytes.png

The loss charts (peak memory and time vs positions, every variant, from a committed
``loss_bench`` result; writes ``loss_memory.png`` and ``loss_time.png``)::

    .venv/bin/python benchmarks/plots.py loss benchmarks/results/loss.json benchmarks/results

Headless (matplotlib's Agg backend), deterministic file output (no timestamp in the PNG metadata),
points drawn as markers joined by lines, one colour per series in insertion order. Needs
``matplotlib`` (the ``dev`` extra).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

Point = tuple[float, float]


def line_plot(
    out: str | Path,
    series: Mapping[str, Sequence[Point]],
    *,
    title: str = "",
    xlabel: str = "",
    ylabel: str = "",
    logx: bool = False,
    logy: bool = False,
    hline: float | None = None,
    hline_label: str = "",
    note: str = "",
    size: tuple[float, float] = (6.4, 4.0),
) -> Path:
    """Write a line chart of ``series`` (name -> [(x, y), ...]) to ``out`` (PNG); its path.

    ``hline`` draws a dashed horizontal reference (e.g. a goal); ``note`` is a small caption
    under the axes (the command and machine that produced the numbers belong there).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not series:
        raise ValueError("nothing to plot: series is empty")
    fig, ax = plt.subplots(figsize=size, dpi=120)
    try:
        for name, pts in series.items():
            if not pts:
                continue
            xs, ys = zip(*sorted(pts), strict=True)
            ax.plot(xs, ys, marker="o", markersize=3.5, linewidth=1.5, label=name)
        if hline is not None:
            ax.axhline(hline, linestyle="--", color="grey", linewidth=1, label=hline_label or None)
        if logx:
            ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
        if note:
            fig.text(0.01, 0.01, note, fontsize=6, color="dimgrey")
        fig.tight_layout(rect=(0, 0.03 if note else 0, 1, 1))
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png", metadata={"Software": None})
    finally:
        plt.close(fig)
    return out


def distill_series(result: Mapping) -> tuple[dict[str, list[Point]], float]:
    """Held-out KL vs bytes/position per offline method family of a ``distill_bench`` result
    (``benchmarks/results/distill.json``: ``mean[method] = {"kl", "bytes_per_position"}``,
    methods ``<family>@<size>``), and online KD's KL (the reference line)."""
    mean = result["mean"]
    series: dict[str, list[Point]] = {}
    for method, row in mean.items():
        if "@" not in method or row.get("bytes_per_position") is None:
            continue
        base, _, size = method.partition("@")
        _, mark, tau = size.partition("~tau")  # a sampled variant at its own proposal tau
        family = base.removeprefix("offline_") + (f" tau={tau}" if mark else "")
        series.setdefault(family, []).append((float(row["bytes_per_position"]), float(row["kl"])))
    return series, float(mean["online_kd"]["kl"])


def distill_plot(result_json: str | Path, out: str | Path) -> Path:
    """The distillation chart (held-out KL vs stored bytes/position) from a committed result."""
    result = json.loads(Path(result_json).read_text())
    series, online = distill_series(result)
    seeds = result.get("seeds") or [result]
    first = seeds[0] if isinstance(seeds, list) else result
    note = f"{Path(result_json).name}, mean of {len(seeds)} seed(s); {first.get('machine', '')}"
    if "models" in first and "train" in first:
        note += (
            f"; teacher vocab {first['models']['vocab_size']}, "
            f"{first['train']['steps']} steps x {first['train']['batch_items']} x "
            f"{first['train']['tokens_per_item']} tokens"
        )
    return line_plot(
        out,
        series,
        title="distillation: held-out KL vs bytes stored per position",
        xlabel="bytes / position (whole store on disk)",
        ylabel="held-out KL (teacher || student)",
        hline=online,
        hline_label="online KD (no cache)",
        note=note,
    )


def loss_series(
    result: Mapping, field: str, vocab: int = 128256, d: int = 4096
) -> dict[str, list[Point]]:
    """``field`` (``peak_gib`` or ``ms``) vs positions per loss variant of a ``loss_bench``
    result (``benchmarks/results/loss.json``: ``sweep = [{"variant", "n", "vocab", "d",
    "status", "peak_gib", "ms"}]``) at one (vocab, d); runs that did not finish ("OOM") are left
    out."""
    series: dict[str, list[Point]] = {}
    for r in result["sweep"]:
        if r["vocab"] == vocab and r["d"] == d and r["status"] == "ok":
            series.setdefault(r["variant"], []).append((float(r["n"]), float(r[field])))
    return series


def loss_plots(result_json: str | Path, out_dir: str | Path, vocab: int = 128256) -> list[Path]:
    """``loss_memory.png`` and ``loss_time.png`` (every variant vs positions) in ``out_dir``."""
    result = json.loads(Path(result_json).read_text())
    meta = result.get("meta", {})
    note = (
        f"{Path(result_json).name}: {meta.get('device', '')}, torch {meta.get('torch', '')}; "
        f"V={vocab}, d=4096, k=100, fwd+bwd; a variant's line ends where it ran out of memory"
    )
    common = dict(xlabel="positions N", logx=True, logy=True, note=note, size=(7.2, 4.4))
    return [
        line_plot(
            Path(out_dir) / "loss_memory.png",
            loss_series(result, "peak_gib", vocab),
            title="distillation loss: peak memory vs positions, every variant",
            ylabel="peak GiB",
            **common,  # type: ignore[arg-type]
        ),
        line_plot(
            Path(out_dir) / "loss_time.png",
            loss_series(result, "ms", vocab),
            title="distillation loss: fwd+bwd time vs positions, every variant",
            ylabel="ms",
            **common,  # type: ignore[arg-type]
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 3 and args[0] == "distill":
        print(distill_plot(args[1], args[2]))
        return 0
    if len(args) == 3 and args[0] == "loss":
        print(*loss_plots(args[1], args[2]), sep="\n")
        return 0
    if len(args) != 2:
        print(
            "usage: plots.py SPEC.json OUT.png | plots.py distill RESULT.json OUT.png | "
            "plots.py loss RESULT.json OUT_DIR",
            file=sys.stderr,
        )
        return 2
    spec = json.loads(Path(args[0]).read_text())
    series = {k: [tuple(p) for p in v] for k, v in spec.pop("series").items()}
    line_plot(args[1], series, **spec)
    print(args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
