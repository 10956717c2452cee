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


def detected_gpu() -> str | None:
    """The name of CUDA device 0, if this machine has one."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def choose_profile(profile: str | None, target_dir: Path | None) -> tuple[str, str | None]:
    """-> (profile, note to print). cpu-reference is the embedded pair's default; any other target
    needs --profile, or a detected GPU that a shipped profile is for (said in the output)."""
    from trtllm_dflash.engine.plan import DEFAULT_PROFILE
    from trtllm_dflash.engine.profiles import available_profiles, profile_for_gpu

    from trtllm_dflash import embedded

    if profile is not None:
        return profile, None
    if target_dir is None or target_dir.resolve() == embedded.TARGET_DIR.resolve():
        return DEFAULT_PROFILE, None
    gpu = detected_gpu()
    chosen = profile_for_gpu(gpu) if gpu else None
    if chosen:
        return chosen, f"profile: {chosen} (chosen for the detected {gpu}; pass --profile to choose another)"
    found = f"the detected {gpu} has no shipped profile" if gpu else "no GPU was detected"
    raise InputError(f"required for a target other than the embedded pair ({found}): a GPU profile sets TensorRT-LLM's "
                     "parallelism, CUDA graphs, MoE and attention backends and batch limits for that GPU. Choose one "
                     f"of {', '.join(available_profiles())} or pass a YAML file; --profile cpu-reference builds for "
                     "the reference runtime (one device, no CUDA graphs, batch 8).", field="--profile")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--target", "target_dir", type=click.Path(path_type=Path),
              help="gpt-oss checkpoint (HF layout). Default: the embedded pair.")
@click.option("--drafter", "drafter_dir", type=click.Path(path_type=Path),
              help="DFlash drafter (z-lab layout). Default: the embedded pair.")
@click.option("-o", "--output", "output_dir", type=click.Path(path_type=Path), required=True,
              help="Engine directory to write.")
@click.option("--profile",
              help="Hardware profile name (build_configs/NAME.yaml) or a YAML file. Required unless building the "
                   "embedded pair (cpu-reference) or a shipped profile matches the detected GPU.")
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
@click.option("--allow-foreign-schedule", is_flag=True,
              help="Use a --schedule-from bench measured on another device class than the profile's GPU.")
@click.option("--input-amax", "input_amax_file", type=click.Path(path_type=Path),
              help="JSON of calibrated activation amax per weight name (input_scale of NVFP4 experts). "
                   "Default with --quant nvfp4: calibrate the target here (small models only).")
@click.option("--calibration-prompts", "calibration_prompts_file", type=click.Path(path_type=Path),
              help="Text or JSONL prompts to calibrate the target's static input scales on (--quant fp8 or "
                   "nvfp4). Default: a few built-in prompts where NVFP4 experts need the scales.")
@click.option("--sa-threshold", type=click.IntRange(min=1),
              help="Suffix-match length for the reference runtime's dflash-sa drafting (stored in manifest.json; "
                   "TensorRT-LLM ignores it).")
@click.option("--sa-max-drafts", type=click.IntRange(min=1),
              help="The reference runtime's longest dflash-sa suffix draft, at least max_draft_len (stored in "
                   "manifest.json; TensorRT-LLM ignores it) [default at run time: 2 x (max_draft_len + 1) - 1].")
@clean_errors
def main(target_dir, drafter_dir, output_dir, profile, quant, drafter_quant, kv_cache_dtype, max_draft_len,
         max_seq_len, tp, ep, triton_repo, check, force, quiet, trt_drafter, schedule_from, allow_foreign_schedule,
         input_amax_file, calibration_prompts_file, sa_threshold, sa_max_drafts):
    """Build an engine directory: checkpoints, llm_api_options.yaml, a Triton repository and a
    manifest with the sha256 of every file. Interrupted builds resume where they stopped."""
    from trtllm_dflash.engine.build import build_engine
    from trtllm_dflash.engine.plan import BuildOptions, plan_build
    from trtllm_dflash.engine.trtllm_versions import describe, requirements

    if (target_dir is None) != (drafter_dir is None):
        raise InputError("give both --target and --drafter, or neither (the embedded pair).",
                         field="--drafter" if drafter_dir is None else "--target")
    profile, profile_note = choose_profile(profile, target_dir)
    if target_dir is None:
        target_dir, drafter_dir = embedded_pair()
    schedule = measured_on = None
    if schedule_from is not None:
        from trtllm_dflash.bench.schedule import measured_on as bench_measured_on
        from trtllm_dflash.bench.schedule import schedule_from_bench

        schedule, measured_on = schedule_from_bench(schedule_from), bench_measured_on(schedule_from)
        if not schedule:
            click.echo(f"note: {schedule_from} found no load where speculation paid off; building with a fixed "
                       "draft length anyway.", err=True)
        if max_draft_len is not None and schedule:
            raise InputError("--max-draft-len and --schedule-from both set the draft length; give one.",
                             field="--max-draft-len")
    options = BuildOptions(target_dir, drafter_dir, output_dir, profile, quant, drafter_quant, kv_cache_dtype,
                           max_draft_len, max_seq_len, tp, ep, triton_repo, force, schedule, trt_drafter,
                           input_amax_file, schedule_file=schedule_from,
                           calibration_prompts_file=calibration_prompts_file, schedule_measured_on=measured_on,
                           allow_foreign_schedule=allow_foreign_schedule, sa_threshold=sa_threshold,
                           sa_max_drafts=sa_max_drafts)
    if profile_note:
        click.echo(profile_note)
    if check:
        plan = plan_build(options)
        for warning in plan.pair.warnings:
            click.echo(f"warning: {warning}", err=True)
        spec = plan.llm_options.speculative_config
        click.echo(f"ok: {target_dir} + {drafter_dir} fit; profile {plan.profile.name}, max_draft_len "
                   f"{spec.max_draft_len}, TP {plan.llm_options.tensor_parallel_size} (nothing written)")
        click.echo(f"runs on: {describe(requirements(plan.llm_options, quant, drafter_quant))}")
        return
    result = build_engine(options, show_progress=not quiet, log=click.echo)
    engine = result.engine
    click.echo(f"engine: {engine.root} ({len(engine.manifest['files'])} files, built {', '.join(result.built) or '-'})")
    click.echo(f"runs on: {describe(engine.manifest['trtllm'])}")
    if not engine.manifest["trtllm"]["reference_only"]:
        click.echo(f"serve:  cd {engine.root} && trtllm-serve ./target --extra_llm_api_options llm_api_options.yaml")
    if result.triton_repo is not None:
        click.echo(f"triton: tritonserver --model-repository {result.triton_repo}")
