"""dflash-bench: throughput-interactivity Pareto curves of DFlash vs autoregressive decoding, a
calibrated cost model, and the draft_len_schedule it recommends for TensorRT-LLM.

Concurrency c means c requests decoded together (one static batch of c, the reference runtime's
batching). Outputs have a fixed length (stop tokens ignored, the usual benchmark convention), so
every point decodes the same work and only the speed differs.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from trtllm_dflash.checkpoints.publish import check_output_path
from trtllm_dflash.errors import InputError

from .common import clean_errors, parse_ints, resolve_device, resolve_dtype

DEFAULT_CONCURRENCY = "1,2,4,8,16,32"


def resolve_bench_pair(engine_dir: Path | None, target_dir: Path | None, drafter_dir: Path | None) -> tuple[Path, Path]:
    """Same rules as dflash-run: ENGINE_DIR, --target/--drafter, or the embedded default."""
    from .run import resolve_pair

    target_dir, drafter_dir, _ = resolve_pair(engine_dir, target_dir, drafter_dir, verify=False)
    return target_dir, drafter_dir


def load_prompts(prompts_file: Path | None, target_dir: Path) -> tuple[list[list[int]], str]:
    """Token ids of the prompt set and where it came from."""
    from trtllm_dflash.prompts import prompt_token_ids, read_prompts_file

    if prompts_file is not None:
        prompts, source = read_prompts_file(prompts_file), str(prompts_file)
    else:
        from trtllm_dflash.embedded import heldout_prompts

        prompts, source = heldout_prompts(limit=1024), "embedded held-out prompts"
    return prompt_token_ids(prompts, target_dir), source


def machine_description(device) -> str:
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return f"{os.cpu_count()}-core {platform.machine()} CPU"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("engine_dir", required=False, type=click.Path(path_type=Path))
@click.option("--target", "target_dir", type=click.Path(path_type=Path), help="gpt-oss checkpoint directory.")
@click.option("--drafter", "drafter_dir", type=click.Path(path_type=Path), help="DFlash drafter directory.")
@click.option("--prompts-file", type=click.Path(path_type=Path),
              help="Text lines or JSONL ('prompt' or 'prompt_token_ids'); default: the embedded held-out prompts.")
@click.option("--concurrency", default=DEFAULT_CONCURRENCY, show_default=True, help="Requests decoded together.")
@click.option("--draft-lengths", default="", help="Draft lengths to sweep, e.g. 1,3,7 [default: 1..block_size-1].")
@click.option("--max-tokens", default=32, show_default=True, help="Output tokens per request (fixed length).")
@click.option("--repeats", default=1, show_default=True, help="Runs per point, interleaved; medians are reported.")
@click.option("--requests", default=0, show_default=True,
              help="At least this many requests per point, in full batches (prompts are cycled); 0 = one batch.")
@click.option("--schedule-source", type=click.Choice(["model", "measured"]), default="model", show_default=True,
              help="Choose each band's draft length from the fitted cost model or the raw measurements.")
@click.option("--output-dir", default="dflash_bench", show_default=True, type=click.Path(path_type=Path))
@click.option("--no-plot", is_flag=True, help="Skip pareto.png (no matplotlib needed).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
              show_default=True, help="auto = float32 on CPU, bfloat16 on GPU.")
@clean_errors
def main(engine_dir, target_dir, drafter_dir, prompts_file, concurrency, draft_lengths, max_tokens, repeats, requests,
         schedule_source, output_dir, no_plot, device, dtype):
    """Sweep concurrency x draft length (plus AR and dflash-sa) on ENGINE_DIR, --target/--drafter or the
    embedded pair."""
    from trtllm_dflash.bench.report import analyse, print_summary, write_outputs
    from trtllm_dflash.bench.sweep import SUFFIX_HYBRID, dflash_entries, run_sweep
    from trtllm_dflash.checkpoints.gpt_oss import load_hf_gpt_oss
    from trtllm_dflash.checkpoints.validate import validate_pair
    from trtllm_dflash.models.drafter import load_drafter
    from trtllm_dflash.models.target import GptOssTarget
    from trtllm_dflash.runtime.interface import check_request
    from trtllm_dflash.runtime.sampling import SamplingParams

    for name, value, least in (("--repeats", repeats, 1), ("--requests", requests, 0), ("--max-tokens", max_tokens, 1)):
        if value < least:
            raise InputError(f"expected at least {least}, got {value}.", field=name)
    check_output_path(output_dir, "--output-dir", directory=True)  # before the sweep, not after it
    target_dir, drafter_dir = resolve_bench_pair(engine_dir, target_dir, drafter_dir)
    pair = validate_pair(target_dir, drafter_dir)
    most = pair.drafter_config.block_size - 1
    lengths = parse_ints(draft_lengths, "--draft-lengths", 1) if draft_lengths else list(range(1, most + 1))
    if lengths[-1] > most:
        raise InputError(f"draft lengths go up to block_size - 1 = {most} for this drafter.", field="--draft-lengths")
    levels = parse_ints(concurrency, "--concurrency", 1)
    prompts, prompt_source = load_prompts(prompts_file, target_dir)
    check_request(prompts, 1, pair.target_config["vocab_size"], max_tokens,
                  pair.target_config.get("max_position_embeddings"))  # before any model is loaded

    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    target = GptOssTarget(load_hf_gpt_oss(target_dir, torch_device, torch_dtype))
    drafter = load_drafter(drafter_dir, torch_device, torch_dtype)
    entries = dflash_entries(target, drafter, lengths)
    params = SamplingParams(max_tokens=max_tokens)  # greedy; no stop tokens: fixed-length outputs

    console = Console(stderr=True)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("ETA"), TimeRemainingColumn(), console=console) as progress:
        task = progress.add_task("sweep", total=len(entries) * len(levels) * repeats)

        def on_point(entry, c):
            progress.update(task, advance=1, description=f"{entry.method} K={entry.draft_len} c={c}")

        points = run_sweep(entries, prompts, params, levels, repeats, requests, on_point)

    title = f"{target_dir.name} + {drafter_dir.name} on {machine_description(torch_device)}, {max_tokens} tokens/request"
    document = {"schema": "dflash-bench/1", "title": title,
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "command": " ".join(["dflash-bench", *sys.argv[1:]]),
                "machine": machine_description(torch_device), "device": str(torch_device),
                "pair": {"target": str(target_dir), "drafter": str(drafter_dir),
                         "block_size": pair.drafter_config.block_size},
                "prompts": {"source": prompt_source, "count": len(prompts)},
                "settings": {"concurrency": levels, "draft_lengths": lengths, "max_tokens": max_tokens,
                             "repeats": repeats, "requests": requests, "dtype": str(torch_dtype).removeprefix("torch.")},
                "points": [p.to_dict() for p in points],
                # acceptance is known up to the longest swept; TensorRT-LLM's schedule from its own method only
                **analyse([p for p in points if p.method != SUFFIX_HYBRID], lengths[-1], schedule_source)}
    written = write_outputs(document, points, output_dir, plot=not no_plot)
    print_summary(document, points, Console())
    click.echo("wrote " + ", ".join(str(p) for p in written))
