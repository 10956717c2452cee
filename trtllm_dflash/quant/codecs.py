"""Low-precision weight codecs: FP8 E4M3, FP4 E2M1, NVFP4, MXFP4 (pure torch, any device).

Conventions shared by every codec here:

* Weights are ``[..., out, in]`` and blocks run along the LAST (input) dimension, the dimension a
  GEMM contracts over, so one block scale multiplies a contiguous run of products.
* FP4 codes pack two per byte, **low nibble = even element** (gpt-oss MXFP4 and ModelOpt NVFP4 agree).
* ``scale_dims`` = how many leading dimensions get their own global (per-tensor) scale:
  0 -> one scale for the tensor; 1 on ``[out, in]`` -> per output channel; 1 on ``[E, out, in]``
  -> one per expert.
* Non-finite input raises :class:`InputError` naming the tensor (``name``) and file (``path``),
  because a NaN weight silently poisons every block that shares its scale.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from trtllm_dflash.errors import InputError

E4M3_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
E8M0_BIAS = 127
_TINY = torch.finfo(torch.float32).tiny  # 2**-126: floor for global scales, so 0 / tiny never divides by 0

# E2M1 value of each 4-bit code: bit 3 = sign, bits 2-1 = exponent (bias 1), bit 0 = mantissa.
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Rounding thresholds on |x| between consecutive magnitudes, with the tie direction that gives
# round-half-to-even (ties go to the code with mantissa bit 0): strict '>' rounds ties down.
_E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


class NVFP4Tensor(NamedTuple):
    """NVFP4 weight in ModelOpt unified-checkpoint form.

    ``weight`` uint8 ``[..., in/2]`` (packed E2M1), ``weight_scale`` float8_e4m3fn ``[..., in/16]``,
    ``weight_scale_2`` float32 of shape ``lead[:scale_dims]``. Value = e2m1 * weight_scale * weight_scale_2.
    """

    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_scale_2: torch.Tensor


class FP8Tensor(NamedTuple):
    """FP8 weight: ``weight`` float8_e4m3fn, ``weight_scale`` float32 of shape ``shape[:scale_dims]``."""

    weight: torch.Tensor
    weight_scale: torch.Tensor


# ----------------------------------------------------------------------------------------------
# shared helpers


def require_finite(x: torch.Tensor, name: str = "tensor", path: str | None = None) -> None:
    """Raise InputError if ``x`` holds NaN or inf, saying where the first bad element is."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        count = int(bad.sum())
        first = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise InputError(
            f"{count} non-finite value(s) (first at index {first}: {x[first].item()}); "
            "quantization needs finite weights",
            path=path,
            field=name,
        )


def _require_last_dim(x: torch.Tensor, multiple: int, name: str, path: str | None) -> None:
    if x.dim() == 0 or x.shape[-1] % multiple:
        raise InputError(
            f"last dimension of shape {tuple(x.shape)} must be a multiple of {multiple}", path=path, field=name
        )


def _expand_scale(scale: torch.Tensor, ndim: int) -> torch.Tensor:
    """Append singleton dims so a ``shape[:scale_dims]`` scale broadcasts over a ``ndim`` tensor."""
    return scale.reshape(scale.shape + (1,) * (ndim - scale.dim()))


def scale_from_amax(amax: torch.Tensor, divisor: float) -> torch.Tensor:
    """``amax / divisor`` floored at 2**-126, correctly rounded on every device.

    The divisor is a full tensor on purpose: torch's CUDA kernels divide by a scalar as a multiply by
    its reciprocal, which is 1 ulp off for some amax values and made CUDA scales differ from CPU ones.
    """
    return (amax / torch.full_like(amax, divisor)).clamp_min(_TINY)


def _global_scale(x: torch.Tensor, scale_dims: int, divisor: float) -> torch.Tensor:
    """:func:`scale_from_amax` of ``amax(|x|)`` per ``scale_dims`` group (fp32, shape ``x.shape[:scale_dims]``)."""
    return scale_from_amax(x.reshape(x.shape[:scale_dims] + (-1,)).abs().amax(dim=-1).float(), divisor)


# ----------------------------------------------------------------------------------------------
# FP8 E4M3


