"""Codec tests: exhaustive code tables against the format specs, round trips, and error bounds.

Error bounds checked (per element x of a block with absolute max b):

* FP8 (scale s = amax/448): |x - dq| <= max(2**-4 |x|, 2**-10 s)  (half an E4M3 ulp, normal/subnormal).
* MXFP4 (block exponent e): |x - dq| <= 2**e, and 2**e < b/3 unless e is clamped at -127.
* NVFP4 (global g = amax/2688): |x - dq| <= b/6 * (1 + 2**-4) + 7 * 2**-10 * g.
  Proof sketch: the E4M3 block scale s_b = t + d with t = b/(6g), |d| <= max(2**-4 t, 2**-10).
  With S = s_b g, |x - q S| <= |x - clip(x/S) S| + |clip(x/S) - q| S <= 6 g |d| + S (the E2M1
  half-spacing is at most 1), which is <= S <= b/6 (1 + 2**-4) when t is normal (no clipping
  beyond 6.4, error <= 0.4 S) and <= b/6 + 7 g 2**-10 otherwise.
* MXFP4 -> NVFP4: exact when all non-zero block exponents of a tensor lie within 17 of the largest;
  otherwise the NVFP4 bound above, measured against the exactly decoded MXFP4 source.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_dflash.errors import InputError
from trtllm_dflash.quant import codecs
from trtllm_dflash.quant.codecs import (
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    fp8_decode,
    fp8_encode,
    mxfp4_decode,
    mxfp4_encode,
    mxfp4_to_nvfp4,
    nvfp4_decode,
    nvfp4_encode,
    pack_fp4,
    unpack_fp4,
)

FUZZ = settings(max_examples=40, deadline=None)


def spec_e4m3(code: int) -> float:
    """OCP FP8 E4M3 (fn): 1 sign, 4 exponent (bias 7), 3 mantissa bits; S.1111.111 is NaN, no inf."""
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * (man / 8) * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def spec_e2m1(code: int) -> float:
    """OCP FP4 E2M1: 1 sign, 2 exponent (bias 1), 1 mantissa bit; no inf/NaN."""
    sign = -1.0 if code & 0x8 else 1.0
    exp, man = (code >> 1) & 0x3, code & 0x1
    if exp == 0:
        return sign * (man / 2)
    return sign * (1 + man / 2) * 2.0 ** (exp - 1)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a, b) or ((a == b) | (a.isnan() & b.isnan())).all())


# ----------------------------------------------------------------------------------------------
# code tables


def test_every_e4m3_code_decodes_to_spec():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    got = fp8_decode(codes, torch.tensor(1.0))
    want = torch.tensor([spec_e4m3(c) for c in range(256)], dtype=torch.float32)
    assert same_values(got, want)
    assert got[0x80].item() == 0.0 and torch.signbit(got[0x80])  # -0


def test_every_e2m1_code_decodes_to_spec_and_round_trips():
    codes = torch.arange(16, dtype=torch.uint8)
    values = e2m1_decode(codes)
    assert same_values(values, torch.tensor([spec_e2m1(c) for c in range(16)]))
    assert torch.equal(e2m1_encode(values), codes)  # including -0 -> code 8


def test_e2m1_rounds_half_to_even_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 1e9, -0.3, -5.1])
    assert e2m1_decode(e2m1_encode(x)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.5, -6.0]


def test_e2m1_matches_ml_dtypes_rounding():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3
    want = torch.from_numpy(x.numpy().astype(ml_dtypes.float4_e2m1fn).astype("float32"))
    assert torch.equal(e2m1_decode(e2m1_encode(x)), want)


def test_e8m0_table_is_exact_powers_of_two():
    got = e8m0_decode(torch.arange(256, dtype=torch.uint8))
    want = [2.0 ** (s - 127) for s in range(255)] + [math.nan]
    assert same_values(got, torch.tensor(want, dtype=torch.float32))
    torch_e8m0 = torch.arange(255, dtype=torch.uint8).view(torch.float8_e8m0fnu).float()
    assert torch.equal(got[:255], torch_e8m0)


def test_pack_low_nibble_is_even_element():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(unpack_fp4(packed), codes)


# ----------------------------------------------------------------------------------------------
# FP8


def test_fp8_is_bit_exact_with_torch_cast():
    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(1)) * 5
    q, scale = fp8_encode(x)
    assert scale.item() == pytest.approx(x.abs().max().item() / 448, rel=1e-7)
    assert torch.equal(q.view(torch.uint8), (x / scale).to(torch.float8_e4m3fn).view(torch.uint8))


def test_fp8_per_channel_scales_and_round_trip():
    x = torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(2)) * torch.tensor([1e-3, 1.0, 1e3]).view(3, 1, 1)
    q, scale = fp8_encode(x, scale_dims=1)
    assert scale.shape == (3,)
    dq = fp8_decode(q, scale)
    assert ((x - dq).abs() <= torch.maximum(x.abs() * 2**-4, scale.view(3, 1, 1) * 2**-10)).all()
    q2, scale2 = fp8_encode(dq, scale_dims=1)  # decoded values re-encode to the same bytes
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale2, scale)


# ----------------------------------------------------------------------------------------------
# MXFP4


def mxfp4_bound(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return e8m0_decode(scales).repeat_interleave(32, dim=-1)


def test_mxfp4_layout_and_error_bound():
    x = torch.randn(4, 24, 96, generator=torch.Generator().manual_seed(3))
    blocks, scales = mxfp4_encode(x)
    assert blocks.shape == (4, 24, 3, 16) and blocks.dtype == torch.uint8
    assert scales.shape == (4, 24, 3) and scales.dtype == torch.uint8
    dq = mxfp4_decode(blocks, scales)
    assert dq.shape == x.shape
    assert ((x - dq).abs() <= mxfp4_bound(x, scales)).all()
    block_amax = x.unflatten(-1, (-1, 32)).abs().amax(-1)
    assert (e8m0_decode(scales) < block_amax / 3).all()


def test_mxfp4_decode_is_exact_and_reencode_is_lossless():
    g = torch.Generator().manual_seed(4)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 140, (3, 8, 2), dtype=torch.uint8, generator=g)
    dq = mxfp4_decode(blocks, scales)
    codes = unpack_fp4(blocks)  # [..., in/32, 32]
    manual = torch.tensor([spec_e2m1(c) for c in range(16)])[codes.long()] * (2.0 ** (scales.double() - 127)).float().unsqueeze(-1)
    assert torch.equal(dq, manual.flatten(-2))
    assert torch.equal(mxfp4_decode(*mxfp4_encode(dq)), dq)
    assert torch.equal(mxfp4_decode(blocks, scales, dtype=torch.bfloat16).float(), dq)  # bf16 holds MXFP4 exactly


def test_mxfp4_all_zero_blocks():
    x = torch.zeros(2, 64)
    x[1, 32:] = 1.0
    blocks, scales = mxfp4_encode(x)
    assert (blocks[0] == 0).all() and (scales[0] == 0).all() and scales[1, 0] == 0
    assert torch.equal(mxfp4_decode(blocks, scales), x)


# ----------------------------------------------------------------------------------------------
# NVFP4


def nvfp4_bound(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    block_amax = x.unflatten(-1, (-1, 16)).abs().amax(-1, keepdim=True)
    g = global_scale.reshape(global_scale.shape + (1,) * (x.dim() + 1 - global_scale.dim()))
    bound = block_amax / 6 * (1 + 2**-4) + 7 * 2**-10 * g
    return (bound * (1 + 1e-6)).expand(*x.shape[:-1], -1, 16).flatten(-2)


def test_nvfp4_layout_and_error_bound():
    x = torch.randn(6, 32, 64, generator=torch.Generator().manual_seed(5)) * 0.02
    t = nvfp4_encode(x, scale_dims=1)
    assert t.weight.shape == (6, 32, 32) and t.weight.dtype == torch.uint8
    assert t.weight_scale.shape == (6, 32, 4) and t.weight_scale.dtype == torch.float8_e4m3fn
    assert t.weight_scale_2.shape == (6,) and t.weight_scale_2.dtype == torch.float32
    torch.testing.assert_close(t.weight_scale_2, x.abs().amax((1, 2)) / (6 * 448))
    dq = nvfp4_decode(*t)
    assert ((x - dq).abs() <= nvfp4_bound(x, t.weight_scale_2)).all()


def test_nvfp4_zero_tensor_and_zero_blocks():
    x = torch.zeros(4, 32)
    x[0, :16] = torch.linspace(-1, 1, 16)
    t = nvfp4_encode(x)
    dq = nvfp4_decode(*t)
    assert (dq[1:] == 0).all() and (t.weight[1:] == 0).all()
    assert torch.equal(nvfp4_decode(*nvfp4_encode(torch.zeros(2, 16))), torch.zeros(2, 16))


# ----------------------------------------------------------------------------------------------
# MXFP4 -> NVFP4


def test_mxfp4_to_nvfp4_is_exact_for_realistic_scales():
    g = torch.Generator().manual_seed(6)
    blocks = torch.randint(0, 256, (4, 16, 3, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 128, (4, 16, 3), dtype=torch.uint8, generator=g)  # span 17
    t = mxfp4_to_nvfp4(blocks, scales, scale_dims=1)
    assert t.weight.shape == (4, 16, 48) and t.weight_scale.shape == (4, 16, 6) and t.weight_scale_2.shape == (4,)
    assert torch.equal(nvfp4_decode(*t), mxfp4_decode(blocks, scales))
    assert torch.equal(t.weight, blocks.flatten(-2))  # codes re-used byte for byte


def test_mxfp4_to_nvfp4_wide_scale_span_obeys_nvfp4_bound():
    g = torch.Generator().manual_seed(7)
    blocks = torch.randint(0, 256, (2, 8, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(60, 140, (2, 8, 4), dtype=torch.uint8, generator=g)  # span 80 binades
    source = mxfp4_decode(blocks, scales)
    t = mxfp4_to_nvfp4(blocks, scales, scale_dims=1)
    err = (nvfp4_decode(*t) - source).abs()
    assert (err <= nvfp4_bound(source, t.weight_scale_2)).all()
    in_range = (scales.int() >= scales.int().amax((1, 2), keepdim=True) - 17).repeat_interleave(32, -1)
    assert (err[in_range] == 0).all()


def rescale_on_path(blocks, scales, scale_dims, use_numpy):
    """The numpy or the torch rescale, with the non-zero-block test of the same path."""
    rescale = codecs._rescale_numpy if use_numpy else codecs._rescale_torch
    return rescale(scales, codecs._nonzero_blocks(blocks, use_numpy), scale_dims)


def same_rescale(a: codecs.MXFP4Rescale, b: codecs.MXFP4Rescale) -> bool:
    as_bytes = [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in (*a[:3], *b[:3])]
    return a.exact == b.exact and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y) for x, y in zip(as_bytes[:3], as_bytes[3:])
    )


@pytest.mark.parametrize("lead", [(3,), (2, 3), (70, 2)])  # (70, 2) with scale_dims=1: >64 groups
def test_mxfp4_to_nvfp4_scales_numpy_matches_torch(lead):
    """The CPU (numpy) scale path and the any-device torch path give identical bytes: zero blocks,
    sign-only (-0) blocks, scale bytes 0 and 254, spans inside and beyond E4M3's range."""
    g = torch.Generator().manual_seed(len(lead) * 100 + lead[0])
    for trial in range(20):
        lo = int(torch.randint(0, 240, (), generator=g))
        hi = min(255, lo + int(torch.randint(1, 40, (), generator=g)))
        blocks = torch.randint(0, 256, lead + (5, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(lo, hi, lead + (5,), dtype=torch.uint8, generator=g)
        pick = torch.rand(lead + (5,), generator=g)
        blocks[pick < 0.2] = 0
        blocks[(pick >= 0.2) & (pick < 0.3)] = 0x88
        if trial == 0:
            scales.view(-1)[0], scales.view(-1)[-1] = 0, 254
        for scale_dims in range(len(lead) + 1):
            fast = rescale_on_path(blocks, scales, scale_dims, use_numpy=True)
            assert same_rescale(fast, rescale_on_path(blocks, scales, scale_dims, use_numpy=False)), (trial, scale_dims)
            assert fast.exact == (not bool(fast.out_of_range.any()))


@pytest.mark.parametrize("segment", [1, 7, 64])
def test_nonzero_blocks_segments_match_torch(monkeypatch, segment):
    """The numpy non-zero test works a segment of blocks at a time: segment edges (a short last
    segment, one block per segment) give the same answer as the torch test of the whole tensor."""
    monkeypatch.setattr(codecs, "NONZERO_SEGMENT", segment)
    g = torch.Generator().manual_seed(segment)
    blocks = torch.randint(0, 256, (3, 50, 16), dtype=torch.uint8, generator=g)
    pick = torch.rand(3, 50, generator=g)
    blocks[pick < 0.3] = 0
    blocks[(pick >= 0.3) & (pick < 0.4)] = 0x88  # sign bits only: -0 everywhere, still a zero block
    fast = codecs._nonzero_blocks(blocks, use_numpy=True)
    assert torch.equal(torch.from_numpy(fast), codecs._nonzero_blocks(blocks, use_numpy=False))
    assert 0 < int(fast.sum()) < fast.size


def test_mxfp4_to_nvfp4_scales_flag_exact_chunks():
    g = torch.Generator().manual_seed(8)
    blocks = torch.randint(0, 256, (2, 4, 3, 16), dtype=torch.uint8, generator=g) | 0x11  # every block non-zero
    scales = torch.full((2, 4, 3), 120, dtype=torch.uint8)
    assert codecs.mxfp4_to_nvfp4_scales(blocks, scales, scale_dims=1).exact
    scales[1, 0, 0] = 120 - 18  # one binade below E4M3's smallest subnormal under expert 1's global scale
    r = codecs.mxfp4_to_nvfp4_scales(blocks, scales, scale_dims=1)
    assert not r.exact and r.out_of_range.nonzero().tolist() == [[1, 0, 0]]
    t = mxfp4_to_nvfp4(blocks, scales, scale_dims=1)
    assert torch.equal(t.weight[0], blocks[0].flatten(-2))  # expert 0 keeps its codes
    with pytest.raises(InputError, match="255"):
        codecs.mxfp4_to_nvfp4_scales(blocks, torch.full_like(scales, 255), scale_dims=1)


@pytest.mark.parametrize("device_path", ["numpy", "torch"])
def test_mxfp4_global_log2_chunked_matches_whole_tensor(device_path, monkeypatch):
    """One global scale per fused tensor (TensorRT-LLM's gpt-oss loader reads a scalar): the maximum
    of per-chunk mxfp4_global_log2 equals the whole tensor's scale_dims=0 global, and a given
    global_log2 reproduces the whole-tensor rescale chunk by chunk, on both code paths."""
    if device_path == "torch":
        check = codecs._check_scales_pick_numpy  # still refuses NaN scales, then takes the torch path
        monkeypatch.setattr(codecs, "_check_scales_pick_numpy", lambda *args: check(*args) and False)
    g = torch.Generator().manual_seed(21)
    blocks = torch.randint(0, 256, (4, 6, 5, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(124, 131, (4, 6, 5), dtype=torch.uint8, generator=g)
    blocks[1] = 0
    scales[1] = 200  # an all-zero expert with a huge scale byte must not move the global
    blocks[3, 0, 0] = 0x11
    scales[3, 0, 0] = 140  # expert 3 holds the largest non-zero block
    scales[0, 0, 0] = 140 - 19  # beyond E4M3's range under the layer-wide global
    whole = codecs.mxfp4_to_nvfp4_scales(blocks, scales, scale_dims=0)
    log2 = max(codecs.mxfp4_global_log2(blocks[i:i + 1], scales[i:i + 1]) for i in range(4))
    assert log2 == 140 - 127 - 8 and whole.weight_scale_2.item() == 2.0 ** log2
    parts = [codecs.mxfp4_to_nvfp4_scales(blocks[i:i + 1], scales[i:i + 1], global_log2=log2) for i in range(4)]
    assert torch.equal(torch.cat([r.weight_scale.view(torch.uint8) for r in parts]), whole.weight_scale.view(torch.uint8))
    assert [r.exact for r in parts] == [False, True, True, True] and not whole.exact
    t = mxfp4_to_nvfp4(blocks, scales, global_log2=log2)
    assert t.weight_scale_2.shape == () and torch.equal(nvfp4_decode(*t)[1:], mxfp4_decode(blocks, scales)[1:])
    assert codecs.mxfp4_global_log2(torch.zeros(2, 3, 1, 16, dtype=torch.uint8), torch.zeros(2, 3, 1, dtype=torch.uint8)) == -126
    with pytest.raises(InputError, match="255"):
        codecs.mxfp4_global_log2(blocks, torch.full_like(scales, 255))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), zero_fraction=st.sampled_from([0.0, 0.5, 0.95, 1.0]),
       segment=st.sampled_from([1, 5, 2**16]), batch=st.sampled_from([1, 3, 64]))
def test_mxfp4_global_log2_equals_the_exhaustive_rule(seed, zero_fraction, segment, batch):
    """The candidate search (largest scale byte first, a segment of scales and a batch of blocks at a time) gives the
    rule's value: the largest scale byte of a block with any magnitude bit set. Zero blocks (sign
    bits only, -0) sit at the largest scales on purpose."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (3, 7, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 255, (3, 7, 4), dtype=torch.uint8, generator=g)
    zero = torch.rand(scales.shape, generator=g) < zero_fraction
    blocks[zero] = torch.tensor([0x00, 0x08, 0x80, 0x88], dtype=torch.uint8)[torch.randint(0, 4, (int(zero.sum()), 16), generator=g)]
    scales[zero] = torch.randint(200, 255, (int(zero.sum()),), dtype=torch.uint8, generator=g)
    nonzero = (blocks & 0x77).flatten(-1).amax(-1) > 0
    emax = int((scales.int() * nonzero).max()) - 127
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(codecs, "GLOBAL_LOG2_SEGMENT", segment)
        patch.setattr(codecs, "GLOBAL_LOG2_BATCH", batch)
        assert codecs.mxfp4_global_log2(blocks, scales) == min(max(emax - 8, -126), 127)


# ----------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("encode", [fp8_encode, nvfp4_encode, mxfp4_encode])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_names_the_tensor(encode, bad):
    x = torch.ones(2, 32)
    x[1, 5] = bad
    with pytest.raises(InputError, match=r"model.safetensors: field 'layers.0.w'.*\(1, 5\)"):
        encode(x, name="layers.0.w", path="model.safetensors")


def test_nan_e8m0_scale_is_rejected():
    with pytest.raises(InputError, match="255"):
        mxfp4_decode(torch.zeros(1, 1, 16, dtype=torch.uint8), torch.full((1, 1), 255, dtype=torch.uint8))


def test_block_size_mismatch_is_an_input_error():
    with pytest.raises(InputError, match="multiple of 16"):
        nvfp4_encode(torch.ones(3, 24), name="w")


# ----------------------------------------------------------------------------------------------
# fuzzing


@st.composite
def weights(draw, block: int) -> torch.Tensor:
    """Random shapes, magnitudes from 2**-140 (fp32 subnormal) to 2**60, exact zeros, sign flips."""
    rows, lead, nblocks = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, lead, nblocks * block, generator=g)
    exponent = draw(st.sampled_from([-140, -130, -100, -20, 0, 20, 60]))
    x = x * 2.0**exponent
    zero_fraction = draw(st.sampled_from([0.0, 0.5, 1.0]))
    x[torch.rand(x.shape, generator=g) < zero_fraction] = 0.0
    return x


@FUZZ
@given(weights(16))
def test_fuzz_nvfp4_bound(x):
    t = nvfp4_encode(x, scale_dims=1)
    assert ((x - nvfp4_decode(*t)).abs() <= nvfp4_bound(x, t.weight_scale_2)).all()


@FUZZ
@given(weights(32))
def test_fuzz_mxfp4_bound_and_idempotence(x):
    blocks, scales = mxfp4_encode(x)
    dq = mxfp4_decode(blocks, scales)
    assert ((x - dq).abs() <= mxfp4_bound(x, scales)).all()
    assert torch.equal(mxfp4_decode(*mxfp4_encode(dq)), dq)


@FUZZ
@given(weights(16))
def test_fuzz_fp8_bound(x):
    q, scale = fp8_encode(x, scale_dims=1)
    s = scale.view(-1, 1, 1)
    assert ((x - fp8_decode(q, scale)).abs() <= torch.maximum(x.abs() * 2**-4, s * 2**-10)).all()


@FUZZ
@given(weights(32))
def test_fuzz_mxfp4_to_nvfp4(x):
    blocks, scales = mxfp4_encode(x)
    source = mxfp4_decode(blocks, scales)
    t = mxfp4_to_nvfp4(blocks, scales, scale_dims=1)
    assert ((nvfp4_decode(*t) - source).abs() <= nvfp4_bound(source, t.weight_scale_2)).all()


@FUZZ
@given(weights(32), st.integers(0, 2))
def test_fuzz_mxfp4_to_nvfp4_scales_numpy_matches_torch(x, scale_dims):
    blocks, scales = mxfp4_encode(x)
    assert same_rescale(rescale_on_path(blocks, scales, scale_dims, use_numpy=True),
                        rescale_on_path(blocks, scales, scale_dims, use_numpy=False))


@FUZZ
@given(weights(32), st.sampled_from([math.nan, math.inf]))
def test_fuzz_non_finite_always_rejected(x, bad):
    x.view(-1)[x.numel() // 2] = bad
    for encode in (fp8_encode, nvfp4_encode, mxfp4_encode):
        with pytest.raises(InputError, match="non-finite"):
            encode(x, name="w")
