"""dflash-run: generate with the DFlash draft-verify loop and report acceptance and speed."""

from __future__ import annotations

import json
from pathlib import Path

import click

from trtllm_dflash.errors import InputError

from .common import clean_errors, resolve_device, resolve_dtype


def read_prompts_file(path: Path) -> list[str | list[int]]:
    """Plain text (one prompt per line) or JSONL objects with `prompt` (text) or `prompt_token_ids`."""
    if not path.is_file():
        raise InputError("file not found.", path=path)
    prompts: list[str | list[int]] = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            prompts.append(line)
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"line {number} is not valid JSON ({exc}).", path=path) from None
        if isinstance(record.get("prompt"), str):
            prompts.append(record["prompt"])
        elif isinstance(record.get("prompt_token_ids"), list):
            prompts.append([int(t) for t in record["prompt_token_ids"]])
        else:
            raise InputError(f"line {number} has neither a string 'prompt' nor a list 'prompt_token_ids'.",
                             path=path, field="prompt")
    if not prompts:
        raise InputError("no prompts in the file.", path=path)
    return prompts


def load_tokenizer(target_dir: Path):
    from transformers import AutoTokenizer

    if not any((target_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise InputError("no tokenizer (tokenizer.json) next to the target; text prompts need one "
                         "(or give token ids with a JSONL 'prompt_token_ids' field).", path=target_dir,
                         field="tokenizer.json")
    return AutoTokenizer.from_pretrained(target_dir)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--target", "target_dir", type=click.Path(path_type=Path), required=True,
              help="gpt-oss checkpoint directory (HF layout, MXFP4 or plain experts).")
@click.option("--drafter", "drafter_dir", type=click.Path(path_type=Path), required=True,
              help="DFlash drafter directory (z-lab layout).")
@click.option("--prompt", "prompt_texts", multiple=True, help="Prompt text (repeatable).")
@click.option("--prompts-file", type=click.Path(path_type=Path), help="Text lines or JSONL with a 'prompt' field.")
@click.option("--max-tokens", default=64, show_default=True, help="Tokens to generate per prompt.")
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--top-k", default=0, show_default=True, help="0 = off.")
@click.option("--seed", default=0, show_default=True)
@click.option("--batch-size", default=1, show_default=True, help="Requests decoded together.")
@click.option("--block-size", type=int, help="Verify block (anchor + drafts); at most the drafter's.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
              show_default=True, help="auto = float32 on CPU, bfloat16 on GPU.")
@click.option("--baseline", is_flag=True, help="Also run autoregressive decoding and compare.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per prompt on stdout.")
@clean_errors
def main(target_dir, drafter_dir, prompt_texts, prompts_file, max_tokens, temperature, top_p, top_k, seed,
         batch_size, block_size, device, dtype, baseline, as_json):
    """Run the DFlash draft-verify loop on prompts and report acceptance and speed."""
    from trtllm_dflash.checkpoints.gpt_oss import load_hf_gpt_oss, stop_token_ids
    from trtllm_dflash.checkpoints.validate import validate_pair
    from trtllm_dflash.models.drafter import load_drafter
    from trtllm_dflash.models.target import GptOssTarget
    from trtllm_dflash.runtime.proposers import DFlashProposer
    from trtllm_dflash.runtime.reference import ReferenceRuntime
    from trtllm_dflash.runtime.sampling import SamplingParams

    pair = validate_pair(target_dir, drafter_dir, block_size)
    prompts: list[str | list[int]] = list(prompt_texts) + (read_prompts_file(prompts_file) if prompts_file else [])
    if not prompts:
        raise InputError("no prompts given; use --prompt TEXT or --prompts-file FILE.", field="--prompt")
    tokenizer = load_tokenizer(target_dir) if any(isinstance(p, str) for p in prompts) else None
    prompt_ids = [tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            stop_token_ids=tuple(stop_token_ids(target_dir, pair.target_config)))

    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    target = GptOssTarget(load_hf_gpt_oss(target_dir, torch_device, torch_dtype))
    drafter = load_drafter(drafter_dir, torch_device, torch_dtype)
    runtimes = [ReferenceRuntime(target, DFlashProposer(drafter, target, block_size))]
    if baseline:
        runtimes.append(ReferenceRuntime(target, None))
    for runtime in runtimes:
        runtime.warm_up(prompt_ids[0])
    results, *rest = [runtime.generate(prompt_ids, params, batch_size) for runtime in runtimes]
    baselines = rest[0] if rest else None

    decode = (lambda ids: tokenizer.decode(ids)) if tokenizer is not None else (lambda ids: None)
    records = []
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        stats = result.stats
        record = {
            "prompt": prompt if isinstance(prompt, str) else None,
            "prompt_token_ids": result.prompt_token_ids,
            "output_token_ids": result.output_token_ids,
            "text": decode(result.output_token_ids),
            "finish_reason": result.finish_reason,
            "num_output_tokens": len(result.output_token_ids),
            **{k: v for k, v in stats.to_dict().items() if k != "num_output_tokens"},
        }
        if baselines is not None:
            base = baselines[i]
            record["baseline_output_token_ids"] = base.output_token_ids
            record["baseline_decode_tokens_per_s"] = base.stats.decode_tokens_per_s
            record["speedup"] = (stats.decode_tokens_per_s / base.stats.decode_tokens_per_s
                                 if base.stats.decode_tokens_per_s else None)
            record["matches_baseline"] = base.output_token_ids == result.output_token_ids
        records.append(record)

    if as_json:
        for record in records:
            click.echo(json.dumps(record))
    else:
        from trtllm_dflash.runtime.report import print_report

        print_report(records, results, baselines, device=str(torch_device), batch_size=batch_size)
