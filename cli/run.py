"""dflash-run: generate with the DFlash draft-verify loop and report acceptance and speed."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NamedTuple

import click
import torch

from trtllm_dflash.checkpoints.publish import check_output_path
from trtllm_dflash.errors import InputError
from trtllm_dflash.models.linear import DRAFTER_GEMM_DTYPES, drafter_gemm_dtype
from trtllm_dflash.prompts import encode_prompts, load_tokenizer, read_prompts_file
from trtllm_dflash.runtime.interface import DRAFT_METHODS, default_draft_length
from trtllm_dflash.runtime.tuning import EXPERT_DTYPES

from .common import EXIT_INTERRUPTED, clean_errors, resolve_device, resolve_dtype


def resolve_pair(engine_dir: Path | None, target_dir: Path | None, drafter_dir: Path | None, verify: bool):
    """(target, drafter, engine or None) from ENGINE_DIR, --target/--drafter, or the embedded default
    (built once into the user cache as an engine, then reused)."""
    from trtllm_dflash.engine.manifest import open_engine

    if engine_dir is not None:
        if target_dir or drafter_dir:
            raise InputError("give either ENGINE_DIR or --target/--drafter, not both.", field="ENGINE_DIR")
        engine = open_engine(engine_dir, verify_checksums=verify)
        return engine.target_dir, engine.drafter_dir, engine
    if target_dir and drafter_dir:
        return target_dir, drafter_dir, None
    if target_dir or drafter_dir:
        raise InputError("--target and --drafter go together.", field="--drafter" if target_dir else "--target")
    from trtllm_dflash.engine.build import default_engine

    engine = default_engine(log=lambda message: click.echo(message, err=True))
    return engine.target_dir, engine.drafter_dir, engine


class StreamPrinter:
    """Prints committed text as it arrives, in prompt order: the lowest unprinted request streams
    live, later ones are buffered until the batch returns."""

    def __init__(self, tokenizer, prompts: list[str | list[int]]):
        self.tokenizer, self.prompts = tokenizer, prompts
        self.tokens: dict[int, list[int]] = {}
        self.shown: dict[int, str] = {}
        self.live = 0

    def text(self, request: int) -> str:
        ids = self.tokens.get(request, [])
        return self.tokenizer.decode(ids) if self.tokenizer is not None else " ".join(map(str, ids)) + " "

    def header(self, request: int) -> None:
        prompt = self.prompts[request]
        click.echo(click.style(f"\n--- prompt {request} ---\n", bold=True) + (prompt if isinstance(prompt, str) else ""))

    def on_tokens(self, request: int, tokens: list[int]) -> None:
        self.tokens.setdefault(request, []).extend(tokens)
        if request == self.live:
            if request not in self.shown:
                self.header(request)
                self.shown[request] = ""
            self.flush(request, final=False)

    def flush(self, request: int, final: bool) -> None:
        text = self.text(request)
        if not final and text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its bytes
            return
        click.echo(text[len(self.shown.get(request, "")):], nl=False)
        sys.stdout.flush()
        self.shown[request] = text

    def finish_through(self, last_request: int) -> None:
        """Everything up to `last_request` is done: print what was buffered, move the live cursor."""
        while self.live <= last_request:
            if self.live not in self.shown:
                self.header(self.live)
            self.flush(self.live, final=True)
            click.echo()
            self.live += 1


def json_record(prompt, runs, tokenizer, base_runs=None) -> dict:
    """One prompt: outputs and counts of its first run; with a baseline, speeds over every repeat."""
    from trtllm_dflash.runtime.report import speed_record

    result = runs[0]
    stats = result.stats
    record = {
        "prompt": prompt if isinstance(prompt, str) else None,
        "prompt_token_ids": result.prompt_token_ids,
        "output_token_ids": result.output_token_ids,
        "text": tokenizer.decode(result.output_token_ids) if tokenizer is not None else None,
        "finish_reason": result.finish_reason,
        "num_output_tokens": len(result.output_token_ids),
        **{k: v for k, v in stats.to_dict().items() if k != "num_output_tokens"},
    }
    if base_runs is not None:
        record["baseline_output_token_ids"] = base_runs[0].output_token_ids
        record.update(speed_record(runs, base_runs))
        record["matches_baseline"] = base_runs[0].output_token_ids == result.output_token_ids
    return record


def check_engine_seq_len(engine, prompt_ids: list[list[int]], max_tokens: int) -> None:
    """TensorRT-LLM serves at most the engine's max_seq_len tokens per request (prompt + output);
    the reference runtime keeps to it too, so a run means the same on both."""
    limit = engine.llm_api_options().max_seq_len
    longest = max(len(ids) for ids in prompt_ids)
    if longest + max_tokens > limit:
        raise InputError(f"the longest prompt ({longest} tokens) plus --max-tokens {max_tokens} exceeds the engine's "
                         f"max_seq_len {limit} ({engine.options_path}); lower --max-tokens or rebuild with a larger "
                         "--max-seq-len.", field="--max-tokens")


def write_text(path: Path, text: str) -> None:
    """Write a result file; a failure (full disk, /dev/full) names the file."""
    try:
        path.write_text(text)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None


class DraftMethod(NamedTuple):
    method: str
    sa_threshold: int | None = None  # dflash-sa only
    sa_max_drafts: int | None = None  # dflash-sa only: the longest suffix draft


def resolve_draft_method(draft_method: str | None, sa_threshold: int | None, sa_max_drafts: int | None,
                         backend: str, engine, drafter_block: int, block_size: int | None) -> DraftMethod:
    """The method and its suffix settings. Default: dflash-sa on the reference runtime (the fastest there,
    docs/benchmarks.md), DFlash on TensorRT-LLM (which has no suffix drafting). dflash-sa's suffix drafts
    run up to the engine's `sa_max_drafts`, else `default_sa_max_drafts` of the verify block (`block_size`:
    --block-size or the engine's max_draft_len + 1; else the drafter's block)."""
    from trtllm_dflash.runtime.proposers import DEFAULT_SA_THRESHOLD, check_max_suffix_drafts, default_sa_max_drafts

    if backend == "trtllm":
        if draft_method in ("ngram", "dflash-sa") or sa_threshold is not None or sa_max_drafts is not None:
            raise InputError("--draft-method ngram / dflash-sa, --sa-threshold and --sa-max-drafts run on the "
                             "reference backend only; the trtllm backend runs DFlash.", field="--backend")
        return DraftMethod("dflash")
    method = draft_method or "dflash-sa"
    if method != "dflash-sa":
        return DraftMethod(method)
    threshold = sa_threshold or (engine.sa_threshold if engine is not None else None) or DEFAULT_SA_THRESHOLD
    verify_block = block_size or drafter_block
    check_max_suffix_drafts(sa_max_drafts, verify_block - 1, "the verify block's drafts", "--sa-max-drafts")
    longest = (sa_max_drafts or (engine.sa_max_drafts if engine is not None else None)
               or default_sa_max_drafts(verify_block))
    return DraftMethod(method, threshold, longest)


def resolve_draft_length(draft_length: str | None, method: str, backend: str) -> str:
    """-> "fixed" or "adaptive". Default: `default_draft_length` on the reference runtime, fixed on TensorRT-LLM
    (which sizes drafts by the engine's draft_len_schedule)."""
    if draft_length == "adaptive" and backend == "trtllm":
        raise InputError("--draft-length adaptive runs on the reference backend only (TensorRT-LLM sizes drafts by "
                         "the engine's draft_len_schedule).", field="--draft-length")
    if draft_length == "adaptive" and method == "ngram":
        raise InputError("sizes the drafts of dflash and dflash-sa from the drafter's measured step costs; "
                         "it means nothing with --draft-method ngram.", field="--draft-length")
    if backend == "trtllm":
        return "fixed"
    return draft_length or default_draft_length(method)


def check_drafter_gemm(drafter_gemm: str | None, method: str, backend: str) -> None:
    """An explicit --drafter-gemm-dtype needs our drafter: the reference backend, dflash or dflash-sa."""
    if drafter_gemm is None:
        return
    if backend == "trtllm":
        raise InputError("sets the reference runtime's drafter GEMMs; TensorRT-LLM runs the drafter in the engine's "
                         "dtype.", field="--drafter-gemm-dtype")
    if method == "ngram":
        raise InputError("n-gram drafting runs no drafter.", field="--drafter-gemm-dtype")


def adaptive_policy(target, drafter, block_size: int | None, batch_size: int, matmul_dtype: torch.dtype | None,
                    suffix_most: int | None = None):
    """The adaptive draft-length policy, from step costs measured here at this batch size (suffix drafts up
    to `suffix_most`, default the block's)."""
    import time

    from trtllm_dflash.runtime.draft_length import adaptive_draft_length, format_costs, measure_step_costs
    from trtllm_dflash.runtime.proposers import DFlashProposer

    most = (block_size or drafter.config.block_size) - 1
    start = time.perf_counter()
    costs = measure_step_costs(target, lambda: DFlashProposer(drafter, target, block_size, matmul_dtype=matmul_dtype),
                               batch_size, most, suffix_most=suffix_most)
    click.echo(f"adaptive draft length: step costs at batch {batch_size} measured in "
               f"{time.perf_counter() - start:.1f} s (ms, K = 0, 1, ...): {format_costs(costs)}", err=True)
    return adaptive_draft_length(costs)


def check_expert_dtype(expert_dtype: str | None, backend: str) -> None:
    if expert_dtype is not None and backend == "trtllm":
        raise InputError("sets how the reference runtime reads the target's experts; TensorRT-LLM runs the engine's "
                         "own MoE kernels.", field="--expert-dtype")


def check_batching(batching: str, backend: str) -> None:
    if batching == "inflight" and backend == "trtllm":
        raise InputError("sets the reference runtime's batching; TensorRT-LLM's executor batches in flight itself.",
                         field="--batching")


def expert_storage(target, choice: str, batch_size: int, block: int) -> str:
    """Choose the target's expert storage (`choose_expert_storage`), say what was measured, return its name."""
    from trtllm_dflash.runtime.tuning import choose_expert_storage, expert_storage_note

    relative = choose_expert_storage(target, choice, batch_size, block)
    if relative is not None:
        click.echo(expert_storage_note(target, relative, batch_size, block), err=True)
    return target.expert_storage


class RuntimeSetup(NamedTuple):
    runtimes: list  # [main] or [main, autoregressive baseline]
    drafter_gemm_dtype: torch.dtype | None  # None without a drafter
    expert_dtype: str | None  # what the reference runtime's MoE reads; None on TensorRT-LLM
    drafter_cpu_kernels: bool | None  # whether the drafter runs the compiled CPU kernels; None without a drafter
    target_cpu_kernels: list[str] | None  # the target's parts on compiled CPU kernels; None on TensorRT-LLM


def build_runtime(backend: str, engine_root: Path | None, target_dir: Path, drafter_dir: Path, draft: DraftMethod,
                  block_size: int | None, schedule: dict[int, int] | None, device: str,
                  dtype: str, with_baseline: bool, draft_length: str = "fixed", batch_size: int = 1,
                  drafter_gemm: str = "auto", expert_dtype: str = "auto", inflight: bool = False) -> RuntimeSetup:
    """The runtime(s) for this run and how they run."""
    if backend == "trtllm":
        if engine_root is None:
            raise InputError("the TensorRT-LLM backend runs engine directories; build one with dflash-build "
                             "and pass it as ENGINE_DIR.", field="--backend")
        if with_baseline:
            raise InputError("--baseline runs on the reference backend only.", field="--backend")
        from trtllm_dflash.runtime.trtllm import TrtllmRuntime

        runtime = TrtllmRuntime(engine_root)
        for warning in runtime.warnings:
            click.echo(f"note: {warning}", err=True)
        return RuntimeSetup([runtime], None, None, None, None)
    from trtllm_dflash.checkpoints.gpt_oss import load_hf_gpt_oss
    from trtllm_dflash.models.drafter import load_drafter
    from trtllm_dflash.models.drafter_config import DFlashConfig
    from trtllm_dflash.models.target import GptOssTarget
    from trtllm_dflash.runtime.proposers import DFlashProposer, NGramProposer, SuffixDFlashProposer
    from trtllm_dflash.runtime.reference import ReferenceRuntime

    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    target = GptOssTarget(load_hf_gpt_oss(target_dir, torch_device, torch_dtype))
    width = block_size or DFlashConfig.from_json(drafter_dir / "config.json").block_size
    experts = expert_storage(target, expert_dtype, batch_size, width)  # before the adaptive policy times steps
    if draft.method == "ngram":
        proposer, gemm_dtype, cpu_kernels = NGramProposer(num_drafts=width - 1), None, None
    else:
        hybrid = draft.method == "dflash-sa"
        drafter = load_drafter(drafter_dir, torch_device, torch_dtype)
        matmul_dtype = drafter_gemm_dtype(drafter_gemm, torch_dtype, torch_device)
        gemm_dtype, cpu_kernels = matmul_dtype or torch_dtype, drafter.uses_cpu_kernels()
        policy = (adaptive_policy(target, drafter, block_size, batch_size, matmul_dtype, draft.sa_max_drafts)
                  if draft_length == "adaptive" else None)
        dflash = DFlashProposer(drafter, target, block_size, matmul_dtype=matmul_dtype,
                                policy=None if hybrid else policy)
        proposer = (SuffixDFlashProposer(dflash, draft.sa_threshold, policy=policy,
                                         max_suffix_drafts=draft.sa_max_drafts) if hybrid else dflash)
    runtimes = [ReferenceRuntime(target, proposer, draft_len_schedule=schedule, inflight=inflight)]
    if with_baseline:
        runtimes.append(ReferenceRuntime(target, None, inflight=inflight))
    return RuntimeSetup(runtimes, gemm_dtype, experts, cpu_kernels, target.compiled_parts())


def run_interleaved(runtimes, prompt_ids, params, batch_size: int, repeats: int, stream: StreamPrinter | None):
    """Per batch of prompts, `repeats` times: the speculative runtime, then the baseline (if any), so
    machine drift hits both alike; in flight (`ReferenceRuntime.inflight`) the batch is every prompt, `batch_size` of
    them decoding at a time. Only the first speculative run streams.
    -> (speculative runs, baseline runs or None, interrupted); each run lists every prompt's result
    (after Ctrl-C the first run holds what finished and the partial batch)."""
    from trtllm_dflash.runtime.stats import GenerationInterrupted

    spec_runs = [[] for _ in range(repeats)]
    base_runs = [[] for _ in range(repeats)] if len(runtimes) > 1 else None
    streaming = False
    stride = len(prompt_ids) if getattr(runtimes[0], "inflight", False) else batch_size
    try:
        for first in range(0, len(prompt_ids), stride):
            chunk = prompt_ids[first: first + stride]
            for repeat in range(repeats):
                streaming = repeat == 0
                on_tokens = (None if stream is None or not streaming else
                             (lambda r, toks, base=first: stream.on_tokens(base + r, toks)))
                spec_runs[repeat] += runtimes[0].generate(chunk, params, batch_size, on_tokens)
                if streaming and stream is not None:
                    stream.finish_through(len(spec_runs[0]) - 1)
                streaming = False
                if base_runs is not None:
                    base_runs[repeat] += runtimes[1].generate(chunk, params, batch_size)
    except GenerationInterrupted as stop:
        if streaming:
            spec_runs[0] += stop.results
        return spec_runs, base_runs, True
    except KeyboardInterrupt:
        return spec_runs, base_runs, True
    finally:
        for runtime in runtimes:
            if hasattr(runtime, "close"):  # TensorRT-LLM holds GPU workers until shut down
                runtime.close()
    return spec_runs, base_runs, False


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("engine_dir", required=False, type=click.Path(path_type=Path))
@click.option("--target", "target_dir", type=click.Path(path_type=Path),
              help="gpt-oss checkpoint directory (HF layout, MXFP4 or plain experts).")
@click.option("--drafter", "drafter_dir", type=click.Path(path_type=Path),
              help="DFlash drafter directory (z-lab layout).")
@click.option("--prompt", "prompt_texts", multiple=True, help="Prompt text (repeatable).")
@click.option("--prompts-file", type=click.Path(path_type=Path), help="Text lines or JSONL with a 'prompt' field.")
@click.option("--chat", is_flag=True, help="Wrap text prompts in the target tokenizer's chat template.")
@click.option("--max-tokens", default=128, show_default=True, help="Tokens to generate per prompt.")
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--top-k", default=0, show_default=True, help="0 = off.")
@click.option("--seed", default=0, show_default=True)
@click.option("--batch-size", default=1, show_default=True, type=click.IntRange(min=1),
              help="Requests decoded together.")
@click.option("--batching", type=click.Choice(["static", "inflight"]), default="static", show_default=True,
              help="static: each batch of --batch-size prompts runs until its slowest request ends (with --baseline, "
                   "each batch's repeats interleave); inflight: a finished request's row goes to the next prompt at "
                   "the next step (more tokens/s where requests end at different steps, as speculative ones do; with "
                   "--baseline each repeat runs every prompt, speculative then autoregressive; later prompts' texts "
                   "print when the run ends). Reference backend only.")
@click.option("--block-size", type=int, help="Verify block (anchor + drafts); at most the drafter's.")
@click.option("--draft-method", type=click.Choice(DRAFT_METHODS),
              help="dflash-sa = DFlash plus suffix-automaton drafts where the text repeats itself (the reference "
                   "runtime's default); dflash = the drafter alone (the trtllm backend's); ngram = prompt lookup, "
                   "the draft-model-free baseline.")
@click.option("--sa-threshold", type=click.IntRange(min=1),
              help="dflash-sa: take suffix drafts when the longest earlier-occurring suffix has at least this many "
                   "tokens [default: the engine's, else 2].")
@click.option("--sa-max-drafts", type=click.IntRange(min=1),
              help="dflash-sa: the most drafts a suffix match proposes, at least the block's; suffix drafts are not "
                   "bound to the drafter's block (a step that runs the drafter verifies at most its block) [default: "
                   "the engine's (dflash-build --sa-max-drafts), else 2 x the verify block - 1: 15 for the "
                   "embedded pair's block of 8].")
@click.option("--draft-length", type=click.Choice(["adaptive", "fixed"]),
              help="adaptive: per step, the number of drafts (0 = an autoregressive step) that maximises expected tokens "
                   "per second of step, from step costs measured at start-up (seconds) and the acceptance seen so far; a "
                   "drafter step drafts the whole block and verifies as many drafts as their confidences pay for; "
                   "fixed: always the block's [default: adaptive for dflash / dflash-sa on the reference backend, else "
                   "fixed].")
@click.option("--drafter-gemm-dtype", "drafter_gemm", type=click.Choice(DRAFTER_GEMM_DTYPES),
              help="dtype of the drafter step's GEMMs (weights and inputs; norms, attention and the residual stream "
                   "keep --dtype). On a CPU with AVX2 (int8: AVX512-VNNI's or our vpmaddubsw kernel) / AVX512-BF16 or "
                   "AVX2 (bfloat16) they are our compiled GEMM at every size (int8: inputs per row and weights per "
                   "column quantized symmetrically, int32 sums; CPU only); elsewhere a narrower dtype serves only the GEMMs where it pays (README); float16 on "
                   "CPU is fbgemm's GEMM on float16 weights with float32 inputs. Drafts need not be exact: the target "
                   "verifies them. auto, for a float32 drafter: int8 where our int8 GEMM runs (AVX512-VNNI or AVX2), "
                   "else bfloat16 where bf16 GEMMs are native (CUDA, a CPU with AVX512-BF16), else "
                   "float16 where fbgemm runs (x86 CPUs), else --dtype [default: auto; reference backend, dflash and "
                   "dflash-sa only].")
@click.option("--expert-dtype", type=click.Choice(EXPERT_DTYPES),
              help="How the reference runtime's MoE reads the target's experts: as --dtype, or (CPU, float32 experts "
                   "that bf16 holds exactly, as MXFP4 checkpoints' are) from bf16 copies cast back per GEMM (the same "
                   "numbers), from int8 copies times a power of two per input row (MXFP4 experts whose block scales "
                   "lie within a few octaves along a row, as the embedded target's: the same numbers, half bf16's "
                   "bytes), from float16 copies for fbgemm's GEMM, float32 math (x86; the same to float32 rounding) "
                   "or from the bf16 values as AMX tiles, each input split into three bf16 parts (Intel CPUs with "
                   "AMX; the same to float32 rounding). "
                   "auto: the fastest, timed at start-up (it depends on the machine) [default: auto; reference backend "
                   "only].")
@click.option("--backend", type=click.Choice(["auto", "trtllm", "reference"]), default="auto", show_default=True)
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N (reference backend).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
              show_default=True, help="auto = float32 on CPU, bfloat16 on GPU.")