def fp8_encode(x: torch.Tensor, *, scale_dims: int = 0, name: str = "tensor", path: str | None = None) -> FP8Tensor:
    """Quantize to float8_e4m3fn with ``scale = amax / 448`` per ``scale_dims`` group.

    The cast itself is torch's (round-to-nearest-even), so results are bit-exact with
    ``(x / scale).to(torch.float8_e4m3fn)``; values are clamped to +-448 first because an
    out-of-range cast is NaN on some devices.
    """
    require_finite(x, name, path)
    x = x.float()
    scale = _global_scale(x, scale_dims, E4M3_MAX)
    q = (x / _expand_scale(scale, x.dim())).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return FP8Tensor(q, scale)


def fp8_decode(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`fp8_encode`: ``weight * weight_scale`` (scale broadcast over trailing dims)."""
    return (weight.float() * _expand_scale(weight_scale.float(), weight.dim())).to(dtype)


# ----------------------------------------------------------------------------------------------
# FP4 E2M1 codes and nibble packing


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to E2M1 codes (uint8 0..15), round-half-to-even, saturating at +-6.

    Counting thresholds passed keeps it branch-free and device-agnostic. The sign comes from the
    sign bit, so -0.0 and tiny negatives give code 8 (-0), which decodes to -0.0.
    """
    a = x.abs()
    mag = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for threshold, tie_up in _E2M1_THRESHOLDS:
        mag += (a >= threshold) if tie_up else (a > threshold)
    return mag | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (any integer dtype, values 0..15) -> fp32 values (exact)."""
    lut = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return lut[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` codes -> ``[..., n/2]`` uint8 with the even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: ``[..., n/2]`` uint8 -> ``[..., n]`` codes."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


# ----------------------------------------------------------------------------------------------
# NVFP4: 16-element blocks, E4M3 block scale, fp32 global scale


def nvfp4_encode(
    x: torch.Tensor,
    *,
    scale_dims: int = 0,
    global_scale: torch.Tensor | None = None,
    name: str = "tensor",
    path: str | None = None,
) -> NVFP4Tensor:
    """Quantize ``[..., in]`` (in % 16 == 0) to NVFP4.

    ``weight_scale_2 = amax / (6 * 448)`` per ``scale_dims`` group (floored at 2**-126 so an all-zero
    or denormal tensor still has a usable scale) unless ``global_scale`` is given; block scale
    ``= e4m3(block_amax / (6 * weight_scale_2))``. Elements are divided by the *decoded* scale, so
    encode and decode agree exactly on what each code means.

    Error bound (proved in tests/test_quant_codecs.py): per element of a block with amax ``b``,
    ``|x - dq| <= b/6 * (1 + 2**-4) + 7 * 2**-10 * weight_scale_2``.
    """
    require_finite(x, name, path)
    _require_last_dim(x, NVFP4_BLOCK, name, path)
    x = x.float()
    if global_scale is None:
        global_scale = _global_scale(x, scale_dims, E2M1_MAX * E4M3_MAX)
    g = _expand_scale(global_scale.float(), x.dim() + 1)
    blocks = x.unflatten(-1, (-1, NVFP4_BLOCK))
    block_amax = blocks.abs().amax(dim=-1, keepdim=True)
    block_scale = (block_amax / (E2M1_MAX * g)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    decoded_scale = block_scale.float() * g
    # divide (not multiply by 1/S): 1/S overflows when S is an fp32 subnormal
    scaled = torch.where(decoded_scale > 0, blocks / decoded_scale, torch.zeros_like(blocks))
    codes = e2m1_encode(scaled).flatten(-2)
    return NVFP4Tensor(pack_fp4(codes), block_scale.squeeze(-1), global_scale.float())


def nvfp4_decode(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of :func:`nvfp4_encode`: ``[..., in/2]`` packed + scales -> ``[..., in]`` values."""
    values = e2m1_decode(unpack_fp4(weight)).unflatten(-1, (-1, NVFP4_BLOCK))
    scale = weight_scale.float().unsqueeze(-1) * _expand_scale(weight_scale_2.float(), values.dim())
    return (values * scale).flatten(-2).to(dtype)


# ----------------------------------------------------------------------------------------------
# MXFP4: 32-element blocks, E8M0 (power-of-two) scales, gpt-oss *_blocks / *_scales layout


def pow2(k: torch.Tensor) -> torch.Tensor:
    """Exact fp32 ``2**k`` for integer ``k`` in [-127, 127], built from the bit pattern (``exp2`` is
    not guaranteed exact on every device); 2**-127 is an fp32 subnormal."""
    k = k.to(torch.int32)
    normal = ((k + E8M0_BIAS).clamp_min(0) << 23).view(torch.float32)
    return torch.where(k == -E8M0_BIAS, torch.full_like(normal, 2.0**-127), normal)


def e8m0_decode(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 ``2**(s - 127)`` exactly; byte 255 is NaN per the OCP spec."""
    s = scales.to(torch.int32)
    value = pow2(s.clamp(max=254) - E8M0_BIAS)
    return torch.where(s == 255, torch.full_like(value, float("nan")), value)


def _require_e8m0_finite(scales: torch.Tensor, name: str, path: str | None) -> None:
    if bool((scales == 255).any()):
        first = tuple(int(i) for i in torch.nonzero(scales == 255)[0])
        raise InputError(f"E8M0 scale byte 255 (NaN) at index {first}", path=path, field=name)


def mxfp4_encode(
    weight: torch.Tensor, *, name: str = "tensor", path: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``[..., out, in]`` (in % 32 == 0) to gpt-oss MXFP4.

    Returns ``(blocks, scales)``: ``blocks`` uint8 ``[..., out, in/32, 16]``, ``scales`` uint8 E8M0
    ``[..., out, in/32]``. The block exponent is the smallest ``e`` with ``block_amax <= 6 * 2**e``
    (no saturation), found exactly from ``frexp``. Bound: ``|x - dq| <= 2**e`` per element, and
    ``2**e < block_amax / 3`` unless ``e`` is clamped at -127. All-zero blocks get scale byte 0.
    """
    require_finite(weight, name, path)
    _require_last_dim(weight, MXFP4_BLOCK, name, path)
    blocks = weight.float().unflatten(-1, (-1, MXFP4_BLOCK))
    mantissa, exponent = torch.frexp(blocks.abs().amax(dim=-1))  # amax = m * 2**k, m in [0.5, 1)
    e = exponent - 3 + (mantissa > 0.75).to(exponent.dtype)  # 6 * 2**(k-3) = 0.75 * 2**k
    e = torch.where(mantissa == 0, torch.full_like(e, -E8M0_BIAS), e).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = blocks * pow2(-e).unsqueeze(-1)  # exact power-of-two rescale
    codes = e2m1_encode(scaled)
    return pack_fp4(codes), (e + E8M0_BIAS).to(torch.uint8)


def mxfp4_decode(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    *,
    name: str = "scales",
    path: str | None = None,
) -> torch.Tensor:
    """Exact inverse layout of :func:`mxfp4_encode`: ``[..., in/32, 16]`` + ``[..., in/32]`` -> ``[..., in]``.

    Exact for every scale byte <= 252 (|value| <= 6 * 2**125); larger exponents overflow fp32.
    Scale byte 255 (NaN) raises InputError.
    """
    _require_e8m0_finite(scales, name, path)
    values = e2m1_decode(unpack_fp4(blocks))  # [..., in/32, 32]
    return (values * e8m0_decode(scales).unsqueeze(-1)).flatten(-2).to(dtype)


# ----------------------------------------------------------------------------------------------
# MXFP4 -> NVFP4 re-quantization (gpt-oss experts)


class MXFP4Rescale(NamedTuple):
    """NVFP4 scales that re-express MXFP4 blocks without touching their codes (see :func:`mxfp4_to_nvfp4`).

    ``weight_scale`` float8_e4m3fn ``[..., in/16]`` (0 for all-zero blocks), ``weight_scale_2`` fp32
    ``lead[:scale_dims]`` (a power of two), ``out_of_range`` bool ``[..., in/32]``: non-zero blocks
    whose scale E4M3 cannot hold (their ``weight_scale`` is 0 here). ``exact`` = no block out of
    range: then the NVFP4 weight is the MXFP4 ``blocks`` bytes unchanged (``blocks.flatten(-2)``).
    """

    weight_scale: torch.Tensor
    weight_scale_2: torch.Tensor
    out_of_range: torch.Tensor
    exact: bool


_NIBBLE_MAGNITUDES = 0x7777777777777777  # the 3 magnitude bits of each of 16 nibbles in a word
GLOBAL_LOG2_SEGMENT = 2**16  # scales searched at once for candidate blocks by mxfp4_global_log2
GLOBAL_LOG2_BATCH = 64  # candidate blocks it reads at once
NONZERO_SEGMENT = 2**15  # MXFP4 blocks tested at once on the numpy path (256 KiB of scratch)


def _check_scales_pick_numpy(blocks: torch.Tensor, scales: torch.Tensor, name: str, path: str | None) -> bool:
    """Refuse NaN E8M0 scales (byte 255); True when the numpy path applies (CPU uint8 scales).

    CPU tensors go through numpy (no int64 temporaries: ~50x faster than the torch ops on a loaded
    2-core host); other devices use torch. Both give identical bytes (tested).
    """
    if blocks.device.type == "cpu" and scales.device.type == "cpu" and scales.dtype == torch.uint8:
        if bool((scales.contiguous().numpy() == 255).any()):
            _require_e8m0_finite(scales, name, path)  # raises, naming the first NaN scale
        return True
    _require_e8m0_finite(scales, name, path)
    return False


def _nonzero_blocks(blocks: torch.Tensor, use_numpy: bool):
    """bool ``[...]`` of ``[..., 16]`` MXFP4 blocks: does any nibble have magnitude bits set?
    Tests the 16 bytes as two 64-bit words; a numpy array on the numpy path, else a tensor."""
    if use_numpy:  # a segment at a time, in place: cache-sized temporaries, no page-fault churn
        words = blocks.contiguous().numpy().reshape(-1, 2, 8).view(np.uint64)[..., 0]  # [blocks, 2]
        nonzero = np.empty(len(words), dtype=bool)
        scratch = np.empty(min(len(words), NONZERO_SEGMENT), dtype=np.uint64)
        for start in range(0, len(words), NONZERO_SEGMENT):
            segment = words[start:start + NONZERO_SEGMENT]
            either = np.bitwise_or(segment[:, 0], segment[:, 1], out=scratch[:len(segment)])
            np.bitwise_and(either, np.uint64(_NIBBLE_MAGNITUDES), out=either)
            np.not_equal(either, 0, out=nonzero[start:start + len(segment)])
        return nonzero.reshape(blocks.shape[:-1])
    words = blocks.contiguous().view(torch.int64)
    return ((words[..., 0] | words[..., 1]) & _NIBBLE_MAGNITUDES) != 0


def _global_log2(emax):
    """``log2`` of the power-of-two NVFP4 global scale for largest non-zero block exponent ``emax``
    (an int64 numpy scalar or array, or a torch tensor): the largest block then gets scale 2**8, the
    largest power of two E4M3 holds; floored at 2**-126 like :func:`nvfp4_encode`."""
    return (emax - 8).clip(-126, 127)


def mxfp4_global_log2(blocks: torch.Tensor, scales: torch.Tensor, *, name: str = "tensor", path: str | None = None) -> int:
    """``log2`` of the power-of-two NVFP4 global scale :func:`mxfp4_to_nvfp4` picks for the WHOLE
    tensor (one scalar): ``emax - 8``, ``emax`` the largest non-zero block exponent, floored at -126.

    Computed chunk by chunk, the maximum of the per-chunk values is the value for the whole tensor
    (the rule is monotonic in ``emax``), which is how the converter gets one global per fused tensor.
    Only blocks holding the largest scale byte are looked at, a segment of scales at a time, until
    one is non-zero (on real weights, in the first segment): ``blocks`` may be a lazily read view
    (:meth:`~trtllm_dflash.checkpoints.safetensors_io.ShardedReader.mapped`), so this pass reads
    little more than the scales, a sixteenth of the tensor.
    """
    flat_scales, flat_blocks = scales.reshape(-1), blocks.reshape(-1, MXFP4_BLOCK // 2)
    remaining = flat_scales
    while remaining.numel():
        value = int(remaining.max())
        if value == 255:
            _require_e8m0_finite(scales, name, path)  # raises, naming the first NaN scale
        for start in range(0, flat_scales.numel(), GLOBAL_LOG2_SEGMENT):  # stops at the first non-zero candidate
            candidates = torch.nonzero(flat_scales[start:start + GLOBAL_LOG2_SEGMENT] == value).flatten() + start
            for batch in candidates.to(flat_blocks.device).split(GLOBAL_LOG2_BATCH):  # few pages of a mapped view
                if bool(_nonzero_blocks(flat_blocks[batch], use_numpy=False).any()):
                    return int(_global_log2(np.int64(value - E8M0_BIAS)))
        remaining = remaining[remaining < value]  # every block at this exponent is zero (rare)
    return int(_global_log2(np.int64(-E8M0_BIAS)))  # no non-zero block: the floor


def mxfp4_to_nvfp4_scales(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    *,
    scale_dims: int = 0,
    global_log2: int | None = None,
    name: str = "tensor",
    path: str | None = None,
) -> MXFP4Rescale:
    """The scale half of :func:`mxfp4_to_nvfp4`: byte arithmetic on E8M0 scales, no FP4 decode.

    ``global_log2`` (from :func:`mxfp4_global_log2` over a larger tensor) fixes one scalar global
    scale ``2**global_log2`` instead of deriving it per ``scale_dims`` group from these blocks.

    The numpy path does one 256-entry lookup per global-scale group (see ``_check_scales_pick_numpy``).
    """
    if global_log2 is not None:
        scale_dims = 0
    use_numpy = _check_scales_pick_numpy(blocks, scales, name, path)
    rescale = _rescale_numpy if use_numpy else _rescale_torch
    return rescale(scales, _nonzero_blocks(blocks, use_numpy), scale_dims, global_log2)


def _rescale_torch(scales: torch.Tensor, nonzero: torch.Tensor, scale_dims: int,
                   global_log2: int | None = None) -> MXFP4Rescale:
    # Everything below is byte arithmetic on E8M0 scale bytes s: exponent e = s - 127.
    if global_log2 is None:
        emax = (scales * nonzero).reshape(scales.shape[:scale_dims] + (-1,)).amax(dim=-1).to(torch.int64) - E8M0_BIAS
        log2_g = _global_log2(emax)
    else:
        log2_g = torch.tensor(global_log2, dtype=torch.int64, device=scales.device)
    # rel = e - log2_g, looked up (offset by 256 to be non-negative) in a table of E4M3 bytes of 2**rel
    index = scales.to(torch.int64) - _expand_scale(log2_g + E8M0_BIAS - 256, scales.dim())
    e4m3 = torch.take(_pow2_e4m3_table(scales.device), index.clamp(0, 264)) * nonzero  # clamp: all-zero blocks
    out_of_range = (e4m3 == 0) & nonzero  # below 2**-9, E4M3's smallest subnormal
    weight_scale = e4m3.repeat_interleave(2, dim=-1)
    return MXFP4Rescale(weight_scale.view(torch.float8_e4m3fn), pow2(log2_g), out_of_range, not bool(out_of_range.any()))


def _rescale_numpy(scales: torch.Tensor, nonzero: np.ndarray, scale_dims: int,
                   global_log2: int | None = None) -> MXFP4Rescale:
    """Same bytes as :func:`_rescale_torch`, in numpy on uint8 arrays."""
    s = scales.contiguous().numpy()
    lead = s.shape[:scale_dims]
    groups = math.prod(lead)
    s_g, nonzero_g = s.reshape(groups, -1), nonzero.reshape(groups, -1)
    if global_log2 is not None:
        log2_g = np.full(groups, global_log2, dtype=np.int64)
    else:
        if s_g.shape[1] == 0:  # no blocks: emax of an empty group is undefined; same as all-zero
            emax = np.full(groups, -E8M0_BIAS, dtype=np.int64)
        else:
            emax = (s_g * nonzero_g).max(axis=1).astype(np.int64) - E8M0_BIAS
        log2_g = _global_log2(emax)
    # per group, the E4M3 byte of 2**(s - 127 - log2_g) for every scale byte s (0 = not representable)
    luts = _POW2_E4M3_TABLE[np.clip(np.arange(256)[None, :] - (log2_g + E8M0_BIAS - 256)[:, None], 0, 264)]
    if groups <= 64:
        e4m3 = np.empty_like(s_g)
        for g in range(groups):
            np.take(luts[g], s_g[g], out=e4m3[g])
    else:
        e4m3 = luts[np.arange(groups)[:, None], s_g]
    e4m3 *= nonzero_g
    out_of_range = (e4m3 == 0) & nonzero_g
    # each 32-block scale serves two 16-halves: duplicate every byte ([x] -> [x, x]) via a uint16 view
    doubled = (e4m3.astype(np.uint16) * np.uint16(0x0101)).view(np.uint8)
    weight_scale = torch.from_numpy(doubled.reshape(s.shape[:-1] + (2 * s.shape[-1],)))
    global_scale = pow2(torch.from_numpy(log2_g).reshape(lead))
    return MXFP4Rescale(
        weight_scale.view(torch.float8_e4m3fn),
        global_scale,
        torch.from_numpy(out_of_range.reshape(s.shape)),
        not bool(out_of_range.any()),
    )


def mxfp4_to_nvfp4(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    *,
    scale_dims: int = 0,
    global_log2: int | None = None,
    name: str = "tensor",
    path: str | None = None,
) -> NVFP4Tensor:
    """Re-express MXFP4 ``(blocks, scales)`` as NVFP4, exactly where the formats overlap.

    An MXFP4 block is ``codes * 2**e``. With a power-of-two global scale ``2**(emax - 8)`` (``emax``
    = largest non-zero block exponent in the ``scale_dims`` group, or ``2**global_log2`` when given:
    see :func:`mxfp4_global_log2`), each 16-half gets block scale ``2**(e - emax + 8)``, an exact
    E4M3 value for ``e >= emax - 17``, and keeps its codes unchanged: zero error, and no decode on
    the hot path. Blocks further below ``emax`` (beyond E4M3's range) are decoded exactly and
    re-encoded with :func:`nvfp4_encode` under the same global scale, so they obey its error bound.
    """
    if global_log2 is not None:
        scale_dims = 0
    rescale = mxfp4_to_nvfp4_scales(blocks, scales, scale_dims=scale_dims, global_log2=global_log2, name=name, path=path)
    weight = blocks.flatten(-2)  # same nibble order: 32 codes = 16 bytes = two 8-byte NVFP4 halves
    weight_scale, global_scale = rescale.weight_scale.view(torch.uint8), rescale.weight_scale_2
    if not rescale.exact:
        fallback = nvfp4_encode(
            mxfp4_decode(blocks, scales, name=name, path=path), scale_dims=scale_dims, global_scale=global_scale, name=name, path=path
        )
        redo = rescale.out_of_range.repeat_interleave(2, dim=-1)
        weight = torch.where(redo.repeat_interleave(8, dim=-1), fallback.weight, weight)
        weight_scale = torch.where(redo, fallback.weight_scale.view(torch.uint8), weight_scale)
    return NVFP4Tensor(weight, weight_scale.view(torch.float8_e4m3fn), global_scale)


def _pow2_e4m3_table(device: torch.device) -> torch.Tensor:
    """uint8 E4M3 bit patterns of ``2**(i - 256)`` for i in [0, 265); 0 where not representable.

    Normal powers 2**-6..2**8 are ``(k + 7) << 3``; subnormals 2**-9..2**-7 are mantissa 1, 2, 4.
    """
    k = torch.arange(265, device=device) - 256
    normal = ((k + 7) << 3).clamp(0, 255)
    subnormal = torch.pow(2, (k + 9).clamp(0, 2))
    table = torch.where(k >= -6, normal, torch.where(k >= -9, subnormal, torch.zeros_like(k)))
    return table.to(torch.uint8)


_POW2_E4M3_TABLE = _pow2_e4m3_table(torch.device("cpu")).numpy()  # for the numpy path
