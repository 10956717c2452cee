"""The bench's plots: the throughput-interactivity Pareto chart with each point's spread as error
bars, and latency CDFs. matplotlib is a dependency of the package; `require_matplotlib` checks it
before a sweep starts, so a missing or broken install never costs a finished sweep."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..errors import MissingDependencyError
from .pareto import frontier
from .points import AR, BenchPoint


def require_matplotlib():
    """pyplot on the Agg backend, or MissingDependencyError naming the fix."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingDependencyError("matplotlib", "the bench plots",
                                     "Install it (pip install matplotlib) or pass --no-plot.") from None
    return plt


def curves(points: Sequence[BenchPoint]) -> list[tuple[str, list[BenchPoint]]]:
    """(label, points by load) per (method, draft length), AR first."""
    keys = sorted({(p.method, p.draft_len) for p in points}, key=lambda m: (m[0] != AR, m))
    return [("autoregressive" if method == AR else f"{method} K={k}",
             sorted((p for p in points if (p.method, p.draft_len) == (method, k)), key=lambda p: p.level))
            for method, k in keys]


def error_bar(values: list[float], median: float) -> tuple[float, float]:
    return (median - min(values), max(values) - median) if len(values) > 1 else (0.0, 0.0)


def plot_pareto(points: Sequence[BenchPoint], path: Path, title: str) -> Path:
    """Aggregate tokens/s vs tokens/s per user: one line per draft length, AR, DFlash's frontier;
    error bars span the min-max over repeats (overlapping bars = the difference is noise)."""
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for label, line in curves(points):
        style = dict(color="black", linewidth=2.5) if label == "autoregressive" else dict(alpha=0.8)
        xerr = list(zip(*(error_bar(p.tokens_per_s_user_repeats, p.tokens_per_s_user) for p in line)))
        yerr = list(zip(*(error_bar(p.tokens_per_s_repeats, p.tokens_per_s) for p in line)))
        ax.errorbar([p.tokens_per_s_user for p in line], [p.tokens_per_s for p in line], xerr=xerr, yerr=yerr,
                    marker="o", capsize=2, label=label, **style)
        if label == "autoregressive":
            for p in line:
                ax.annotate(p.label, (p.tokens_per_s_user, p.tokens_per_s), fontsize=7,
                            textcoords="offset points", xytext=(4, -10))
    best = frontier([(p.tokens_per_s_user, p.tokens_per_s) for p in points if p.method != AR])
    if best:
        ax.plot(*zip(*best), linestyle="--", color="tab:red", linewidth=1.5, label="speculative frontier")
    ax.set_xlabel("decode tokens/s per user (interactivity, 1/TPOT)")
    ax.set_ylabel("output tokens/s (throughput)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_latency_cdf(points: Sequence[BenchPoint], path: Path, title: str) -> Path:
    """CDFs of TTFT, TPOT and end-to-end latency, one line per point (colour: method, shade: load)."""
    plt = require_matplotlib()
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (label, line) in enumerate(curves(points)):
        colour = "black" if label == "autoregressive" else colours[index % len(colours)]
        for rank, p in enumerate(line):
            shade = 0.35 + 0.65 * (rank + 1) / len(line)
            for ax, name in zip(axes, ("ttft_s", "tpot_s", "e2e_s")):
                values = sorted(v * 1e3 for v in p.samples.get(name, []))
                if values:
                    ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", color=colour,
                            alpha=shade, linewidth=1, label=f"{label} {p.label}")
    for ax, name in zip(axes, ("time to first token (ms)", "time per output token (ms)", "end-to-end latency (ms)")):
        ax.set_xlabel(name)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # labelled minor ticks collide on a narrow range
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    handles, labels = axes[2].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=6, loc="center right", ncol=1 + len(labels) // 24)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.82, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
