"""Per-tensor conversion jobs: how each source tensor of a checkpoint (a plain weight, or MXFP4 blocks and
scales) becomes the pieces of its converted form (`plan_job`), streamed a slice or a few experts at a time.
The format conventions are in `convert.py`, which orders the jobs into shards and writes them."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from fnmatch import fnmatchcase

import numpy as np
import torch

from trtllm_dflash.checkpoints.safetensors_io import FileRange, ShardedReader, TensorInfo, iter_ranges
from trtllm_dflash.errors import InputError
from trtllm_dflash.quant.codecs import (
    E2M1_MAX,
    E4M3_MAX,
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    fp8_encode,
    mxfp4_decode,
    mxfp4_encode,
    mxfp4_global_log2,
    mxfp4_to_nvfp4,
    mxfp4_to_nvfp4_scales,
    nvfp4_encode,
    pow2,
    require_finite,
    scale_from_amax,
)
from trtllm_dflash.quant.recipes import EXPERTS, Format

PIECE_BYTES = 64 * 2**20  # passthrough copy granularity
COPY_EXACT_FP4 = True  # MXFP4 -> NVFP4: reuse the FP4 code bytes (transposed), no decode (False: always the computed path)
CHUNK_ELEMENTS = 2**24  # experts decoded/encoded per step: ~64 MiB of fp32 plus temporaries

Piece = tuple[str, torch.Tensor | FileRange]


def scale_name(param: str, kind: str) -> str:
    """Sibling tensor name: ``a.q_proj.weight`` -> ``a.q_proj.weight_scale``; experts join with ``_``."""
    if param.endswith(".weight"):
        return param.removesuffix("weight") + kind
    return f"{param}_{kind}"


def is_expert(param: str) -> bool:
    return any(fnmatchcase(param, p) for p in EXPERTS)


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
