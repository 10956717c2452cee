"""Streaming checkpoint quantizer (gpt-oss target or DFlash drafter) and the dequantizing loader. How each
tensor is read and encoded is its job (`quant/jobs.py`); this module orders the jobs into shards, writes and
publishes them, and reads them back.

Output: a Hugging Face directory in ModelOpt's unified layout, which TensorRT-LLM's PyTorch backend
reads: each quantized weight keeps its name and gains siblings

* linear ``X.weight`` [out, in]: ``X.weight`` (fp8 [out, in] | uint8 [out, in/2]),
  ``X.weight_scale`` (fp32 [] | e4m3 [out, in/16]), ``X.weight_scale_2`` (fp32 [], NVFP4),
  ``X.input_scale`` (fp32 [], only when calibration amax is given);
* gpt-oss experts ``...mlp.experts.gate_up_proj`` / ``down_proj``: the same siblings joined with
  ``_`` (``gate_up_proj_weight_scale``, ``..._weight_scale_2``, ``..._input_scale``). Experts are
  stored in the transformers orientation ``[E, in, out]`` whatever their format, because that is
  what TensorRT-LLM's gpt-oss NVFP4 loader (``modeling_gpt_oss.load_nvfp4_weights``, after 1.1.0)
  reads: NVFP4 ``X`` uint8 ``[E, in/2, out]`` (two FP4 codes per byte along the INPUT dim, low
  nibble = even input element), ``X_weight_scale`` e4m3 ``[E, in/16, out]``, and ONE fp32 scalar
  ``X_weight_scale_2`` and ``X_input_scale`` per fused tensor (it ``.reshape([])``s them). The
  input scales are required there, so NVFP4 experts are refused without calibrated amax.
  gate/up columns stay interleaved (gate even, up odd) on the last dim, as the loader
  deinterleaves them. bf16 experts use the same ``[E, in, out]`` layout.

Memory stays flat in the number of layers: tensors are read slice by slice, experts are processed
a few experts at a time (one per chunk at gpt-oss-120b size, two chunks encoded at once), and every
piece is written straight to its final offset in its shard (whose layout is computed up front). A
tensor-wide global scale takes a first, cheap pass over the tensor (MXFP4: the scale bytes, and
only the blocks holding the largest exponent; otherwise the amax) before the encoding pass.
Everything goes to a temporary sibling directory that is made durable (fsync) and renamed into
place at the end, so neither a failure nor a crash leaves a half-written checkpoint.

Pass-through tensors (bf16 kept as is, MXFP4 kept by the ``mxfp4`` recipe) are copied shard to shard
by the kernel (:func:`~trtllm_dflash.checkpoints.safetensors_io.copy_range`), never through Python.
MXFP4 experts re-expressed as NVFP4 keep their FP4 codes: the ``[E, out, in/32, 16]`` source bytes
are ``[E, out, in/2]`` in NVFP4 order and only need a uint8 transpose per expert to become
``[E, in/2, out]`` (each byte holds two neighbouring input elements, so bytes are moved, not
changed); only the scale tensors are computed. A chunk of experts with a block scale E4M3 cannot
hold under the layer-wide global scale falls back to the computed path
(:func:`~trtllm_dflash.quant.codecs.mxfp4_to_nvfp4`).
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from trtllm_dflash.checkpoints.hf import read_json
from trtllm_dflash.checkpoints.publish import publish_directory
from trtllm_dflash.checkpoints.safetensors_io import (
    ShardedReader,
    StreamingShardWriter,
    group_into_shards,
    shard_names,
    write_index,
)
from trtllm_dflash.errors import InputError
from trtllm_dflash.quant.codecs import fp8_decode, mxfp4_decode, nvfp4_decode
from trtllm_dflash.quant.jobs import Job, is_expert, plan_job, scale_name, source_params
from trtllm_dflash.quant.recipes import KV_CACHE_ALGOS, Format, Recipe, get_recipe, is_gpt_oss, quant_configs

DEFAULT_SHARD_BYTES = 5 * 2**30
SCALE_KINDS = ("weight_scale", "weight_scale_2", "input_scale")
AUX_FILES = (
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template*",
    "vocab*",
    "merges.txt",
    "*.tiktoken",
)



# ----------------------------------------------------------------------------------------------
# conversion


@dataclass
class ConversionResult:
    """What :func:`convert_checkpoint` wrote. ``kv_cache_dtype`` must also reach the LLM-API
    ``kv_cache_config.dtype`` when the recipe writes no ``hf_quant_config.json`` (``mxfp4``)."""

    output_dir: Path
    recipe: str
    kv_cache_dtype: str
    formats: dict[str, Format] = field(default_factory=dict)
    shards: int = 0
    bytes_written: int = 0
    seconds: float = 0.0


def check_source(src: Path, config: dict) -> None:
    if (src / "hf_quant_config.json").exists():
        raise InputError(
            "source is already ModelOpt-quantized; convert from a bf16 or MXFP4 checkpoint", path=src / "hf_quant_config.json"
        )
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method not in (None, "mxfp4"):
        raise InputError(
            f"quant_method {method!r} cannot be converted; expected a bf16 or native-MXFP4 checkpoint",
            path=src / "config.json",
            field="quantization_config.quant_method",
        )


def _check_amax(input_amax: Mapping[str, float], formats: dict[str, Format], path: Path | None = None) -> None:
    for name, amax in input_amax.items():
        if formats.get(name) not in (Format.FP8, Format.NVFP4):
            raise InputError("no FP8/NVFP4 weight of this name in the recipe's output", path=path,
                             field=f"input_amax[{name!r}]")
        if not (math.isfinite(amax) and amax > 0):
            raise InputError(f"amax must be finite and > 0, got {amax}", path=path, field=f"input_amax[{name!r}]")


def required_input_amax(formats: Mapping[str, Format]) -> list[str]:
    """Logical names whose ``input_scale`` the target loader cannot do without: NVFP4 gpt-oss experts
    (TensorRT-LLM's NVFP4 MoE loader reads ``gate_up_proj_input_scale`` / ``down_proj_input_scale``
    unconditionally and fails with a KeyError when they are absent)."""
    return sorted(n for n, f in formats.items() if f is Format.NVFP4 and is_expert(n))


def source_plan(recipe: str, config: dict, names: list[str]) -> Recipe:
    """The recipe as applied to this source: its gpt-oss variant for a gpt-oss checkpoint (experts
    and attention follow TensorRT-LLM's gpt-oss loader)."""
    return get_recipe(recipe, "gpt_oss" if is_gpt_oss(config, names) else None)


def planned_formats(src: str | Path, recipe: str) -> dict[str, Format]:
    """The format :func:`convert_checkpoint` gives each logical parameter of ``src`` under ``recipe``,
    from config.json and the safetensors headers only (which also checks the shard index)."""
    src = Path(src)
    names = [p.name for p in source_params(ShardedReader(src))]
    plan = source_plan(recipe, read_json(src / "config.json"), names)
    return {n: plan.format_for(n) for n in names}


def needs_input_amax(src: str | Path, recipe: str) -> list[str]:
    """The logical names :func:`convert_checkpoint` will refuse to convert ``src`` with ``recipe``
    without an ``input_amax`` entry for (reads only config.json and the safetensors headers)."""
    return required_input_amax(planned_formats(src, recipe))


def check_input_amax(src: str | Path, recipe: str, input_amax: Mapping[str, float], path: Path) -> None:
    """What :func:`convert_checkpoint` would refuse in ``input_amax`` (read from ``path``), found
    before anything is written."""
    formats = planned_formats(src, recipe)
    _check_amax(input_amax, formats, path)
    _check_required_amax(input_amax, formats, recipe, path)


def _check_required_amax(input_amax: Mapping[str, float], formats: Mapping[str, Format], recipe: str,
                         path: Path | None = None) -> None:
    missing = [n for n in required_input_amax(formats) if n not in input_amax]
    if missing:
        raise InputError(
            f"NVFP4 gpt-oss experts need a calibrated input amax for {len(missing)} parameter(s), first "
            f"{missing[0]!r}: TensorRT-LLM's NVFP4 MoE loader requires {scale_name(missing[0], 'input_scale')!r}. "
            "Calibrate with trtllm_dflash.quant.calibrate (calibrate([model], run) on a few prompts, then "
            f"for_recipe(amax, {recipe!r}, model_type='gpt_oss')) and pass the result as input_amax, or let "
            "dflash-build do it (it calibrates the target on built-in prompts for --quant nvfp4); "
            "--quant mxfp4 needs no calibration",
            path=path,
            field=f"input_amax[{missing[0]!r}]",
        )


def _progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        disable=not enabled,
    )


