"""Planning an engine build: every check on the inputs, and what the build will write, with no writes.

`plan_build` validates the options, the pair, the profile and the TensorRT-LLM options rendered from
them, and returns a `BuildPlan`; `build.build_engine` then stages and publishes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..checkpoints.hf import read_json
from ..checkpoints.publish import check_output_path
from ..checkpoints.validate import Pair, validate_pair
from ..errors import InputError
from ..quant.recipes import RECIPES
from . import checks
from .manifest import DRAFTER
from .options import DFlashDecodingConfig, LlmApiOptions, validated
from .profiles import Profile, load_profile, profile_path

KEEP = "keep"  # copy the checkpoint byte for byte (gpt-oss: native MXFP4 experts)
QUANT_CHOICES = (KEEP, *RECIPES)
KV_CACHE_DTYPES = ("auto", "fp8")
DEFAULT_PROFILE = "cpu-reference"


@dataclass(frozen=True)
class BuildOptions:
    target_dir: Path
    drafter_dir: Path
    output_dir: Path
    profile: str | Path = DEFAULT_PROFILE
    quant: str = KEEP
    drafter_quant: str = KEEP
    kv_cache_dtype: str | None = None  # None: the profile's
    max_draft_len: int | None = None  # None: the profile's, else drafter block_size - 1
    max_seq_len: int | None = None
    tp: int | None = None
    ep: int | None = None
    triton_repo: Path | None = None
    force: bool = False
    draft_len_schedule: dict[int, int] | None = None  # from `dflash-bench` (`--schedule-from`)
    trt_drafter: bool = False  # also write drafter_trt/ (ONNX with plugin nodes; engine where possible)
    # JSON {logical weight name: activation amax} for the target's static input scales (NVFP4 gpt-oss
    # experts need them); None: calibrate the target on CALIBRATION_PROMPTS when the recipe needs it
    input_amax_file: Path | None = None
    schedule_file: Path | None = None  # where draft_len_schedule came from (named in errors)
    # text or JSONL prompts to calibrate the target on instead of CALIBRATION_PROMPTS (fp8 / nvfp4)
    calibration_prompts_file: Path | None = None
    schedule_measured_on: dict[str, str] | None = None  # {'machine', 'device'} of the bench (bench.schedule)
    allow_foreign_schedule: bool = False  # use a schedule measured on another device class than the profile's
    # the reference runtime's dflash-sa suffix-match threshold: our own metadata in manifest.json
    # ("runtime"), never llm_api_options.yaml (TensorRT-LLM's DFlash config forbids unknown keys)
    sa_threshold: int | None = None
    sa_max_drafts: int | None = None  # dflash-sa's longest suffix draft, likewise ("runtime"); >= max_draft_len


@dataclass(frozen=True)
class BuildPlan:
    """Everything validated: what a build will write, decided before anything is written."""

    options: BuildOptions
    pair: Pair
    profile: Profile
    profile_file: Path
    llm_options: LlmApiOptions
    input_amax: dict[str, float] | None = None  # read from options.input_amax_file
    calibration_ids: list[list[int]] | None = None  # options.calibration_prompts_file, tokenized



def plan_build(options: BuildOptions) -> BuildPlan:
    for name, value in (("--quant", options.quant), ("--drafter-quant", options.drafter_quant)):
        if value not in QUANT_CHOICES:
            raise InputError(f"expected one of {', '.join(QUANT_CHOICES)}, got {value!r}.", field=name)
    if options.kv_cache_dtype is not None and options.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise InputError(f"expected one of {', '.join(KV_CACHE_DTYPES)}, got {options.kv_cache_dtype!r}.",
                         field="--kv-cache-dtype")
    if options.calibration_prompts_file is not None and options.input_amax_file is not None:
        raise InputError("give --calibration-prompts or --input-amax, not both.", field="--calibration-prompts")
    check_output(options.output_dir, options.force, "--output")
    if options.triton_repo is not None:
        check_output(options.triton_repo, options.force, "--triton-repo")
    profile_file = profile_path(options.profile)
    profile = load_profile(profile_file)
    pair = validate_pair(options.target_dir, options.drafter_dir)
    check_apart_from_sources(options, pair)
    input_amax = None if options.input_amax_file is None else read_input_amax(options.input_amax_file)
    if options.quant != KEEP:
        check_convertible(pair.target_dir, options.quant, input_amax, options.input_amax_file)
    elif input_amax is not None:
        raise InputError("input amax only sets the static input scales of --quant fp8 or nvfp4; this build keeps "
                         "the target as it is.", path=options.input_amax_file, field="--input-amax")
    calibration_ids = None
    if options.calibration_prompts_file is not None:
        calibration_ids = read_calibration_prompts(options, pair)
    llm_options = render_options(profile, pair, options, profile_file)
    spec = llm_options.speculative_config
    checks.check_draft_len(spec.max_draft_len, pair, "--max-draft-len" if options.schedule_file is None
                           else f"--schedule-from {options.schedule_file}")
    if options.sa_max_drafts is not None:
        from ..runtime.proposers import check_max_suffix_drafts  # imports torch and the models: only when asked

        check_max_suffix_drafts(options.sa_max_drafts, spec.max_draft_len, "max_draft_len", "--sa-max-drafts")
    checks.check_seq_len(llm_options.max_seq_len, pair)
    checks.check_tokenizers(pair)
    checks.check_quant(options.quant, profile, "--quant")
    checks.check_quant(options.drafter_quant, profile, "--drafter-quant")
    checks.check_drafter_quant(options.drafter_quant, profile)
    if options.draft_len_schedule is not None:
        checks.check_schedule_device(options.schedule_measured_on, profile, options.schedule_file,
                                     options.allow_foreign_schedule)
    checks.check_profile_hardware(llm_options, profile, str(profile_file))
    checks.check_parallel(llm_options, pair)
    return BuildPlan(options, pair, profile, profile_file, llm_options, input_amax, calibration_ids)


def check_output(path: Path, force: bool, option: str) -> None:
    check_output_path(path, option, directory=True)
    if path.is_dir() and any(path.iterdir()) and not force:
        raise InputError("exists and is not empty; pass --force to replace it.", path=path, field=option)


def check_convertible(target_dir: Path, recipe: str, input_amax: dict[str, float] | None,
                      input_amax_file: Path | None) -> None:
    """What the converter would refuse, said before anything is written: a source that is not bf16
    or native MXFP4, a shard index that disagrees with the shards, an input-amax file that does not
    fit the recipe."""
    from ..quant.convert import check_input_amax, check_source, planned_formats

    check_source(target_dir, read_json(target_dir / "config.json"))
    if input_amax is None:
        planned_formats(target_dir, recipe)
    else:
        check_input_amax(target_dir, recipe, input_amax, input_amax_file)


def check_apart_from_sources(options: BuildOptions, pair: Pair) -> None:
    """An output that is, holds or sits inside a source checkpoint would overwrite or change it."""
    for output, option in ((options.output_dir, "--output"), (options.triton_repo, "--triton-repo")):
        if output is None:
            continue
        out = output.resolve()
        for source in (pair.target_dir.resolve(), pair.drafter_dir.resolve()):
            if out == source or out.is_relative_to(source) or source.is_relative_to(out):
                raise InputError(f"overlaps the source checkpoint {source}; write the engine elsewhere.",
                                 path=output, field=option)


def read_calibration_prompts(options: BuildOptions, pair: Pair) -> list[list[int]]:
    """The calibration prompts as token ids, checked: only where a calibration is used, not next to
    precomputed amax, each prompt non-empty and inside the target's vocabulary."""
    from ..prompts import prompt_token_ids, read_prompts_file
    from ..runtime.interface import check_request

    field, path = "--calibration-prompts", options.calibration_prompts_file
    if options.quant not in ("fp8", "nvfp4"):
        raise InputError(f"calibration sets the static input scales of --quant fp8 or nvfp4, not {options.quant}.",
                         path=path, field=field)
    ids = prompt_token_ids(read_prompts_file(path), pair.target_dir)
    check_request(ids, 1, pair.target_config["vocab_size"], 0, pair.target_config.get("max_position_embeddings"))
    return ids


