"""Building an engine directory: stage a validated plan (`plan.plan_build`) in a temporary sibling, then publish it.

`build_engine` works in `.<name>.partial/` next
to the output, one stage at a time (target, drafter, options, triton, manifest); each finished
stage leaves a record in `.<name>.records/` with the sha256 of its outputs and a key of its inputs,
so a re-run after Ctrl-C, kill -9 or a full disk reuses verified stages and redoes only the rest.
The manifest is written last and the directory only then renamed to its final name: nothing at
the output path ever looks complete unless it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

import trtllm_dflash

from ..checkpoints.hf import load_state_dict
from ..checkpoints.publish import publish_directory
from ..checkpoints.validate import Pair
from ..errors import InputError
from ..models.drafter import DFlashDrafter, normalize_drafter_keys
from ..triton.repository import write_model_repository
from . import trtllm_versions
from .manifest import (CHUNK, DRAFTER, MANIFEST, OPTIONS_FILE, TARGET, TRITON, Engine, FileRecord, file_record,
                       list_files, open_engine, sha256_file, write_atomic, write_manifest)
from .options import LlmApiOptions
from .plan import KEEP, BuildOptions, BuildPlan, plan_build

PAUSE_ENV, PAUSE_MARKER_ENV = "TRTLLM_DFLASH_BUILD_PAUSE_AT", "TRTLLM_DFLASH_BUILD_PAUSE_MARKER"
DRAFTER_WEIGHTS = "model.safetensors"


@dataclass
class BuildResult:
    engine: Engine
    reused: list[str] = field(default_factory=list)
    built: list[str] = field(default_factory=list)
    triton_repo: Path | None = None


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def source_files(directory: Path) -> list[Path]:
    """Top-level files only: HF repos keep extra trees (gpt-oss `original/`, `metal/`) we don't ship."""
    return sorted(p for p in directory.iterdir() if p.is_file() and not p.name.startswith("."))


class StageRunner:
    """Runs named stages in the partial directory, reusing those whose record and outputs verify."""

    def __init__(self, root: Path, records: Path, progress: Progress):
        self.root, self.records, self.progress = root, records, progress
        root.mkdir(parents=True, exist_ok=True)
        records.mkdir(parents=True, exist_ok=True)
        self.reused: list[str] = []
        self.built: list[str] = []

    def record(self, name: str) -> dict[str, Any] | None:
        path = self.records / f"{name}.json"
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None

    def outputs_verify(self, outputs: dict[str, FileRecord]) -> bool:
        for rel, rec in outputs.items():
            file = self.root / rel
            if not file.is_file() or file.stat().st_size != rec["size"] or self.hash(file) != rec["sha256"]:
                return False
        return True

    def run(self, name: str, key: Any, output: str, produce: Callable[[Path], dict[str, FileRecord] | None]) -> None:
        """`produce(output_path)` writes `output` (a file or directory under the partial root) and
        may return its file records when it hashed them while writing."""
        key_hash = digest(key)
        previous = self.record(name)
        if previous and previous.get("key") == key_hash and self.outputs_verify(previous["outputs"]):
            self.reused.append(name)
            return
        target = self.root / output
        remove(target)
        for stale in self.root.glob(f".{target.name}.partial-*"):  # the converter's own temp dirs
            remove(stale)
        pause_if_asked(name)
        records = produce(target)
        if records is None:
            files = [target] if target.is_file() else [self.root / r for r in list_files(self.root)
                                                       if r == output or r.startswith(output + "/")]
            records = {f.relative_to(self.root).as_posix(): {"size": f.stat().st_size, "sha256": self.hash(f)}
                       for f in files}
        write_atomic(self.records / f"{name}.json", json.dumps({"key": key_hash, "outputs": records}, indent=1))
        self.built.append(name)

    def hash(self, file: Path) -> str:
        task = self.progress.add_task(f"sha256 {file.name}", total=file.stat().st_size)
        try:
            return sha256_file(file, lambda n: self.progress.advance(task, n))
        finally:
            self.progress.remove_task(task)

    def all_records(self) -> dict[str, FileRecord]:
        merged: dict[str, FileRecord] = {}
        for path in sorted(self.records.glob("*.json")):
            merged.update(json.loads(path.read_text())["outputs"])
        return merged


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def pause_if_asked(stage: str) -> None:
    """Test hook: stop at the start of `stage` so a test can kill the build there."""
    if os.environ.get(PAUSE_ENV) != stage:
        return
    marker = os.environ.get(PAUSE_MARKER_ENV)
    if marker:
        Path(marker).write_text(stage)
    time.sleep(600)


