"""dflash-build: validate a gpt-oss target + DFlash drafter and write a self-checking engine directory."""

from __future__ import annotations

from pathlib import Path

import click

from trtllm_dflash.errors import InputError

from .common import clean_errors


def embedded_pair() -> tuple[Path, Path]:
    """The pair shipped inside the package, once it is (trtllm_dflash.embedded.pair_paths)."""
    from trtllm_dflash import embedded

    pair_paths = getattr(embedded, "pair_paths", None)
    if pair_paths is None:
        raise InputError("the embedded target/drafter pair is not available in this version; pass --target DIR "
                         "and --drafter DIR.", field="--target")
    target, drafter = pair_paths()
    return Path(target), Path(drafter)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--target", "target_dir", type=click.Path(path_type=Path),
              help="gpt-oss checkpoint (HF layout). Default: the embedded pair.")
@click.option("--drafter", "drafter_dir", type=click.Path(path_type=Path),
              help="DFlash drafter (z-lab layout). Default: the embedded pair.")
@click.option("-o", "--output", "output_dir", type=click.Path(path_type=Path), required=True,
              help="Engine directory to write.")
@click.option("--profile", default="cpu-reference", show_default=True,
              help="Hardware profile name (build_configs/NAME.yaml) or a YAML file.")
@click.option("--quant", default="keep", show_default=True,
              help="Target weights: keep (byte-for-byte copy), none (bf16), fp8, nvfp4 or mxfp4.")
@click.option("--drafter-quant", default="keep", show_default=True, help="Drafter weights: same choices.")
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8"]), help="Default: the profile's.")
@click.option("--max-draft-len", type=click.IntRange(min=1), help="Drafts per step. Default: drafter block_size - 1.")
@click.option("--max-seq-len", type=click.IntRange(min=1), help="Default: the profile's.")
@click.option("--tp", type=click.IntRange(min=1), help="Tensor parallel size. Default: the profile's.")
@click.option("--ep", type=click.IntRange(min=1), help="MoE expert parallel size. Default: the profile's.")
@click.option("--triton-repo", type=click.Path(path_type=Path), help="Also write a Triton model repository here.")
@click.option("--check", is_flag=True, help="Validate only; write nothing.")
@click.option("--force", is_flag=True, help="Replace a non-empty output directory.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("--trt-drafter", is_flag=True,
              help="Also write drafter_trt/drafter.onnx (draft-block plugin nodes) and, where TensorRT and a GPU "
                   "are present, its TensorRT engine.")
@click.option("--schedule-from", type=click.Path(path_type=Path),
              help="A dflash-bench bench.json: write its load-aware draft_len_schedule into the options.")
@click.option("--input-amax", "input_amax_file", type=click.Path(path_type=Path),
              help="JSON of calibrated activation amax per weight name (input_scale of NVFP4 experts). "
                   "Default with --quant nvfp4: calibrate the target here (small models only).")
@click.option("--calibration-prompts", "calibration_prompts_file", type=click.Path(path_type=Path),
              help="Text or JSONL prompts to calibrate the target's static input scales on (--quant fp8 or "
                   "nvfp4). Default: a few built-in prompts where NVFP4 experts need the scales.")
@clean_errors
def main(target_dir, drafter_dir, output_dir, profile, quant, drafter_quant, kv_cache_dtype, max_draft_len,
         max_seq_len, tp, ep, triton_repo, check, force, quiet, trt_drafter, schedule_from, input_amax_file,
         calibration_prompts_file):
    """Build an engine directory: checkpoints, llm_api_options.yaml, a Triton repository and a
    manifest with the sha256 of every file. Interrupted builds resume where they stopped."""
    from trtllm_dflash.engine.build import BuildOptions, build_engine, plan_build

    if (target_dir is None) != (drafter_dir is None):
        raise InputError("give both --target and --drafter, or neither (the embedded pair).",
                         field="--drafter" if drafter_dir is None else "--target")
    if target_dir is None:
        target_dir, drafter_dir = embedded_pair()
    schedule = None
    if schedule_from is not None:
        from trtllm_dflash.bench.schedule import schedule_from_bench

        schedule = schedule_from_bench(schedule_from)
        if not schedule:
            click.echo(f"note: {schedule_from} found no load where speculation paid off; building with a fixed "
                       "draft length anyway.", err=True)
        if max_draft_len is not None and schedule:
            raise InputError("--max-draft-len and --schedule-from both set the draft length; give one.",
                             field="--max-draft-len")
    options = BuildOptions(target_dir, drafter_dir, output_dir, profile, quant, drafter_quant, kv_cache_dtype,
                           max_draft_len, max_seq_len, tp, ep, triton_repo, force, schedule, trt_drafter,
                           input_amax_file, schedule_file=schedule_from,
                           calibration_prompts_file=calibration_prompts_file)
    if check:
        plan = plan_build(options)
        for warning in plan.pair.warnings:
            click.echo(f"warning: {warning}", err=True)
        spec = plan.llm_options.speculative_config
        click.echo(f"ok: {target_dir} + {drafter_dir} fit; profile {plan.profile.name}, max_draft_len "
                   f"{spec.max_draft_len}, TP {plan.llm_options.tensor_parallel_size} (nothing written)")
        return
    result = build_engine(options, show_progress=not quiet, log=click.echo)
    engine = result.engine
    click.echo(f"engine: {engine.root} ({len(engine.manifest['files'])} files, built {', '.join(result.built) or '-'})")
    click.echo(f"serve:  cd {engine.root} && trtllm-serve ./target --extra_llm_api_options llm_api_options.yaml")
    if result.triton_repo is not None:
        click.echo(f"triton: tritonserver --model-repository {result.triton_repo}")