def _write_shards(out: Path, jobs: list[Job], max_shard_bytes: int, show_progress: bool) -> dict[str, str]:
    groups = group_into_shards([j.nbytes for j in jobs], max_shard_bytes)
    weight_map = {}
    with _progress(show_progress) as progress:
        task = progress.add_task("quantizing", total=sum(j.nbytes for j in jobs))
        for file, members in zip(shard_names(len(groups)), groups):
            infos = [o for i in members for o in jobs[i].outputs]
            with StreamingShardWriter(out / file, infos) as writer:
                for i in members:
                    for name, piece in jobs[i].pieces():
                        # pieces are fresh tensors (or file ranges): safe to write in the background
                        progress.advance(task, writer.write(name, piece, background=True))
            weight_map.update({o.name: file for o in infos})
    return weight_map


def _write_metadata(src: Path, out: Path, config: dict, hf_quant: dict | None, quantization: dict | None) -> None:
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    if quantization is not None:
        config["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if hf_quant is not None:
        (out / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2) + "\n")
    for pattern in AUX_FILES:
        for file in src.glob(pattern):
            if file.is_file():
                shutil.copy2(file, out / file.name)


def convert_checkpoint(
    src: str | Path,
    dst: str | Path,
    recipe: str = "nvfp4",
    *,
    kv_cache_dtype: str = "auto",
    input_amax: Mapping[str, float] | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    progress: bool = True,
) -> ConversionResult:
    """Quantize the HF checkpoint in ``src`` (gpt-oss or DFlash drafter) into ``dst`` with ``recipe``.

    ``kv_cache_dtype``: ``"auto"`` (model dtype) or ``"fp8"`` (written as ``kv_cache_quant_algo``).
    ``input_amax``: calibrated activation amax per quantized logical parameter name (e.g.
    ``model.layers.0.self_attn.q_proj.weight``, ``model.layers.0.mlp.experts.gate_up_proj``); each
    becomes an ``input_scale`` of ``amax / 448`` (FP8) or ``amax / (6 * 448)`` (NVFP4). Without it
    no ``input_scale`` is written, except that NVFP4 gpt-oss experts REQUIRE it (InputError
    otherwise; see :func:`required_input_amax`).

    A gpt-oss source (``model_type == "gpt_oss"`` or any expert tensor) gets the recipe's gpt-oss
    variant (:func:`~trtllm_dflash.quant.recipes.get_recipe`): ``nvfp4`` = NVFP4 experts, bf16
    attention, ``quant_algo: NVFP4``; ``fp8`` = FP8 attention, bf16 experts.
    """
    started = time.perf_counter()
    src, dst = Path(src), Path(dst)
    get_recipe(recipe)  # an unknown recipe fails before any file is read
    if kv_cache_dtype not in KV_CACHE_ALGOS:
        raise InputError(f"expected one of {sorted(KV_CACHE_ALGOS)}", field="kv_cache_dtype")
    if dst.exists() and not overwrite:
        raise InputError("output directory already exists (pass overwrite=True to replace it)", path=dst)
    config = read_json(src / "config.json")
    check_source(src, config)
    reader = ShardedReader(src)
    params = source_params(reader)
    plan = source_plan(recipe, config, [p.name for p in params])
    formats = {p.name: plan.format_for(p.name) for p in params}
    quantized = {n: f for n, f in formats.items() if f is not Format.BF16}
    amax = dict(input_amax or {})
    _check_amax(amax, quantized)
    _check_required_amax(amax, quantized, recipe)
    jobs = [plan_job(reader, p, formats[p.name], amax.get(p.name)) for p in params]
    hf_quant, quantization = quant_configs(plan, kv_cache_dtype, quantized, config.get("quantization_config"))

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        weight_map = _write_shards(tmp, jobs, max_shard_bytes, progress)
        total = sum(j.nbytes for j in jobs)
        write_index(tmp, weight_map, total)
        _write_metadata(src, tmp, config, hf_quant, quantization)
        publish_directory(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ConversionResult(
        dst, recipe, kv_cache_dtype, quantized, len(set(weight_map.values())), total, time.perf_counter() - started
    )


# ----------------------------------------------------------------------------------------------
# round trip


def _companions(names: set[str]) -> set[str]:
    """Scale / MXFP4-scales tensors that belong to another tensor in ``names``."""
    found = {scale_name(n, k) for n in names for k in SCALE_KINDS} & names
    found |= {n.removesuffix("_blocks") + "_scales" for n in names if n.endswith("_blocks")} & names
    return found


def load_dequantized_state_dict(checkpoint_dir: str | Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every weight of a checkpoint (source or converted) as plain ``dtype`` tensors.

    Names are the MXFP4-free HF names, so a converted checkpoint and its source compare key by key
    and load into transformers' ``GptOssForCausalLM`` / the drafter with ``load_state_dict``:
    quantized linears come back as ``X.weight [out, in]``; experts (MXFP4 ``[E, out, in/32, 16]``,
    or FP8 / NVFP4 stored ``[E, in(/2), out]``) come back as ``...experts.gate_up_proj`` /
    ``down_proj`` in transformers' ``[E, in, out]`` layout. Scale
    tensors are consumed; non-float tensors are returned unchanged.
    """
    reader = ShardedReader(checkpoint_dir)
    names = set(reader.infos)
    skip = _companions(names)
    state: dict[str, torch.Tensor] = {}
    for name in reader.infos:
        if name in skip:
            continue
        path = str(reader.files[name])
        if name.endswith("_blocks") and name.removesuffix("_blocks") + "_scales" in names:
            base = name.removesuffix("_blocks")
            weight = mxfp4_decode(reader.read(name), reader.read(base + "_scales"), name=base, path=path)
        elif scale_name(name, "weight_scale") in names:
            q, ws = reader.read(name), reader.read(scale_name(name, "weight_scale"))
            if q.dtype == torch.uint8:
                ws2 = reader.read(scale_name(name, "weight_scale_2"))
                if is_expert(name):  # stored [E, in/2, out] / [E, in/16, out]: decode as [E, out, in], back to [E, in, out]
                    weight = nvfp4_decode(q.transpose(-1, -2), ws.transpose(-1, -2), ws2).transpose(-1, -2)
                else:
                    weight = nvfp4_decode(q, ws, ws2)
            else:
                weight = fp8_decode(q, ws)  # experts already [E, in, out], scale scalar
            state[name] = weight.contiguous().to(dtype)
            continue
        else:
            tensor = reader.read(name)
            state[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
            continue
        state[base] = (weight.transpose(-1, -2).contiguous() if is_expert(base) else weight).to(dtype)
    return state