def copy_hashing(src: Path, dst: Path, progress: Progress) -> FileRecord:
    """Copy one file and hash it in the same pass (large checkpoints are read once)."""
    hasher = hashlib.sha256()
    task = progress.add_task(f"copy {src.name}", total=src.stat().st_size)
    with open(src, "rb") as reader, open(dst, "wb") as writer:
        while chunk := reader.read(CHUNK):
            writer.write(chunk)
            hasher.update(chunk)
            progress.advance(task, len(chunk))
    progress.remove_task(task)
    shutil.copystat(src, dst)
    return {"size": dst.stat().st_size, "sha256": hasher.hexdigest()}


def copy_checkpoint(src: Path, dst: Path, root: Path, progress: Progress) -> dict[str, FileRecord]:
    dst.mkdir(parents=True)
    return {(dst / f.name).relative_to(root).as_posix(): copy_hashing(f, dst / f.name, progress)
            for f in source_files(src)}


# Calibration text for the target's static activation scales (NVFP4 gpt-oss experts need them):
# a few varied registers, enough for every layer's experts to see typical hidden-state magnitudes.
CALIBRATION_PROMPTS = (
    "Explain, step by step, why the sum of the first n odd numbers is n squared.",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "Write a short, friendly email asking a colleague to review a pull request by Friday.",
    "Summarize the causes of the French Revolution in three bullet points.",
    "Translate into German: The weather is lovely today, so we will eat outside.",
    "SELECT name, COUNT(*) FROM orders GROUP BY name HAVING COUNT(*) > 10 ORDER BY 2 DESC;",
    "What is 17 * 23? Show your reasoning, then give the answer on its own line.",
    "Once upon a time, in a village between two rivers, there lived a clockmaker who",
)


def calibration_token_ids(target_dir: Path, vocab_size: int) -> list[list[int]]:
    """CALIBRATION_PROMPTS through the target's tokenizer; without one, fixed ids across the vocab."""
    from ..prompts import load_tokenizer

    if (target_dir / "tokenizer.json").is_file() or (target_dir / "tokenizer_config.json").is_file():
        tokenizer = load_tokenizer(target_dir)
        ids = [[t for t in tokenizer.encode(text) if t < vocab_size] for text in CALIBRATION_PROMPTS]
        if all(ids):
            return ids
    return [[(7919 * (i * 64 + j) + 13) % vocab_size for j in range(64)] for i in range(len(CALIBRATION_PROMPTS))]


def calibrate_target(target_dir: Path, recipe: str, prompts: list[list[int]] | None = None) -> dict[str, float]:
    """Input amax of the target's quantized weights from a prefill of `prompts` (token ids; default
    CALIBRATION_PROMPTS) in the reference model (transformers, experts dequantized: CPU fp32, or
    CUDA bf16 when available). For gpt-oss-120b that needs the dequantized model in memory; pass
    precomputed amax (`--input-amax`) instead."""
    import torch

    from ..checkpoints.gpt_oss import load_hf_gpt_oss
    from ..quant.calibrate import calibrate, for_recipe

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_hf_gpt_oss(target_dir, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    prompts = prompts or calibration_token_ids(target_dir, model.config.vocab_size)

    def run() -> None:
        with torch.no_grad():
            for ids in prompts:
                model(torch.tensor([ids], device=device))

    return for_recipe(calibrate([model], run), recipe, model_type="gpt_oss")


def convert(src: Path, dst: Path, recipe: str, kv_cache_dtype: str, show_progress: bool,
            input_amax: dict[str, float] | None = None, calibration_ids: list[list[int]] | None = None) -> None:
    """Convert one checkpoint. Static input scales come from `input_amax` (an `--input-amax` file)
    or from calibrating the target here: on `calibration_ids` when given, else on the built-in
    prompts where the loader requires the scales (NVFP4 gpt-oss experts)."""
    from ..quant.convert import convert_checkpoint, needs_input_amax

    amax = input_amax
    if amax is None and (calibration_ids is not None or needs_input_amax(src, recipe)):
        amax = calibrate_target(src, recipe, calibration_ids)
    convert_checkpoint(src, dst, recipe, kv_cache_dtype=kv_cache_dtype, input_amax=amax, progress=show_progress)


def write_normalized_drafter(pair: Pair, dst: Path) -> None:
    """TensorRT-LLM's DFlash loader layout: `layers.N.*`, `fc.weight`, `hidden_norm.weight`,
    `norm.weight` without a `model.` prefix, no embeddings or LM head; config with `dflash_config`
    and `block_size` (models/drafter.py `DFlashConfig.to_dict`)."""
    import torch
    from safetensors.torch import save_file

    config = pair.drafter_config
    state = normalize_drafter_keys(load_state_dict(pair.drafter_dir))
    with torch.device("meta"):
        expected = set(DFlashDrafter(config).state_dict())
    unexpected, missing = sorted(set(state) - expected), sorted(expected - set(state))
    if unexpected or missing:
        raise InputError(f"drafter weights do not match its config: unexpected {unexpected[:3]}, missing "
                         f"{missing[:3]} (a DFlash drafter has no embeddings or LM head of its own).",
                         path=pair.drafter_dir)
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in sorted(state.items())}, dst / DRAFTER_WEIGHTS, metadata={"format": "pt"})


