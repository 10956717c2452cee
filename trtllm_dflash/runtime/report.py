"""Human-readable output of a run: texts (unless they were streamed) and one summary table (rich)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from .stats import GenerationResult, total_stats

BAR_WIDTH = 20


def acceptance_bars(per_position: list[float]) -> str:
    """One bar per draft position: the share of steps whose draft k was kept."""
    return "\n".join(f"draft {k + 1:>2} {'█' * round(rate * BAR_WIDTH):<{BAR_WIDTH}} {rate:5.1%}"
                     for k, rate in enumerate(per_position))


def print_report(records: list[dict], results: list[GenerationResult], baselines: list[GenerationResult] | None,
                 backend: str, batch_size: int, texts_already_shown: bool = False,
                 console: Console | None = None) -> None:
    console = console or Console()
    if not texts_already_shown:
        for i, record in enumerate(records):
            console.rule(f"prompt {i}")
            if record["prompt"] is not None:
                console.print(record["prompt"], style="dim", markup=False, highlight=False)
            shown = record["text"] if record["text"] is not None else str(record["output_token_ids"])
            console.print(shown, markup=False, highlight=False)
    total = total_stats(results, batch_size)
    table = Table(title=f"DFlash on the {backend} backend", show_header=False)
    table.add_column("metric")
    table.add_column("value", no_wrap=True)
    table.add_row("prompts", str(len(results)))
    table.add_row("output tokens", str(total.num_output_tokens))
    table.add_row("time (prefill + decode)", f"{total.prefill_time:.2f} s + {total.decode_time:.2f} s")
    table.add_row("decode tokens/s", f"{total.decode_tokens_per_s:.1f}")
    table.add_row("verify steps", str(total.steps))
    table.add_row("acceptance length (tau)", f"{total.acceptance_length:.2f} tokens/step")
    table.add_row("per-position acceptance", acceptance_bars(total.per_position_acceptance))
    if baselines is not None:
        base = total_stats(baselines, batch_size)
        table.add_row("baseline decode tokens/s", f"{base.decode_tokens_per_s:.1f}")
        if base.decode_tokens_per_s:
            table.add_row("speed-up", f"{total.decode_tokens_per_s / base.decode_tokens_per_s:.2f}x")
        matched = sum(r["matches_baseline"] for r in records)
        table.add_row("outputs identical to baseline", f"{matched}/{len(records)}")
    console.print(table)