def read_input_amax(path: Path) -> dict[str, float]:
    """`--input-amax`-style JSON: an object of logical weight name -> positive finite amax."""
    data = read_json(Path(path))
    if not isinstance(data, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in data.items()):
        raise InputError("expected a JSON object of weight name -> amax (number).", path=path)
    return {k: float(v) for k, v in data.items()}


def render_options(profile: Profile, pair: Pair, options: BuildOptions, profile_file: Path) -> LlmApiOptions:
    """Profile options + command-line overrides + the drafter's DFlash settings, validated."""
    data = profile.llm_api_options.to_dict()
    overrides = {"tensor_parallel_size": options.tp, "moe_expert_parallel_size": options.ep,
                 "max_seq_len": options.max_seq_len}
    data.update({k: v for k, v in overrides.items() if v is not None})
    if options.kv_cache_dtype is not None:
        data["kv_cache_config"] = {**data.get("kv_cache_config", {}), "dtype": options.kv_cache_dtype}
    drafter = pair.drafter_config
    spec = profile.speculative.model_dump(exclude_none=True)
    if options.max_draft_len is not None:
        spec["max_draft_len"] = options.max_draft_len
    if options.draft_len_schedule:
        # TensorRT-LLM requires the smallest key to map to max_draft_len.
        spec["draft_len_schedule"] = dict(options.draft_len_schedule)
        spec["max_draft_len"] = options.draft_len_schedule[min(options.draft_len_schedule)]
    spec.update(max_draft_len=spec.get("max_draft_len", drafter.block_size - 1),
                speculative_model=DRAFTER, mask_token_id=drafter.mask_token_id,
                target_layer_ids=list(drafter.target_layer_ids))
    validated(DFlashDecodingConfig, spec, profile_file, "speculative")
    data["speculative_config"] = spec
    return LlmApiOptions.from_dict(data, profile_file, "llm_api_options")
