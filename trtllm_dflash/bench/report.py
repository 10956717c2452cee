"""From measured points to what a reader needs: headline ratios with bootstrap intervals, the
fitted cost model and its held-out error, the schedule (or why none is recommended), and the JSON /
CSV / one-screen table forms of all of it."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from .confidence import decisive_spread, headline_intervals, recommendation, schedule_effect, spread_summary
from .cost_model import fit_cost_model, holdout_error
from .pareto import best_throughput_gain
from .points import AR, CONCURRENCY, CSV_COLUMNS, SUFFIX_HYBRID, BenchPoint, csv_row
from .schedule import build_schedule, choose_lengths, measured_score, model_score

SCHEMA = "dflash-bench/2"


def curve(points: Sequence[BenchPoint]) -> list[tuple[float, float]]:
    return [(p.tokens_per_s_user, p.tokens_per_s) for p in points]


def headline(points: Sequence[BenchPoint]) -> dict:
    """The two ratios NVIDIA's Blackwell claim is made of (dflash-algorithm.md §7.3): DFlash's
    throughput over AR's at equal interactivity (best over the overlap of the curves), and its
    interactivity over AR's at the lightest load."""
    ar = [p for p in points if p.method == AR]
    spec = [p for p in points if p.method != AR]
    gain = best_throughput_gain(curve(spec), curve(ar))
    at = next((p for p in spec if p.tokens_per_s_user == gain[0]), None) if gain else None
    lightest = min(p.level for p in points)
    ar_light = [p for p in ar if p.level == lightest]
    spec_light = max((p for p in spec if p.level == lightest), key=lambda p: p.tokens_per_s_user, default=None)
    interactivity = None
    if ar_light and spec_light and ar_light[0].tokens_per_s_user:
        interactivity = {"ratio": spec_light.tokens_per_s_user / ar_light[0].tokens_per_s_user,
                         "load": spec_light.label, "concurrency": spec_light.concurrency,
                         "draft_len": spec_light.draft_len}
    throughput = None if at is None else {"ratio": gain[1], "tokens_per_s_user": gain[0], "load": at.label,
                                          "draft_len": at.draft_len, "concurrency": at.concurrency}
    return {"throughput_gain_at_equal_interactivity": throughput, "interactivity_gain_at_smallest_batch": interactivity}


def cost_model_section(points: Sequence[BenchPoint]) -> dict | None:
    """Fit on every point plus its held-out error; None where the points carry no step times."""
    usable = [p for p in points if p.load == CONCURRENCY and p.step_s is not None]
    if not usable or len(usable) < len(points):
        return None
    return {"fit": fit_cost_model(usable).to_dict(), "holdout": holdout_error(usable)}


def schedule_section(points: Sequence[BenchPoint], max_draft_len: int, source: str, cost: dict | None) -> dict:
    """The schedule with its effect and the noise it was compared with; `draft_len_schedule` is only
    present when recommended (`candidate_draft_len_schedule` always is, when one could be formed)."""
    closed = [p for p in points if p.load == CONCURRENCY]
    if not closed or not any(p.method == AR for p in closed) or not any(p.method != AR for p in closed):
        return {"recommended": False, "reason": "a schedule needs a concurrency sweep with both AR (draft length 0) "
                                                "and DFlash points"}
    if any(p.draft_len < 0 for p in closed):
        return {"recommended": False, "reason": "the server models' draft lengths are not known (name them "
                                                "--model NAME=DRAFT_LEN)"}
    uses_model = source == "model"
    if uses_model and cost is None:
        return {"recommended": False, "reason": "the cost model needs in-process step times; use "
                                                "--schedule-source measured for a server"}
    from .cost_model import CostModel

    score = model_score(CostModel.from_dict(cost["fit"])) if uses_model else measured_score(closed)
    keys = sorted({p.concurrency for p in closed})
    section = build_schedule(score, keys, max_draft_len,
                             "cost model fitted on this sweep" if uses_model else "measured points")
    lengths, _ = choose_lengths(score, keys, max_draft_len)
    effect = schedule_effect(score, lengths, max_draft_len)
    holdout = cost["holdout"] if cost else None
    verdict = recommendation(effect, spread_summary(closed), holdout["mean_abs_relative_error"] if holdout else None,
                             uses_model, decisive_spread(closed, effect))
    section["candidate_draft_len_schedule"] = section.pop("draft_len_schedule")
    if verdict["recommended"]:
        section["draft_len_schedule"] = section["candidate_draft_len_schedule"]
    return {**section, **verdict, "effect": effect}


def analyse(points: Sequence[BenchPoint], max_draft_len: int, schedule_source: str = "model", seed: int = 0) -> dict:
    """Headline with intervals, spread, cost model (fitted on every point) with its held-out error,
    and the schedule or the reason none is recommended; all of it for TensorRT-LLM's methods (AR,
    DFlash), so dflash-sa points are measured and shown but not analysed."""
    points = [p for p in points if p.method != SUFFIX_HYBRID]
    cost = cost_model_section(points)
    return {"headline": headline(points), "headline_ci95": headline_intervals(points, headline, seed),
            "spread": spread_summary(points), "cost_model": cost,
            "schedule": schedule_section(points, max_draft_len, schedule_source, cost)}


