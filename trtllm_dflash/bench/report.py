"""From measured points to what a reader needs: headline ratios, the fitted cost model and its
held-out error, the schedule, and the JSON / CSV / plot / table forms of all of it."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..errors import MissingDependencyError
from .cost_model import CostModel, fit_cost_model, holdout_error
from .pareto import best_throughput_gain, frontier
from .points import AR, CSV_COLUMNS, BenchPoint, csv_row
from .schedule import build_schedule, measured_score, model_score

SCHEMA = "dflash-bench/1"


def curve(points: Sequence[BenchPoint]) -> list[tuple[float, float]]:
    return [(p.tokens_per_s_user, p.tokens_per_s) for p in points]


def headline(points: Sequence[BenchPoint]) -> dict:
    """The two ratios NVIDIA's Blackwell claim is made of (dflash-algorithm.md §7.3): DFlash's
    throughput over AR's at equal interactivity (best over the overlap of the curves), and its
    interactivity over AR's at the smallest concurrency."""
    ar = [p for p in points if p.method == AR]
    spec = [p for p in points if p.method != AR]
    gain = best_throughput_gain(curve(spec), curve(ar))
    at = next((p for p in spec if p.tokens_per_s_user == gain[0]), None) if gain else None
    smallest = min(p.concurrency for p in points)
    ar_small = [p for p in ar if p.concurrency == smallest]
    spec_small = max((p for p in spec if p.concurrency == smallest), key=lambda p: p.tokens_per_s_user, default=None)
    interactivity = None
    if ar_small and spec_small and ar_small[0].tokens_per_s_user:
        interactivity = {"ratio": spec_small.tokens_per_s_user / ar_small[0].tokens_per_s_user,
                         "concurrency": smallest, "draft_len": spec_small.draft_len}
    throughput = None if at is None else {"ratio": gain[1], "tokens_per_s_user": gain[0],
                                          "draft_len": at.draft_len, "concurrency": at.concurrency}
    return {"throughput_gain_at_equal_interactivity": throughput, "interactivity_gain_at_smallest_batch": interactivity}


def analyse(points: Sequence[BenchPoint], max_draft_len: int, schedule_source: str = "model") -> dict:
    """Headline, cost model (fitted on every point) with its held-out error, and the schedule."""
    model = fit_cost_model(points)
    keys = sorted({p.concurrency for p in points})
    score = model_score(model) if schedule_source == "model" else measured_score(points)
    source = "cost model fitted on this sweep" if schedule_source == "model" else "measured points"
    return {"headline": headline(points),
            "cost_model": {"fit": model.to_dict(), "holdout": holdout_error(points)},
            "schedule": build_schedule(score, keys, max_draft_len, source)}


def write_outputs(document: dict, points: Sequence[BenchPoint], out_dir: Path, plot: bool) -> list[Path]:
    """bench.json, bench.csv and (optionally) pareto.png in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out_dir / "bench.json", out_dir / "bench.csv"
    json_path.write_text(json.dumps(document, indent=2) + "\n")
    with csv_path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_COLUMNS)
        writer.writerows(csv_row(p) for p in points)
    written = [json_path, csv_path]
    if plot:
        written.append(plot_pareto(points, out_dir / "pareto.png", document.get("title", "DFlash vs autoregressive")))
    return written


def plot_pareto(points: Sequence[BenchPoint], path: Path, title: str) -> Path:
    """Aggregate tokens/s vs tokens/s per user: one line per draft length, AR, and DFlash's frontier."""
    try:
        import matplotlib
    except ImportError:
        raise MissingDependencyError("matplotlib", "the Pareto plot", "Install it or pass --no-plot.") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for method, draft_len in sorted({(p.method, p.draft_len) for p in points}, key=lambda m: (m[0] != AR, m)):
        line = sorted((p for p in points if (p.method, p.draft_len) == (method, draft_len)), key=lambda p: p.concurrency)
        label = "autoregressive" if method == AR else f"{method} K={draft_len}"
        style = dict(color="black", linewidth=2.5) if method == AR else dict(alpha=0.8)
        ax.plot([p.tokens_per_s_user for p in line], [p.tokens_per_s for p in line], marker="o", label=label, **style)
        if method == AR:
            for p in line:
                ax.annotate(f"c={p.concurrency}", (p.tokens_per_s_user, p.tokens_per_s), fontsize=7,
                            textcoords="offset points", xytext=(4, -10))
    best = frontier(curve([p for p in points if p.method != AR]))
    if best:
        ax.plot(*zip(*best), linestyle="--", color="tab:red", linewidth=1.5, label="speculative frontier")
    ax.set_xlabel("decode tokens/s per user (interactivity)")
    ax.set_ylabel("aggregate decode tokens/s (throughput)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def print_summary(document: dict, points: Sequence[BenchPoint], console: Console) -> None:
    model = CostModel.from_dict(document["cost_model"]["fit"])
    table = Table(title=document.get("title", "dflash-bench"))
    for column in ("method", "K", "c", "tok/s/user", "tok/s", "model tok/s", "tau", "draft ms", "verify ms",
                   "step ms", "acceptance by position"):
        table.add_column(column, justify="left" if column in ("method", "acceptance by position") else "right")
    for p in sorted(points, key=lambda p: (p.concurrency, p.method != AR, p.draft_len)):
        table.add_row(p.method, str(p.draft_len), str(p.concurrency), f"{p.tokens_per_s_user:.1f}",
                      f"{p.tokens_per_s:.1f}", f"{model.tokens_per_s(p.mean_batch, p.draft_len):.1f}", f"{p.tau:.2f}",
                      f"{p.draft_s * 1e3:.2f}", f"{p.verify_s * 1e3:.2f}", f"{p.step_s * 1e3:.2f}",
                      " ".join(f"{a:.2f}" for a in p.per_position_acceptance))
    console.print(table)
    for line in summary_lines(document):
        console.print(line)


def summary_lines(document: dict) -> list[str]:
    head, holdout, schedule = document["headline"], document["cost_model"]["holdout"], document["schedule"]
    gain, inter = head["throughput_gain_at_equal_interactivity"], head["interactivity_gain_at_smallest_batch"]
    lines = [
        "throughput gain at equal interactivity: " + (
            f"{gain['ratio']:.2f}x at {gain['tokens_per_s_user']:.1f} tok/s/user (K={gain['draft_len']}, "
            f"c={gain['concurrency']})" if gain else "none (the speculative and AR curves do not overlap in tok/s/user)"),
        "interactivity gain at the smallest batch: " + (
            f"{inter['ratio']:.2f}x at c={inter['concurrency']} (K={inter['draft_len']})" if inter else "n/a"),
        "cost model held-out error (throughput): " + (
            f"mean {holdout['mean_abs_relative_error']:.1%}, max {holdout['max_abs_relative_error']:.1%} "
            f"(fit on c={holdout['fit_concurrency']}, predicted c={holdout['heldout_concurrency']})"
            if holdout else "n/a (needs at least three concurrencies)"),
        f"draft_len_schedule ({schedule['source']}): {schedule['draft_len_schedule'] or '{} (speculation off)'}, "
        f"max_draft_len {schedule['max_draft_len']}" + (f"; capped bands {schedule['capped_bands']}"
                                                        if schedule["capped_bands"] else ""),
    ]
    return lines
