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


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: plots.py SPEC.json OUT.png", file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text())
    series = {k: [tuple(p) for p in v] for k, v in spec.pop("series").items()}
    line_plot(args[1], series, **spec)
    print(args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