def write_outputs(document: dict, points: Sequence[BenchPoint], out_dir: Path, plot: bool) -> list[Path]:
    """bench.json, bench.csv and (optionally) pareto.png and latency_cdf.png in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out_dir / "bench.json", out_dir / "bench.csv"
    json_path.write_text(json.dumps(document, indent=2) + "\n")
    with csv_path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_COLUMNS)
        writer.writerows(csv_row(p) for p in points)
    written = [json_path, csv_path]
    if plot and points:
        from .plots import plot_latency_cdf, plot_pareto

        title = document.get("title", "DFlash vs autoregressive")
        written.append(plot_pareto(points, out_dir / "pareto.png", title))
        written.append(plot_latency_cdf(points, out_dir / "latency_cdf.png", title))
    return written


def ms(stats: dict | None, key: str) -> str:
    return "-" if not stats else f"{stats[key] * 1e3:.1f}"


def with_spread(value: float, spread: float | None) -> str:
    return f"{value:.0f}" if spread is None else f"{value:.0f}±{spread * 50:.0f}%"


def print_summary(document: dict, points: Sequence[BenchPoint], console: Console) -> None:
    """One screen, 100 columns: a row per point, then the headline, noise and schedule lines."""
    table = Table(title=document.get("title", "dflash-bench"), title_style="bold", box=box.SIMPLE_HEAD,
                  padding=(0, 1), pad_edge=False)
    for column in ("run", "load", "tok/s/user", "tok/s", "req/s", "TTFT50", "TPOT50", "ITL99", "E2E99", "tau"):
        table.add_column(column, justify="left" if column in ("run", "load") else "right", no_wrap=True)
    for p in sorted(points, key=lambda p: (p.level, p.method != AR, p.draft_len)):
        lat = p.latency
        run = "ar" if p.method == AR else f"{p.method} K={p.draft_len if p.draft_len >= 0 else '?'}"
        table.add_row(run, p.label, with_spread(p.tokens_per_s_user, p.spread("tokens_per_s_user")),
                      with_spread(p.tokens_per_s, p.spread()), f"{p.requests_per_s:.2f}", ms(lat.get("ttft_s"), "p50"),
                      ms(lat.get("tpot_s"), "p50"), ms(lat.get("itl_s"), "p99"), ms(lat.get("e2e_s"), "p99"),
                      "n/r" if p.tau is None else f"{p.tau:.2f}")
    console.print(table)
    console.print("latencies in ms (50: median, 99: p99; p90 and means in bench.json); ±: half the min-max range "
                  "over repeats; n/r: not reported by the server", style="dim")
    for line in summary_lines(document):
        console.print(line, width=100, markup=False, highlight=False)


def interval_text(interval: list[float] | None) -> str:
    return (f" (95% CI {interval[0]:.2f}-{interval[1]:.2f})" if interval else
            " (no 95% CI: one repeat, or the curves overlap in under half of the resamples)")


def summary_lines(document: dict) -> list[str]:
    head, cost, schedule = document["headline"], document["cost_model"], document["schedule"]
    ci = document.get("headline_ci95", {})
    gain, inter = head["throughput_gain_at_equal_interactivity"], head["interactivity_gain_at_smallest_batch"]
    holdout = cost["holdout"] if cost else None
    error = (f"mean {holdout['mean_abs_relative_error']:.0%}, max {holdout['max_abs_relative_error']:.0%}"
             if holdout else "unknown")
    spread = document.get("spread")
    lines = [
        "throughput gain at equal interactivity: " + (
            f"{gain['ratio']:.2f}x{interval_text(ci.get('throughput_gain_at_equal_interactivity'))} at "
            f"{gain['tokens_per_s_user']:.1f} tok/s/user (K={gain['draft_len']}, {gain['load']})"
            if gain else "none (the DFlash and AR curves do not overlap in tok/s/user)"),
        "interactivity gain at the lightest load: " + (
            f"{inter['ratio']:.2f}x{interval_text(ci.get('interactivity_gain_at_smallest_batch'))} at "
            f"{inter['load']} (K={inter['draft_len']})" if inter else "n/a"),
        "run-to-run spread of tok/s: " + (f"median {spread['median']:.1%}, max {spread['max']:.1%}"
                                          if spread else "unknown (one repeat)"),
        "cost model: " + ("not fitted (it needs an in-process concurrency sweep: step times)" if cost is None else
                          f"held-out error {error}" + (f" (fit on c={holdout['fit_concurrency']}, predicted "
                                                       f"c={holdout['heldout_concurrency']})" if holdout else "")),
    ]
    if schedule.get("recommended"):
        model = f"; model held-out error {error}" if schedule["source"].startswith("cost model") else ""
        lines.append(f"draft_len_schedule ({schedule['source']}{model}): "
                     f"{schedule['draft_len_schedule'] or '{} (speculation off)'}, max_draft_len "
                     f"{schedule['max_draft_len']}; {schedule['reason']}")
    else:
        candidate = schedule.get("candidate_draft_len_schedule")
        lines.append("schedule NOT recommended: " + schedule["reason"]
                     + (f" (candidate {candidate or '{}'})" if candidate is not None else ""))
    return lines