@click.option("--baseline", is_flag=True, help="Also run autoregressive decoding and compare.")
@click.option("--repeats", type=click.IntRange(min=1),
              help="With --baseline: runs of each batch, speculative and autoregressive interleaved; speed-ups are "
                   "medians [default: 3].")
@click.option("--threads", type=click.IntRange(min=1), help="torch intra-op threads [default: torch's].")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per prompt on stdout.")
@click.option("--output", type=click.Path(path_type=Path), help="Also write the JSON records to this JSONL file.")
@click.option("--stats-file", type=click.Path(path_type=Path), help="Per-step records (JSONL) for analysis.")
@click.option("--no-stream", is_flag=True, help="Print texts at the end instead of as they are committed.")
@click.option("--verify", is_flag=True, help="Check every file of ENGINE_DIR against its sha256 first.")
@clean_errors
def main(engine_dir, target_dir, drafter_dir, prompt_texts, prompts_file, chat, max_tokens, temperature, top_p,
         top_k, seed, batch_size, batching, block_size, draft_method, sa_threshold, sa_max_drafts, draft_length,
         drafter_gemm, expert_dtype, backend, device, dtype, baseline, repeats, threads, as_json, output, stats_file,
         no_stream, verify):
    """Run the DFlash draft-verify loop on ENGINE_DIR (or --target/--drafter, or the embedded default)."""
    from trtllm_dflash.checkpoints.gpt_oss import stop_token_ids
    from trtllm_dflash.checkpoints.validate import validate_pair
    from trtllm_dflash.runtime.interface import check_request, choose_backend
    from trtllm_dflash.runtime.sampling import SamplingParams

    for path, option in ((output, "--output"), (stats_file, "--stats-file")):
        if path is not None:  # before the run, not after it
            check_output_path(path, option, directory=False)
    for value, option, what in ((sa_threshold, "--sa-threshold", "the suffix-match length"),
                                (sa_max_drafts, "--sa-max-drafts", "the longest suffix draft")):
        if value is not None and draft_method not in (None, "dflash-sa"):
            raise InputError(f"sets {what} of --draft-method dflash-sa; it means nothing with "
                             f"--draft-method {draft_method}.", field=option)
    if repeats is not None and not baseline:
        raise InputError("repeats the comparison with autoregressive decoding; add --baseline.", field="--repeats")
    repeats = repeats or (3 if baseline else 1)
    if threads is not None:
        torch.set_num_threads(threads)
    given_target = target_dir
    target_dir, drafter_dir, engine = resolve_pair(engine_dir, target_dir, drafter_dir, verify)
    pair = validate_pair(target_dir, drafter_dir, block_size)
    schedule = None
    if engine is not None:
        from trtllm_dflash.engine.load import engine_speculation

        engine_block, schedule = engine_speculation(engine)
        block_size = block_size or engine_block
    prompts: list[str | list[int]] = list(prompt_texts) + (read_prompts_file(prompts_file) if prompts_file else [])
    if not prompts:  # any pair runs on the held-out prompts, as the embedded default does (it never trained on them)
        from trtllm_dflash.embedded import heldout_prompts

        prompts = heldout_prompts()
        if engine_dir or given_target:
            click.echo(f"no --prompt or --prompts-file: running the {len(prompts)} embedded held-out prompts", err=True)
    needs_text = chat or any(isinstance(p, str) for p in prompts)
    tokenizer = load_tokenizer(target_dir) if needs_text or (target_dir / "tokenizer.json").is_file() else None
    prompt_ids = encode_prompts(prompts, tokenizer, chat, target_dir)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            stop_token_ids=tuple(stop_token_ids(target_dir, pair.target_config)))
    check_request(prompt_ids, batch_size, pair.target_config["vocab_size"], max_tokens,
                  pair.target_config.get("max_position_embeddings"))  # before any model is loaded
    if engine is not None:
        check_engine_seq_len(engine, prompt_ids, max_tokens)

    if engine is not None:
        from trtllm_dflash.engine.load import engine_backend

        chosen, reason = engine_backend(engine, backend)
    else:
        chosen, reason = choose_backend(backend)
    click.echo(f"backend: {chosen} ({reason})", err=True)
    draft = resolve_draft_method(draft_method, sa_threshold, sa_max_drafts, chosen, engine,
                                 pair.drafter_config.block_size, block_size)
    method = draft.method
    draft_length = resolve_draft_length(draft_length, method, chosen)
    check_drafter_gemm(drafter_gemm, method, chosen)
    check_expert_dtype(expert_dtype, chosen)
    check_batching(batching, chosen)
    setup = build_runtime(chosen, engine.root if engine else None, target_dir, drafter_dir, draft,
                          block_size, schedule, device, dtype, baseline, draft_length, batch_size,
                          drafter_gemm or "auto", expert_dtype or "auto", batching == "inflight")
    runtimes, gemm_dtype = setup.runtimes, setup.drafter_gemm_dtype
    for runtime in runtimes:
        if hasattr(runtime, "warm_up"):
            runtime.warm_up(prompt_ids[0])

    stream = None if (as_json or no_stream) else StreamPrinter(tokenizer, prompts)
    spec_runs, base_runs, interrupted = run_interleaved(runtimes, prompt_ids, params, batch_size, repeats, stream)
    results = spec_runs[0]
    if interrupted and not results:  # Ctrl-C between the loop's start and the first request's prefill, or as the
        click.echo("\ninterrupted before any request was decoded", err=True)  # first batch returned (CI, round 32)
        sys.exit(EXIT_INTERRUPTED)
    if interrupted:
        click.echo("\ninterrupted: statistics so far", err=True)
        spec_runs, base_runs = [results], None

    from trtllm_dflash.runtime.report import print_report, spread_warning, summary_record

    records = [json_record(p, [run[i] for run in spec_runs], tokenizer,
                           None if base_runs is None else [run[i] for run in base_runs])
               for i, p in enumerate(prompts[: len(results)])]
    summary = summary_record(results, spec_runs, base_runs, batch_size, method=method, sa_threshold=draft.sa_threshold,
                             sa_max_drafts=draft.sa_max_drafts,
                             draft_length=draft_length,
                             drafter_gemm_dtype=None if gemm_dtype is None else str(gemm_dtype).removeprefix("torch."),
                             expert_dtype=setup.expert_dtype, drafter_cpu_kernels=setup.drafter_cpu_kernels,
                             target_cpu_kernels=setup.target_cpu_kernels,
                             backend=chosen, batching=batching, threads=torch.get_num_threads(),
                             repeats=repeats)
    if as_json:
        for record in [*records, summary]:
            click.echo(json.dumps(record))
    if output:
        write_text(output, "".join(json.dumps(record) + "\n" for record in [*records, summary]))
    if stats_file:
        write_text(stats_file, "".join(
            json.dumps({"request": i, "step": step, "accepted": a}) + "\n"
            for i, result in enumerate(results) for step, a in enumerate(result.stats.accepted_per_step)))
    if not as_json and results:
        print_report(records, summary, results, batch_size=batch_size, texts_already_shown=stream is not None)
    if (warning := spread_warning(summary)) is not None:
        click.echo(warning, err=True)
    if interrupted:
        sys.exit(EXIT_INTERRUPTED)