def build_drafter(pair: Pair, dst: Path, recipe: str, kv_cache_dtype: str, show_progress: bool) -> None:
    if recipe == KEEP:
        write_normalized_drafter(pair, dst)
        return
    staging = dst.with_name(f".{dst.name}.normalized")
    remove(staging)
    write_normalized_drafter(pair, staging)
    try:
        convert(staging, dst, recipe, kv_cache_dtype, show_progress)
    finally:
        remove(staging)


# ----------------------------------------------------------------------------------------------
# the build


def progress_bar(enabled: bool) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                    TimeRemainingColumn(), disable=not enabled, transient=True)


def partial_dir(output_dir: Path) -> Path:
    return output_dir.with_name(f".{output_dir.name}.partial")


def records_dir(output_dir: Path) -> Path:
    return output_dir.with_name(f".{output_dir.name}.records")


def build_engine(options: BuildOptions, show_progress: bool = True, log: Callable[[str], None] = print) -> BuildResult:
    """Validate, then build (or finish) the engine at `options.output_dir`."""
    plan = plan_build(options)
    for warning in plan.pair.warnings:
        log(f"warning: {warning}")
    output = options.output_dir.resolve()
    work = partial_dir(output)
    kv = plan.llm_options.kv_cache_config.dtype
    sources = {role: {f.name: (f.stat().st_size, f.stat().st_mtime_ns) for f in source_files(d)}
               for role, d in ((TARGET, plan.pair.target_dir), (DRAFTER, plan.pair.drafter_dir))}
    version = trtllm_dflash.__version__
    records = records_dir(output)
    with progress_bar(show_progress) as progress:
        runner = StageRunner(work, records, progress)
        runner.run(TARGET, [version, options.quant, kv, sources[TARGET], plan.input_amax, plan.calibration_ids],
                   TARGET, lambda dst: copy_checkpoint(plan.pair.target_dir, dst, work, progress)
                   if options.quant == KEEP else convert(plan.pair.target_dir, dst, options.quant, kv, show_progress,
                                                         plan.input_amax, plan.calibration_ids))
        runner.run(DRAFTER, [version, options.drafter_quant, kv, sources[DRAFTER]], DRAFTER,
                   lambda dst: build_drafter(plan.pair, dst, options.drafter_quant, kv, show_progress))
        if options.trt_drafter:
            from .trt_drafter import write_trt_drafter

            def produce(dst: Path) -> None:
                skipped = write_trt_drafter(work / DRAFTER, work / TARGET, dst.parent)
                if skipped:
                    log(f"drafter_trt: wrote the ONNX graph only ({skipped})")

            runner.run("drafter_trt", [version, sources[DRAFTER], options.drafter_quant], "drafter_trt", produce)
        source_records = source_checksums(plan, runner)
        pause_if_asked("options")
        write_atomic(work / OPTIONS_FILE, plan.llm_options.to_yaml())
        remove(work / TRITON)
        write_model_repository(work / TRITON, "../..", plan.llm_options, engine_root=None)
        pause_if_asked("manifest")
        files = runner.all_records()
        for rel in list_files(work, skip=(TARGET, DRAFTER, MANIFEST)):
            files[rel] = file_record(work / rel)
        write_manifest(work, manifest_content(plan, source_records), dict(sorted(files.items())))
    pause_if_asked("publish")
    publish_directory(work, output)
    shutil.rmtree(records)
    result = BuildResult(open_engine(output), runner.reused, runner.built)
    if options.triton_repo is not None:
        result.triton_repo = publish_triton_repo(options.triton_repo.resolve(), output, plan.llm_options)
    for name in runner.reused:
        log(f"reused {name} (verified)")
    return result


