"""What a run reports: per-prompt records, the summary object, and the human-readable table (rich).

With a baseline every figure of speed comes from interleaved repeats (speculative, then
autoregressive, per batch of prompts): a per-prompt speed-up is the median of its per-repeat
ratios, the overall one the median over repeats of total decode tokens over total decode time,
with its min..max. tau is pooled: committed tokens over verify steps of all prompts.
"""

from __future__ import annotations

import statistics

from rich.console import Console
from rich.table import Table

from .stats import GenerationResult, Spread, total_stats

BAR_WIDTH = 20
METHOD_TITLES = {"dflash": "DFlash", "dflash-sa": "DFlash + suffix automaton", "ngram": "n-gram prompt lookup"}


def acceptance_bars(per_position: list[float]) -> str:
    """One bar per draft position: the share of steps whose draft k was kept."""
    return "\n".join(f"draft {k + 1:>2} {'█' * round(rate * BAR_WIDTH):<{BAR_WIDTH}} {rate:5.1%}"
                     for k, rate in enumerate(per_position))


def method_title(summary: dict) -> str:
    title = METHOD_TITLES[summary["method"]]
    if summary.get("sa_threshold"):
        title += f" (threshold {summary['sa_threshold']})"
    return title + ", adaptive draft length" if summary.get("draft_length") == "adaptive" else title


def speed_record(runs: list[GenerationResult], base_runs: list[GenerationResult]) -> dict:
    """One prompt's figures over repeats: median rates, median per-repeat speed-up and its spread."""
    rates = [r.stats.decode_tokens_per_s for r in runs]
    base_rates = [b.stats.decode_tokens_per_s for b in base_runs]
    ratios = [r / b for r, b in zip(rates, base_rates) if b]
    spread = Spread.of(ratios) if ratios else None
    return {"decode_tokens_per_s": statistics.median(rates),
            "baseline_decode_tokens_per_s": statistics.median(base_rates),
            "speedup": spread and spread.median, "speedup_min": spread and spread.low,
            "speedup_max": spread and spread.high}


def summary_record(results: list[GenerationResult], spec_runs: list[list[GenerationResult]] | None,
                   base_runs: list[list[GenerationResult]] | None, batch_size: int, **settings) -> dict:
    """The last JSON object of a run. results: the reported (first) run; spec_runs / base_runs: every
    repeat of the speculative and autoregressive runs (None without a baseline). settings: method,
    sa_threshold, draft_length, drafter_gemm_dtype, expert_dtype, drafter_cpu_kernels, target_cpu_kernels, backend,
    batching, threads, repeats."""
    total = total_stats(results, batch_size)
    summary = {"summary": True, **settings, "prompts": len(results), "batch_size": batch_size,
               "output_tokens": total.num_output_tokens, "steps": total.steps,
               "acceptance_length": total.acceptance_length if total.steps else None,
               "suffix_steps": total.suffix_steps, "draftless_steps": total.draftless_steps,
               "decode_tokens_per_s": total.decode_tokens_per_s}
    if base_runs:
        rates = [total_stats(run, batch_size).decode_tokens_per_s for run in spec_runs]
        base_rates = [total_stats(run, batch_size).decode_tokens_per_s for run in base_runs]
        summary.update(decode_tokens_per_s=statistics.median(rates),
                       baseline_decode_tokens_per_s=statistics.median(base_rates))
        if all(base_rates):
            spread = Spread.of([r / b for r, b in zip(rates, base_rates)])
            summary.update(speedup=spread.median, speedup_min=spread.low, speedup_max=spread.high,
                           spread_wider_than_effect=spread.wider_than_effect)
        summary["outputs_identical"] = sum(r.output_token_ids == b.output_token_ids
                                           for r, b in zip(results, base_runs[0]))
    return summary


def spread_warning(summary: dict) -> str | None:
    if not summary.get("spread_wider_than_effect"):
        return None
    remedies = ("more --repeats", "a quieter machine") if summary.get("threads") == 1 else (
        "--threads 1", "more --repeats", "a quieter machine")
    return (f"warning: over {summary['repeats']} interleaved repeats the speed-up ranged "
            f"{summary['speedup_min']:.2f}x..{summary['speedup_max']:.2f}x, wider than its distance from 1.0x "
            f"(median {summary['speedup']:.2f}x): noise, not a result. Try {', '.join(remedies[:-1])} or "
            f"{remedies[-1]}.")


def print_report(records: list[dict], summary: dict, results: list[GenerationResult], batch_size: int,
                 texts_already_shown: bool = False, console: Console | None = None) -> None:
    console = console or Console()
    if not texts_already_shown:
        for i, record in enumerate(records):
            console.rule(f"prompt {i}")
            if record["prompt"] is not None:
                console.print(record["prompt"], style="dim", markup=False, highlight=False)
            shown = record["text"] if record["text"] is not None else str(record["output_token_ids"])
            console.print(shown, markup=False, highlight=False)
    total = total_stats(results, batch_size)
    table = Table(title=f"{method_title(summary)} on the {summary['backend']} backend", show_header=False)
    table.add_column("metric")
    table.add_column("value", no_wrap=True)
    table.add_row("prompts", str(len(results)))
    table.add_row("output tokens", str(total.num_output_tokens))
    table.add_row("time (prefill + decode)", f"{total.prefill_time:.2f} s + {total.decode_time:.2f} s")
    table.add_row("decode tokens/s", f"{summary['decode_tokens_per_s']:.1f}")
    table.add_row("verify steps", str(total.steps))
    tau = summary["acceptance_length"]
    table.add_row("acceptance length (tau)", "-" if tau is None else f"{tau:.2f} tokens/step")
    if summary["method"] == "dflash-sa":
        table.add_row("steps with suffix drafts", f"{summary['suffix_steps']}/{total.steps}")
    if summary["draftless_steps"]:
        table.add_row("steps without drafts", f"{summary['draftless_steps']}/{total.steps}")
    table.add_row("per-position acceptance", acceptance_bars(total.per_position_acceptance))
    table.add_row("threads", str(summary["threads"]))
    if summary.get("drafter_gemm_dtype"):
        table.add_row("drafter GEMMs", summary["drafter_gemm_dtype"])
    if summary.get("drafter_cpu_kernels") is not None:
        table.add_row("drafter step", "compiled CPU kernels" if summary["drafter_cpu_kernels"] else "torch ops")
    if summary.get("expert_dtype"):
        table.add_row("expert weights read as", summary["expert_dtype"])
    if summary.get("target_cpu_kernels") is not None:
        table.add_row("target on compiled CPU kernels", ", ".join(summary["target_cpu_kernels"]) or "none (torch ops)")
    if "baseline_decode_tokens_per_s" in summary:
        table.add_row("baseline decode tokens/s", f"{summary['baseline_decode_tokens_per_s']:.1f}")
        if "speedup" in summary:
            table.add_row(f"speed-up (median of {summary['repeats']}, interleaved)",
                          f"{summary['speedup']:.2f}x ({summary['speedup_min']:.2f}x..{summary['speedup_max']:.2f}x)")
        table.add_row("outputs identical to baseline", f"{summary['outputs_identical']}/{len(records)}")
    console.print(table)
