"""Plots of the comparison's record. matplotlib is needed here only (`report.write` imports
this module when there is something to plot), so the tests and the JSON do without it;
figures are built with the object API, which needs no display backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from benchmarks.serving.record import grouped, median


def _panels(count: int) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(4 * count, 3.6), layout="tight")
    return fig, list(fig.subplots(1, count, squeeze=False)[0])


def plot_all(record: dict[str, Any], out: Path) -> None:
    """throughput.png: output tokens/s against concurrency, one panel per workload;
    ttft.png: TTFT distribution (empirical CDF) at each workload's highest concurrency."""
    cells = grouped(record)
    workloads, levels, peers = record["workloads"], record["concurrency"], list(record["peers"])

    fig, axes = _panels(len(workloads))
    for ax, workload in zip(axes, workloads):
        for peer in peers:
            points = [
                (c, median(cells[peer, workload, c], lambda s: s["output_throughput"]))
                for c in levels
                if (peer, workload, c) in cells
            ]
            if points:
                ax.plot(*zip(*points), marker="o", label=peer)
        ax.set(title=workload, xlabel="concurrency", ylabel="output tokens/s", xscale="log")
        ax.minorticks_off()
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.savefig(out / "throughput.png", dpi=110)

    fig, axes = _panels(len(workloads))
    for ax, workload in zip(axes, workloads):
        top = max((c for _, w, c in cells if w == workload), default=max(levels))
        for peer in peers:
            ttfts = sorted(t for e in cells.get((peer, workload, top), []) for t in e["ttft_ms"])
            if ttfts:
                fractions = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
                ax.step([ttfts[0], *ttfts], [0, *fractions], where="post", label=peer)
        ax.set(
            title=f"{workload}, c={top}",
            xlabel="TTFT ms (log)",
            ylabel="fraction of requests",
            xscale="log",
            ylim=(0, 1.02),
        )
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.savefig(out / "ttft.png", dpi=110)
