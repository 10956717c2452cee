"""dflash-bench: a serving benchmark of DFlash vs autoregressive decoding -- throughput-interactivity
Pareto curves with their spread, TTFT / TPOT / ITL / end-to-end latency percentiles, a calibrated
cost model, and the draft_len_schedule it recommends for TensorRT-LLM (only when it stands out of
the noise).

Runs the in-process reference runtime (ENGINE_DIR, --target/--drafter or the embedded pair), or a
running server (--endpoint http://HOST:PORT --protocol triton|openai). Load: a closed loop of
--concurrency users, or Poisson arrivals at --request-rate requests/s; --requests per run or
--duration seconds. Outputs have a fixed length (--max-tokens, stop tokens ignored where the
runtime allows it), so every point decodes the same work and only the speed differs.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path

import click
from rich.console import Console

from trtllm_dflash.checkpoints.publish import check_output_path
from trtllm_dflash.errors import InputError

from .common import clean_errors, parse_ints, resolve_device, resolve_dtype

DEFAULT_CONCURRENCY = "1,2,4,8"
DEFAULT_DRAFT_LENGTHS = (1, 3, 7)  # short, middle, longest for the embedded pair's block of 8


def resolve_bench_pair(engine_dir: Path | None, target_dir: Path | None, drafter_dir: Path | None) -> tuple[Path, Path]:
    """Same rules as dflash-run: ENGINE_DIR, --target/--drafter, or the embedded default."""
    from .run import resolve_pair

    target_dir, drafter_dir, _ = resolve_pair(engine_dir, target_dir, drafter_dir, verify=False)
    return target_dir, drafter_dir


def load_prompts(prompts_file: Path | None, sharegpt: Path | None, synthetic_len: int, count: int,
                 vocab_size: int | None, seed: int) -> tuple[list, str]:
    """Prompts (text or token ids) and where they came from."""
    from trtllm_dflash.bench.load import read_sharegpt, synthetic_prompts
    from trtllm_dflash.prompts import read_prompts_file

    chosen = [name for name, given in (("--prompts-file", prompts_file), ("--sharegpt", sharegpt),
                                       ("--synthetic-input-len", synthetic_len)) if given]
    if len(chosen) > 1:
        raise InputError(f"give one prompt source, not {' and '.join(chosen)}.", field=chosen[1])
    if prompts_file is not None:
        return read_prompts_file(prompts_file), str(prompts_file)
    if sharegpt is not None:
        return read_sharegpt(sharegpt), f"ShareGPT {sharegpt}"
    if synthetic_len:
        if vocab_size is None:
            raise InputError("synthetic prompts against a server need its vocabulary size.", field="--vocab-size")
        return (synthetic_prompts(count, synthetic_len, vocab_size, seed),
                f"synthetic: {count} prompts of {synthetic_len} random token ids (seed {seed})")
    from trtllm_dflash.embedded import heldout_prompts

    return heldout_prompts(limit=1024), "embedded held-out prompts"


def machine_description(device) -> str:
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return f"{os.cpu_count()}-core {platform.machine()} CPU"


def parse_models(values: tuple[str, ...]) -> list[tuple[str, int]]:
    """--model NAME[=K] -> (name, draft length; -1 when not given)."""
    models = []
    for value in values:
        name, _, k = value.partition("=")
        if not name or (k and not k.isdigit()):
            raise InputError(f"expected NAME or NAME=DRAFT_LEN (e.g. dflash=7, ar=0), got {value!r}.", field="--model")
        models.append((name, int(k) if k else -1))
    return models


def parse_rates(text: str) -> list[float]:
    try:
        rates = sorted({float(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise InputError(f"expected comma-separated requests/s, got {text!r}.", field="--request-rate") from None
    if not rates or rates[0] <= 0:
        raise InputError(f"expected positive requests/s, got {text!r}.", field="--request-rate")
    return rates


class ProgressReport:
    """A rich bar on a terminal; one line per finished point otherwise (logs, CI, pipes)."""

    def __init__(self, console: Console, total: int):
        self.console, self.total, self.done = console, total, 0
        self.progress = None
        if console.is_terminal:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console)
            self.task = self.progress.add_task("sweep", total=total)

    def __enter__(self):
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.stop()

    def __call__(self, runner, shape, run, repeat) -> None:
        from trtllm_dflash.bench.metrics import run_figures
        from trtllm_dflash.bench.sweep import runner_name

        self.done += 1
        name = f"{runner_name(runner)} {shape.label} repeat {repeat + 1}"
        if self.progress is not None:
            self.progress.update(self.task, advance=1, description=name)
            return
        figures = run_figures(run.records)
        ttft = (figures.get("latency") or {}).get("ttft_s")
        click.echo(f"[{self.done}/{self.total}] {name}: {figures.get('output_tokens_per_s', 0):.1f} tok/s, "
                   f"{figures.get('tokens_per_s_user', 0):.1f} tok/s/user, "
                   f"TTFT p50 {ttft['p50'] * 1e3:.1f} ms" if ttft else "no request completed", err=True)


def in_process_runners(target_dir, drafter_dir, draft_lengths, prompts, max_tokens, max_batch, device, dtype, threads):
    """(runners, token-id prompts, draft lengths, description) for the reference runtime."""
    import torch

    from trtllm_dflash.bench.sweep import InProcessRunner
    from trtllm_dflash.checkpoints.gpt_oss import load_hf_gpt_oss
    from trtllm_dflash.checkpoints.validate import validate_pair
    from trtllm_dflash.models.drafter import load_drafter
    from trtllm_dflash.models.linear import drafter_gemm_dtype
    from trtllm_dflash.models.target import GptOssTarget
    from trtllm_dflash.prompts import prompt_token_ids
    from trtllm_dflash.runtime.interface import check_request
    from trtllm_dflash.bench.points import SUFFIX_HYBRID
    from trtllm_dflash.runtime.proposers import (DEFAULT_SA_THRESHOLD, DFlashProposer, SuffixDFlashProposer,
                                                 default_sa_max_drafts)
    from trtllm_dflash.runtime.reference import ReferenceRuntime
    from trtllm_dflash.runtime.tuning import choose_expert_storage

    pair = validate_pair(target_dir, drafter_dir)
    most = pair.drafter_config.block_size - 1
    lengths = (parse_ints(draft_lengths, "--draft-lengths", 1) if draft_lengths else
               [k for k in DEFAULT_DRAFT_LENGTHS if k <= most] or [most])
    if lengths[-1] > most:
        raise InputError(f"draft lengths go up to block_size - 1 = {most} for this drafter.", field="--draft-lengths")
    ids = prompt_token_ids(prompts, target_dir)
    check_request(ids, 1, pair.target_config["vocab_size"], max_tokens,
                  pair.target_config.get("max_position_embeddings"))  # before any model is loaded
    torch.set_num_threads(threads)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    target = GptOssTarget(load_hf_gpt_oss(target_dir, torch_device, torch_dtype))
    choose_expert_storage(target, "auto", 1, most + 1)  # as dflash-run's --expert-dtype auto
    drafter = load_drafter(drafter_dir, torch_device, torch_dtype)
    gemm = drafter_gemm_dtype("auto", torch_dtype, torch_device)
    runners = [InProcessRunner("ar", 0, ReferenceRuntime(target, None, inflight=True), max_tokens, max_batch)]
    runners += [InProcessRunner("dflash", k, ReferenceRuntime(target, DFlashProposer(drafter, target, k + 1,
                                                                                    matmul_dtype=gemm), inflight=True),
                                max_tokens, max_batch) for k in lengths]
    # dflash-sa (suffix-automaton drafts, else DFlash's) at the longest length, beside DFlash, with dflash-run's
    # default suffix drafts (up to 2 x that block - 1)
    hybrid = SuffixDFlashProposer(DFlashProposer(drafter, target, lengths[-1] + 1, matmul_dtype=gemm),
                                  DEFAULT_SA_THRESHOLD, max_suffix_drafts=default_sa_max_drafts(lengths[-1] + 1))
    runners.append(InProcessRunner(SUFFIX_HYBRID, lengths[-1], ReferenceRuntime(target, hybrid, inflight=True),
                                   max_tokens, max_batch))
    machine = machine_description(torch_device)
    info = {"title": f"{target_dir.name} + {drafter_dir.name} on {machine}, {max_tokens} tokens/request",
            "machine": machine, "device": str(torch_device),
            "measured_on": {"runner": "in-process", "device": machine, "threads": threads},
            "pair": {"target": str(target_dir), "drafter": str(drafter_dir), "block_size": most + 1},
            "dtype": str(torch_dtype).removeprefix("torch."),
            "drafter_gemm_dtype": str(gemm or torch_dtype).removeprefix("torch."),
            "expert_dtype": target.expert_storage}
    return runners, ids, lengths, info


def endpoint_runners(url, protocol, models, server_device, max_tokens, timeout):
    """(runners, description) for a running server; every model is checked before any load."""
    from trtllm_dflash.bench.endpoints import make_endpoint
    from trtllm_dflash.bench.sweep import EndpointRunner

    runners, named = [], parse_models(models or ("dflash",))
    for name, k in named:
        endpoint = make_endpoint(protocol, url, name, max_tokens, timeout)
        endpoint.check()
        runners.append(EndpointRunner("ar" if k == 0 else "dflash", k, endpoint))
    # machine/device as the in-process run records them (dflash-build --schedule-from checks them against
    # the profile's GPU); null when not given, so the build says the file does not tell where it was measured.
    device = None if not server_device else "cpu" if "cpu" in server_device.lower() else "cuda"
    info = {"title": f"{protocol} server {url} ({server_device or 'device not given'}), {max_tokens} tokens/request",
            "machine": server_device, "device": device,
            "measured_on": {"runner": "endpoint", "device": server_device, "url": url, "protocol": protocol,
                            "models": dict(named)}}
    return runners, info


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("engine_dir", required=False, type=click.Path(path_type=Path))
@click.option("--target", "target_dir", type=click.Path(path_type=Path), help="gpt-oss checkpoint directory.")
@click.option("--drafter", "drafter_dir", type=click.Path(path_type=Path), help="DFlash drafter directory.")
@click.option("--endpoint", help="A running server, http://HOST:PORT, instead of the in-process runtime.")
@click.option("--protocol", type=click.Choice(["triton", "openai"]), default="triton", show_default=True,
              help="triton: KServe generate_stream; openai: streaming /v1/completions.")
@click.option("--model", "models", multiple=True,
              help="Server model NAME[=DRAFT_LEN], repeatable (ar=0 is the baseline) [default: dflash].")
@click.option("--server-device", help="What the server runs on ('NVIDIA B200', 'cpu'), recorded for dflash-build.")
@click.option("--request-timeout", default=300.0, show_default=True, help="Seconds before a server request fails.")
@click.option("--prompts-file", type=click.Path(path_type=Path),
              help="Text lines or JSONL ('prompt' or 'prompt_token_ids'); default: the embedded held-out prompts.")
@click.option("--sharegpt", type=click.Path(path_type=Path), help="A ShareGPT conversation file (first human turns).")
@click.option("--synthetic-input-len", default=0, help="Synthetic prompts of this many random token ids.")
@click.option("--num-prompts", default=64, show_default=True, help="How many synthetic prompts.")
@click.option("--vocab-size", type=int, help="Token-id range of synthetic prompts sent to a server.")
@click.option("--concurrency", default=DEFAULT_CONCURRENCY, show_default=True, help="Closed-loop users per point.")
@click.option("--request-rate", default="", help="Open loop instead: Poisson requests/s per point, e.g. 2,4,8.")
@click.option("--requests", default=16, show_default=True,
              help="Requests per run (closed loop: at least this many, in full rounds of the users).")
@click.option("--duration", type=float, help="Seconds per run instead of a request count.")
@click.option("--draft-lengths", default="", help="Draft lengths to sweep in-process [default: 1,3,7 within the block].")
@click.option("--max-tokens", default=32, show_default=True, help="Output tokens per request (fixed length).")
@click.option("--max-batch", default=8, show_default=True, help="In-process open loop: most requests batched together.")
@click.option("--repeats", default=3, show_default=True, help="Runs per point, interleaved; medians and spread reported.")
@click.option("--threads", default=1, show_default=True, help="CPU threads for the in-process runtime (fixed).")
@click.option("--seed", default=0, show_default=True, help="Seeds Poisson arrivals, synthetic prompts, the bootstrap.")
@click.option("--schedule-source", type=click.Choice(["model", "measured"]), default="model", show_default=True,
              help="Choose each band's draft length from the fitted cost model or the raw measurements.")
@click.option("--output-dir", default="dflash_bench", show_default=True, type=click.Path(path_type=Path))
@click.option("--no-plot", is_flag=True, help="Skip pareto.png and latency_cdf.png (no matplotlib needed).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
              show_default=True, help="auto = float32 on CPU, bfloat16 on GPU.")
@clean_errors
def main(engine_dir, target_dir, drafter_dir, endpoint, protocol, models, server_device, request_timeout, prompts_file,
         sharegpt, synthetic_input_len, num_prompts, vocab_size, concurrency, request_rate, requests, duration,
         draft_lengths, max_tokens, max_batch, repeats, threads, seed, schedule_source, output_dir, no_plot, device,
         dtype):
    """Benchmark DFlash (and dflash-sa) vs AR in-process (ENGINE_DIR, --target/--drafter, the embedded pair) or on
    --endpoint."""
    from trtllm_dflash.bench.load import LoadShape, describe
    from trtllm_dflash.bench.points import CONCURRENCY, RATE
    from trtllm_dflash.bench.report import SCHEMA, analyse, print_summary, write_outputs
    from trtllm_dflash.bench.sweep import PartialSweep, run_sweep

    for name, value, least in (("--repeats", repeats, 1), ("--requests", requests, 1), ("--max-tokens", max_tokens, 1),
                               ("--threads", threads, 1), ("--max-batch", max_batch, 1),
                               ("--num-prompts", num_prompts, 1), ("--synthetic-input-len", synthetic_input_len, 0)):
        if value < least:
            raise InputError(f"expected at least {least}, got {value}.", field=name)
    if duration is not None and duration <= 0:
        raise InputError(f"expected a positive number of seconds, got {duration}.", field="--duration")
    if endpoint and (engine_dir or target_dir or drafter_dir or draft_lengths):
        raise InputError("--endpoint benchmarks a running server; ENGINE_DIR, --target/--drafter and "
                         "--draft-lengths are for the in-process runtime.", field="--endpoint")
    if models and not endpoint:
        raise InputError("--model names a model on a server; give --endpoint too.", field="--model")
    if not no_plot:
        from trtllm_dflash.bench.plots import require_matplotlib

        require_matplotlib()  # before any work: a missing matplotlib must not cost a finished sweep
    check_output_path(output_dir, "--output-dir", directory=True)
    if request_rate:
        shapes = [LoadShape(RATE, r, requests, duration, seed) for r in parse_rates(request_rate)]
    else:
        levels = parse_ints(concurrency, "--concurrency", 1)
        shapes = [LoadShape(CONCURRENCY, c, -(-requests // c) * c, duration, seed) for c in levels]

    if endpoint:
        prompts, prompt_source = load_prompts(prompts_file, sharegpt, synthetic_input_len, num_prompts, vocab_size,
                                              seed)
        runners, info = endpoint_runners(endpoint, protocol, models, server_device, max_tokens, request_timeout)
        lengths = [r.draft_len for r in runners if r.draft_len > 0]
    else:
        from trtllm_dflash.checkpoints.gpt_oss import read_target_config

        resolved = resolve_bench_pair(engine_dir, target_dir, drafter_dir)
        vocab = read_target_config(resolved[0])["vocab_size"] if synthetic_input_len else None
        prompts, prompt_source = load_prompts(prompts_file, sharegpt, synthetic_input_len, num_prompts, vocab, seed)
        runners, prompts, lengths, info = in_process_runners(*resolved, draft_lengths, prompts, max_tokens, max_batch,
                                                             device, dtype, threads)

    document = {"schema": SCHEMA, "title": info.pop("title"),
                "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "command": " ".join(["dflash-bench", *sys.argv[1:]]), **info,
                "prompts": {"source": prompt_source, **describe(prompts)},
                "settings": {"load": shapes[0].kind, "levels": [s.level for s in shapes], "requests": requests,
                             "duration_s": duration, "draft_lengths": lengths, "max_tokens": max_tokens,
                             "repeats": repeats, "threads": threads, "seed": seed, "max_batch": max_batch}}
    console = Console(stderr=True)
    try:
        with ProgressReport(console, len(runners) * len(shapes) * repeats) as progress:
            points = run_sweep(runners, prompts, shapes, repeats, progress)
    except PartialSweep as stopped:  # keep what was measured, then fail with the reason
        document.update(partial=True, error=str(stopped), points=[p.to_dict() for p in stopped.points])
        written = write_outputs(document, stopped.points, output_dir, plot=False)
        click.echo("partial results kept in " + ", ".join(str(p) for p in written), err=True)
        raise
    document["points"] = [p.to_dict() for p in points]
    document.update(analyse(points, max(lengths, default=0), schedule_source, seed))
    written = write_outputs(document, points, output_dir, plot=not no_plot)
    print_summary(document, points, Console(width=100))
    click.echo("wrote " + ", ".join(str(p) for p in written))