def source_checksums(plan: BuildPlan, runner: StageRunner) -> dict[str, Any]:
    """sha256 of every source file. A byte-for-byte copy already hashed the target while copying;
    anything else is hashed here (recorded as a stage, so an interrupted build does it once)."""
    out = {}
    for role, directory in ((TARGET, plan.pair.target_dir), (DRAFTER, plan.pair.drafter_dir)):
        files = source_files(directory)
        key = [str(directory.resolve()), {f.name: (f.stat().st_size, f.stat().st_mtime_ns) for f in files}]
        name = f"sources-{role}"
        copied = runner.record(role) if role == TARGET and plan.options.quant == KEEP else None
        previous = runner.record(name)
        if previous is None or previous.get("key") != digest(key):
            records = ({f.name: copied["outputs"][f"{TARGET}/{f.name}"] for f in files} if copied
                       else {f.name: {"size": f.stat().st_size, "sha256": runner.hash(f)} for f in files})
            previous = {"key": digest(key), "outputs": {}, "sources": records}
            write_atomic(runner.records / f"{name}.json", json.dumps(previous, indent=1))
        out[role] = {"path": str(directory.resolve()), "files": previous["sources"]}
    return out


def manifest_content(plan: BuildPlan, sources: dict[str, Any]) -> dict[str, Any]:
    drafter = plan.pair.drafter_config
    options = asdict(plan.options)
    options.update({k: str(v) for k, v in options.items() if isinstance(v, Path)})
    options["profile_file"] = str(plan.profile_file.resolve())
    return {
        "toolkit_version": trtllm_dflash.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "trtllm": trtllm_versions.requirements(plan.llm_options, plan.options.quant, plan.options.drafter_quant),
        "sources": sources,
        "options": options,
        "profile": plan.profile.model_dump(),
        "llm_api_options": OPTIONS_FILE,
        "drafter": {"block_size": drafter.block_size, "mask_token_id": drafter.mask_token_id,
                    "target_layer_ids": list(drafter.target_layer_ids)},
        "schedule": None if plan.options.draft_len_schedule is None else {
            "file": str(plan.options.schedule_file), "measured_on": plan.options.schedule_measured_on,
            "foreign_allowed": plan.options.allow_foreign_schedule},
        **runtime_section(plan.options),
    }


def runtime_section(options: BuildOptions) -> dict:
    """The manifest's "runtime" section: the reference runtime's own settings (dflash-sa's), absent when none is set."""
    settings = {name: value for name, value in (("sa_threshold", options.sa_threshold),
                                                ("sa_max_drafts", options.sa_max_drafts)) if value is not None}
    return {"runtime": settings} if settings else {}


def publish_triton_repo(repo: Path, engine_root: Path, options: LlmApiOptions) -> Path:
    """A stand-alone model repository pointing at the engine by absolute path."""
    work = partial_dir(repo)
    remove(work)
    write_model_repository(work, str(engine_root), options, engine_root=engine_root)
    publish_directory(work, repo)
    return repo


def default_engine_dir(pair: tuple[Path, Path]) -> Path:
    """Where the embedded pair's engine is built once: the user cache, keyed by toolkit version and
    by the pair's content, so a re-shipped pair gets a fresh engine instead of a stale cached one."""
    digest = hashlib.sha256()
    for directory in pair:
        for file in sorted(p for p in directory.rglob("*") if p.is_file()):
            digest.update(file.relative_to(directory).as_posix().encode())
            digest.update(file.read_bytes())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "trtllm-dflash" / f"embedded-engine-{trtllm_dflash.__version__}-{digest.hexdigest()[:12]}"


def default_engine(log: Callable[[str], None] = print) -> Engine:
    """The embedded pair as an engine: opened from the cache, or built there on first use."""
    from ..embedded import pair_paths

    target_dir, drafter_dir = pair_paths()
    output = default_engine_dir((target_dir, drafter_dir))
    try:
        return open_engine(output)
    except InputError:
        log(f"building the embedded default engine once into {output}")
    return build_engine(BuildOptions(target_dir, drafter_dir, output, force=True), show_progress=False,
                        log=log).engine
