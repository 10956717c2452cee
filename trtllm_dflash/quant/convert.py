"""Streaming checkpoint quantizer (gpt-oss target or DFlash drafter) and the dequantizing loader.

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
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path

import numpy as np
import torch
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from trtllm_dflash.checkpoints.hf import read_json
from trtllm_dflash.checkpoints.publish import publish_directory
from trtllm_dflash.checkpoints.safetensors_io import (
    FileRange,
    ShardedReader,
    StreamingShardWriter,
    TensorInfo,
    group_into_shards,
    iter_ranges,
    shard_names,
    write_index,
)
from trtllm_dflash.errors import InputError
from trtllm_dflash.quant.codecs import (
    E2M1_MAX,
    E4M3_MAX,
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    fp8_decode,
    fp8_encode,
    mxfp4_decode,
    mxfp4_encode,
    mxfp4_global_log2,
    mxfp4_to_nvfp4,
    mxfp4_to_nvfp4_scales,
    nvfp4_decode,
    nvfp4_encode,
    pow2,
    require_finite,
    scale_from_amax,
)
from trtllm_dflash.quant.recipes import EXPERTS, KV_CACHE_ALGOS, Format, Recipe, get_recipe, is_gpt_oss, quant_configs

DEFAULT_SHARD_BYTES = 5 * 2**30
PIECE_BYTES = 64 * 2**20  # passthrough copy granularity
COPY_EXACT_FP4 = True  # MXFP4 -> NVFP4: reuse the FP4 code bytes (transposed), no decode (False: always the computed path)
CHUNK_ELEMENTS = 2**24  # experts decoded/encoded per step: ~64 MiB of fp32 plus temporaries
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

Piece = tuple[str, torch.Tensor | FileRange]


def scale_name(param: str, kind: str) -> str:
    """Sibling tensor name: ``a.q_proj.weight`` -> ``a.q_proj.weight_scale``; experts join with ``_``."""
    if param.endswith(".weight"):
        return param.removesuffix("weight") + kind
    return f"{param}_{kind}"


def is_expert(param: str) -> bool:
    return any(fnmatchcase(param, p) for p in EXPERTS)


# ----------------------------------------------------------------------------------------------
# planning


@dataclass(frozen=True)
class SourceParam:
    """One logical source weight: a plain tensor, or an MXFP4 ``*_blocks`` + ``*_scales`` pair."""

    name: str
    tensors: tuple[str, ...]

    @property
    def mxfp4(self) -> bool:
        return len(self.tensors) == 2


@dataclass
class Job:
    """The output tensors made from one source parameter, and a generator of their pieces."""

    outputs: list[TensorInfo]
    pieces: Callable[[], Iterator[Piece]]

    @property
    def nbytes(self) -> int:
        return sum(o.nbytes for o in self.outputs)


def source_params(reader: ShardedReader) -> list[SourceParam]:
    """Group MXFP4 pairs into one logical parameter; refuse already ModelOpt-quantized inputs."""
    params = []
    for name in reader.infos:
        if name.endswith(("weight_scale", "weight_scale_2", "input_scale")):
            raise InputError(
                "source is already quantized (ModelOpt scale tensor); convert from a bf16 or MXFP4 checkpoint",
                path=reader.files[name],
                field=name,
            )
        if name.endswith("_scales") and name.removesuffix("_scales") + "_blocks" in reader.infos:
            continue
        if name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            if base + "_scales" not in reader.infos:
                raise InputError("MXFP4 blocks without their scales tensor", path=reader.files[name], field=base + "_scales")
            params.append(SourceParam(base, (name, base + "_scales")))
        else:
            params.append(SourceParam(name, (name,)))
    return params


def _canonical_shape(reader: ShardedReader, p: SourceParam) -> tuple[int, ...]:
    """Logical ``[..., out, in]`` shape (experts ``[E, out, in]``) whatever the storage layout.

    This is the codecs' working layout (blocks along the last, input, dim); gpt-oss experts are
    transposed to ``[E, in, out]`` (packed ``[E, in/2, out]``) only when written.
    """
    shape = reader.infos[p.tensors[0]].shape
    if p.mxfp4:
        return shape[:-2] + (shape[-2] * MXFP4_BLOCK,)
    if is_expert(p.name):
        return shape[:-2] + (shape[-1], shape[-2])
    return shape


def _rows_per_chunk(shape: tuple[int, ...], per_row_scale: bool) -> int:
    """Rows of dim 0 handled per step: several experts at once, but a per-tensor scale needs all rows."""
    if not per_row_scale:
        return shape[0]
    return max(1, CHUNK_ELEMENTS // max(1, math.prod(shape[1:])))


def _row_ranges(n: int, step: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, step):
        yield start, min(start + step, n)


def _canonical_chunks(reader: ShardedReader, p: SourceParam, rows: int) -> Iterator[torch.Tensor]:
    """fp32 ``[k, ..., out, in]`` slices of the logical weight (MXFP4 decoded exactly)."""
    path = str(reader.files[p.tensors[0]])
    n = reader.infos[p.tensors[0]].shape[0]
    for a, b in _row_ranges(n, rows):
        if p.mxfp4:
            yield mxfp4_decode(reader.read(p.tensors[0], a, b), reader.read(p.tensors[1], a, b), name=p.name, path=path)
        else:
            chunk = reader.read(p.name, a, b).float()
            yield chunk.transpose(-1, -2).contiguous() if is_expert(p.name) else chunk


def _passthrough(reader: ShardedReader, names: tuple[str, ...]) -> Job:
    """Tensors copied unchanged, file to file (never through Python)."""

    def pieces() -> Iterator[Piece]:
        for name in names:
            for piece in iter_ranges(reader, name, PIECE_BYTES):
                yield name, piece

    return Job([reader.infos[n] for n in names], pieces)


def _to_bf16(reader: ShardedReader, p: SourceParam) -> Job:
    """Dequantize an MXFP4 source to bf16 (experts transposed to transformers' ``[E, in, out]``)."""
    shape = _canonical_shape(reader, p)
    expert = is_expert(p.name)
    out_shape = shape[:-2] + (shape[-1], shape[-2]) if expert else shape

    def pieces() -> Iterator[Piece]:
        for chunk in _canonical_chunks(reader, p, _rows_per_chunk(shape, True)):
            yield p.name, (chunk.transpose(-1, -2) if expert else chunk).to(torch.bfloat16)

    return Job([TensorInfo(p.name, torch.bfloat16, out_shape)], pieces)


def _to_mxfp4(reader: ShardedReader, p: SourceParam) -> Job:
    shape = _canonical_shape(reader, p)
    path = str(reader.files[p.name])
    blocks, scales = p.name + "_blocks", p.name + "_scales"
    nb = shape[-1] // MXFP4_BLOCK
    outputs = [
        TensorInfo(blocks, torch.uint8, shape[:-1] + (nb, MXFP4_BLOCK // 2)),
        TensorInfo(scales, torch.uint8, shape[:-1] + (nb,)),
    ]

    def pieces() -> Iterator[Piece]:
        for chunk in _canonical_chunks(reader, p, _rows_per_chunk(shape, True)):
            b, s = mxfp4_encode(chunk, name=p.name, path=path)
            yield blocks, b
            yield scales, s

    return Job(outputs, pieces)


def _input_scale(fmt: Format, input_amax: float) -> torch.Tensor:
    divisor = E4M3_MAX if fmt is Format.FP8 else E2M1_MAX * E4M3_MAX
    return torch.tensor(input_amax / divisor, dtype=torch.float32)


def _to_scaled(reader: ShardedReader, p: SourceParam, fmt: Format, input_amax: float | None) -> Job:
    """FP8 or NVFP4 linear weight ``[out, in]`` + scales (+ input_scale from calibration amax)."""
    if is_expert(p.name):
        if fmt is not Format.NVFP4:  # no recipe maps experts to FP8: TensorRT-LLM has no such gpt-oss path
            raise ValueError(f"{p.name}: gpt-oss experts are written as NVFP4, MXFP4 or bf16, not {fmt.value}")
        return _experts_to_nvfp4(reader, p, input_amax)
    shape = _canonical_shape(reader, p)
    path = str(reader.files[p.tensors[0]])
    ws, ws2 = scale_name(p.name, "weight_scale"), scale_name(p.name, "weight_scale_2")
    if fmt is Format.FP8:
        outputs = [TensorInfo(p.name, torch.float8_e4m3fn, shape), TensorInfo(ws, torch.float32, ())]
    else:
        outputs = [
            TensorInfo(p.name, torch.uint8, shape[:-1] + (shape[-1] // 2,)),
            TensorInfo(ws, torch.float8_e4m3fn, shape[:-1] + (shape[-1] // NVFP4_BLOCK,)),
            TensorInfo(ws2, torch.float32, ()),
        ]
    if input_amax is not None:
        outputs.append(TensorInfo(scale_name(p.name, "input_scale"), torch.float32, ()))

    def pieces() -> Iterator[Piece]:
        encode = fp8_encode if fmt is Format.FP8 else nvfp4_encode
        for chunk in _canonical_chunks(reader, p, _rows_per_chunk(shape, False)):
            yield from zip((o.name for o in outputs), encode(chunk, name=p.name, path=path))
        if input_amax is not None:
            yield outputs[-1].name, _input_scale(fmt, input_amax)

    return Job(outputs, pieces)


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """``[k, a, b]`` -> contiguous ``[k, b, a]``. CPU uint8 (FP4 codes, E4M3 scale bytes) goes through
    OpenCV's SIMD transpose, one ``[a, b]`` slice at a time: about 10 GB/s on this host against 2.5 GB/s
    for cache-sized numpy tiles and 1.4 GB/s for torch, and it releases the GIL like the numpy copies."""
    if t.dtype != torch.uint8 or t.device.type != "cpu" or t.numel() == 0:
        return t.transpose(-1, -2).contiguous()
    import cv2  # imported here: only the NVFP4 expert path needs it

    src = t.contiguous().numpy()
    out = np.empty(src.shape[:1] + src.shape[:0:-1], dtype=np.uint8)
    for i in range(src.shape[0]):
        cv2.transpose(src[i], dst=out[i])
    return torch.from_numpy(out)


ENCODE_THREADS = 2  # expert chunks encoded at once (numpy releases the GIL in its copies)


def ordered_map(fn, args: Iterable[tuple], threads: int) -> Iterator:
    """``fn(*a)`` for each ``a`` of ``args``, on ``threads`` threads, yielded in order; at most
    ``2 * threads`` results wait, so memory stays bounded however slow the consumer is."""
    with ThreadPoolExecutor(threads) as pool:
        pending: deque[Future] = deque()
        for a in args:
            pending.append(pool.submit(fn, *a))
            if len(pending) >= 2 * threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _experts_to_nvfp4(reader: ShardedReader, p: SourceParam, input_amax: float | None) -> Job:
    """gpt-oss experts in NVFP4, written ``[E, in/2, out]`` with a scalar global scale.

    TensorRT-LLM's gpt-oss NVFP4 loader (``modeling_gpt_oss.load_nvfp4_weights``) reads experts as
    ``[E, in/2, out]`` codes + ``[E, in/16, out]`` block scales and ``.reshape([])``s
    ``*_weight_scale_2`` / ``*_input_scale``: one fp32 scalar per fused tensor, not one per expert.
    So the global scale is computed over all experts first (pass 1: from an MXFP4 source's scales,
    reading blocks only where needed), then experts are encoded in the codecs' ``[k, out, in]`` layout
    chunk by chunk, ``ENCODE_THREADS`` chunks at once, and transposed on the way out (pass 2).
    """
    shape = _canonical_shape(reader, p)  # [E, out, in]
    e, out, inp = shape
    path = str(reader.files[p.tensors[0]])
    ws, ws2 = scale_name(p.name, "weight_scale"), scale_name(p.name, "weight_scale_2")
    outputs = [
        TensorInfo(p.name, torch.uint8, (e, inp // 2, out)),
        TensorInfo(ws, torch.float8_e4m3fn, (e, inp // NVFP4_BLOCK, out)),
        TensorInfo(ws2, torch.float32, ()),
    ]
    if input_amax is not None:
        outputs.append(TensorInfo(scale_name(p.name, "input_scale"), torch.float32, ()))
    rows = _rows_per_chunk(shape, True)

    def nvfp4_pieces(codes: torch.Tensor, block_scales: torch.Tensor) -> Iterator[Piece]:
        """Codes and E4M3 block scales of ``[k, out, in/...]`` experts, written ``[k, in/..., out]``."""
        yield p.name, _transposed(codes)
        yield ws, _transposed(block_scales.view(torch.uint8)).view(torch.float8_e4m3fn)

    def pieces() -> Iterator[Piece]:
        if p.mxfp4:  # power-of-two global from the layer-wide largest block exponent: codes stay exact
            # pass 1 reads the scales and maps the blocks, touching only those it must look at
            log2 = max((mxfp4_global_log2(reader.mapped(p.tensors[0], a, b), reader.read(p.tensors[1], a, b),
                                          name=p.name, path=path) for a, b in _row_ranges(e, rows)), default=-126)

            def encode(a: int, b: int) -> list[Piece]:
                blocks, scales = reader.read(p.tensors[0], a, b), reader.read(p.tensors[1], a, b)
                if COPY_EXACT_FP4:
                    rescale = mxfp4_to_nvfp4_scales(blocks, scales, global_log2=log2, name=p.name, path=path)
                    if rescale.exact:  # codes unchanged: the source bytes, transposed
                        return list(nvfp4_pieces(blocks.flatten(-2), rescale.weight_scale))
                q = mxfp4_to_nvfp4(blocks, scales, global_log2=log2, name=p.name, path=path)
                return list(nvfp4_pieces(q.weight, q.weight_scale))

            for chunk_pieces in ordered_map(encode, _row_ranges(e, rows), ENCODE_THREADS):
                yield from chunk_pieces
            yield ws2, pow2(torch.tensor(log2))
        else:
            amax = torch.zeros((), dtype=torch.float32)
            for chunk in _canonical_chunks(reader, p, rows):
                require_finite(chunk, p.name, path)
                amax = torch.maximum(amax, chunk.abs().amax() if chunk.numel() else amax)
            global_scale = scale_from_amax(amax, E2M1_MAX * E4M3_MAX)
            for chunk in _canonical_chunks(reader, p, rows):
                q = nvfp4_encode(chunk, global_scale=global_scale, name=p.name, path=path)
                yield from nvfp4_pieces(q.weight, q.weight_scale)
            yield ws2, global_scale
        if input_amax is not None:
            yield outputs[-1].name, _input_scale(Format.NVFP4, input_amax)

    return Job(outputs, pieces)


def plan_job(reader: ShardedReader, p: SourceParam, fmt: Format, input_amax: float | None = None) -> Job:
    """How source parameter ``p`` becomes output tensors in format ``fmt``."""
    if fmt is Format.BF16:
        return _to_bf16(reader, p) if p.mxfp4 else _passthrough(reader, p.tensors)
    if fmt is Format.MXFP4:
        return _passthrough(reader, p.tensors) if p.mxfp4 else _to_mxfp4(reader, p)
    return _to_scaled(reader, p, fmt, input_amax)


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
