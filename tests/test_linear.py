"""`CastLinear` (frozen GEMMs laid out for the inference path, the drafter's in another dtype), which
GEMMs a narrower dtype serves, how `--drafter-gemm-dtype` resolves, and the target's LM head on
blocks of rows against the plain float32 GEMM."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.nn import functional as F

from cpu_marks import NO_FBGEMM, needs_fbgemm
from trtllm_dflash.models import linear
from trtllm_dflash.models.linear import NARROW_MIN_WEIGHTS, CastLinear, drafter_gemm_dtype, gemm_dtype
from trtllm_dflash.models.random_pair import random_target, tiny_target_config
from trtllm_dflash.models.target import GptOssTarget
from trtllm_dflash.plugins.compiled import cpu_flags
from trtllm_dflash.plugins.draft_block import cpu as draft_cpu

CPU = torch.device("cpu")


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("shape", [(16, 5), (3, 7, 64), (2, 1, 8, 64)])
def test_cast_linear_is_a_rounded_linear_in_the_input_dtype(shape, with_bias, monkeypatch):
    monkeypatch.setattr(draft_cpu, "dot_serves", lambda weight, dtype=torch.bfloat16: False)  # torch's bf16 GEMMs (tests/test_dot_gemm.py: the kernel's)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, shape[-1], generator=gen)
    bias = torch.randn(48, generator=gen) if with_bias else None
    x = torch.randn(shape, generator=gen)
    got = CastLinear(weight, bias, torch.bfloat16)(x)
    exact = F.linear(x, weight, bias)
    assert got.dtype == torch.float32 and got.shape == exact.shape
    torch.testing.assert_close(got, exact, rtol=0.03, atol=0.05 * float(exact.abs().max()))
    native = CastLinear(weight, bias, torch.bfloat16).native(x)  # the GEMM's own dtype, not cast back
    assert native.dtype == torch.bfloat16 and torch.equal(native.float(), got)
    # the same dtype in and out: the plain GEMM, to float32 rounding (MKL on the weight stored [in, out])
    plain = CastLinear(weight, bias, torch.float32)
    assert plain.weight.shape == weight.shape and plain.weight.t().is_contiguous()
    torch.testing.assert_close(plain(x), exact, rtol=1e-5, atol=1e-5)


def onednn_reorders_bf16() -> bool:
    """Whether oneDNN can lay out a bf16 weight on this CPU at all (it needs AVX-512 or AVX-NE-CONVERT,
    even where it would emulate the GEMM), so a test can force the packed path on it."""
    try:
        linear.prepack(torch.zeros(8, 8, dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return True


@pytest.mark.skipif(not onednn_reorders_bf16(), reason="oneDNN cannot reorder bf16 weights on this CPU (AVX2 only)")
@pytest.mark.parametrize("fbgemm", [True, False])
@pytest.mark.parametrize("rows", [1, 7, 15])
def test_a_packed_narrow_gemm_hands_few_rows_to_a_wider_copy(rows, fbgemm, monkeypatch):
    """Below NARROW_MIN_ROWS rows oneDNN's bf16 GEMM loses to a copy with float32 inputs: fbgemm's
    float16 one where it runs, else the float32 one."""
    if fbgemm and not linear.fbgemm_fp16():
        pytest.skip(NO_FBGEMM)
    monkeypatch.setattr(linear, "onednn_packs", lambda dtype, device: dtype == torch.bfloat16)  # any CPU
    monkeypatch.setattr(draft_cpu, "dot_serves", lambda weight, dtype=torch.bfloat16: False)  # where the compiled bf16 GEMM does not run
    monkeypatch.setattr(linear, "fbgemm_fp16", lambda: fbgemm)
    weight, bias, x = torch.randn(48, 64), torch.randn(48), torch.randn(1, rows, 64)
    layer = CastLinear(weight, bias, torch.bfloat16)
    assert layer.packed and layer.few_rows is not None and rows < linear.NARROW_MIN_ROWS
    assert layer.few_rows.dtype == (torch.float16 if fbgemm else torch.float32)
    assert layer.native(x).dtype == torch.float32
    assert torch.equal(layer(x), layer.few_rows(x))
    torch.testing.assert_close(layer(x), F.linear(x, weight.half().float() if fbgemm else weight, bias))


@needs_fbgemm
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 64), (1, 7, 64), (3, 7, 64)])
def test_float16_gemm_on_cpu_is_fbgemms_on_float16_weights_with_float32_inputs(shape, with_bias):
    """fbgemm rounds only the weight: a weight float16 holds exactly (bf16-born, like the drafter's) gives
    the float32 GEMM to accumulation rounding; any other, the GEMM of its float16 rounding."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(96, shape[-1], generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(shape, generator=gen)
    layer = CastLinear(weight, bias, torch.float16)
    assert layer.half and not layer.packed and layer.few_rows is None
    got = layer(x)
    assert got.dtype == torch.float32 and layer.native(x).dtype == torch.float32 and got.shape == (*shape[:-1], 96)
    torch.testing.assert_close(got, F.linear(x, weight.half().float(), bias), rtol=1e-5, atol=1e-5)
    exact = weight.bfloat16().float()
    torch.testing.assert_close(CastLinear(exact, bias, torch.float16)(x), F.linear(x, exact, bias), rtol=1e-5, atol=1e-5)
    sliced = torch.randn(2, 8, shape[-1], generator=gen)[:, 1:]  # the draft rows of a block, as the proposer passes them
    torch.testing.assert_close(layer(sliced), F.linear(sliced, weight.half().float(), bias), rtol=1e-5, atol=1e-5)


def test_cast_linear_passes_gradients_to_its_input():
    weight, x = torch.randn(6, 4), torch.randn(3, 4, requires_grad=True)
    CastLinear(weight, torch.zeros(6), torch.float32)(x).sum().backward()
    torch.testing.assert_close(x.grad, weight.sum(0).expand(3, -1))


def test_cast_linear_without_onednn_uses_a_bf16_weight_copy(monkeypatch):
    """Where oneDNN cannot pack (CUDA, a CPU without native bf16) the GEMM is F.linear on the copy."""
    monkeypatch.setattr(linear, "onednn_packs", lambda dtype, device: False)
    weight, x = torch.randn(16, 8), torch.randn(3, 8)
    layer = CastLinear(weight, None, torch.bfloat16)
    assert not layer.packed and layer.weight.dtype == torch.bfloat16
    torch.testing.assert_close(layer(x), F.linear(x.bfloat16(), weight.bfloat16()).float(), rtol=0.01, atol=0.01)


def test_a_narrower_gemm_dtype_serves_only_large_weights_except_fbgemms_float16(monkeypatch):
    """A small GEMM is bound by the call, not by reading its weight: without oneDNN's packing bf16 serves
    only large ones; a small one keeps its dtype, or takes fbgemm's float16 where it runs, which pays at
    every size. Where oneDNN packs bf16, every size takes it (its few-row calls go to a copy), and so where the
    compiled dot GEMM runs."""
    large, small = torch.empty(NARROW_MIN_WEIGHTS // 256, 256), torch.empty(1024, 256)
    monkeypatch.setattr(draft_cpu, "dot_kernel", lambda dtype=torch.bfloat16: None)
    monkeypatch.setattr(linear, "onednn_packs", lambda dtype, device: True)
    assert gemm_dtype(small, torch.bfloat16) == torch.bfloat16
    monkeypatch.setattr(linear, "onednn_packs", lambda dtype, device: False)
    monkeypatch.setattr(linear, "fbgemm_fp16", lambda: False)
    assert gemm_dtype(large, torch.bfloat16) == torch.bfloat16
    assert gemm_dtype(small, torch.bfloat16) == torch.float32
    assert gemm_dtype(small, None) == torch.float32
    assert gemm_dtype(small.bfloat16(), torch.float32) == torch.float32  # a wider dtype is never refused
    assert gemm_dtype(small, torch.float16) == torch.float32
    monkeypatch.setattr(linear, "fbgemm_fp16", lambda: True)
    assert gemm_dtype(large, torch.bfloat16) == torch.bfloat16
    assert gemm_dtype(small, torch.bfloat16) == torch.float16
    assert gemm_dtype(small, torch.float16) == gemm_dtype(large, torch.float16) == torch.float16
    assert gemm_dtype(small, None) == torch.float32
    assert gemm_dtype(small.to("meta"), torch.float16) == torch.float32  # not a CPU: no fbgemm
    monkeypatch.setattr(draft_cpu, "dot_kernel", lambda dtype=torch.bfloat16: object())
    assert gemm_dtype(small, torch.bfloat16) == torch.bfloat16
    assert gemm_dtype(small.to("meta"), torch.bfloat16) == torch.float32  # the dot GEMM takes CPU weights only


def test_fits_half_admits_what_float16_holds_to_float32_accuracy():
    """bf16 values in float16's range are held exactly; values below its normal range round by at most
    2^-25; random float32 values, values past 65504 and non-float32 tensors do not qualify."""
    born_bf16 = (torch.randn(64, 32) * 0.05).bfloat16().float()
    assert linear.fits_half(born_bf16)
    tiny = born_bf16.clone()
    tiny[0, :4] = torch.tensor([2.0**-20, -3 * 2.0**-22, 2.0**-30, 1.5 * 2.0**-15])
    assert linear.fits_half(tiny) and not torch.equal(tiny.half().float(), tiny)
    assert (tiny.half().float() - tiny).abs().max() <= 2.0**-25
    assert not linear.fits_half(torch.randn(64, 32))
    assert not linear.fits_half(torch.full((2, 2), 70000.0))
    assert not linear.fits_half(born_bf16.bfloat16())


def test_drafter_gemm_dtype_resolution(monkeypatch):
    monkeypatch.setattr(draft_cpu, "dot_kernel", lambda dtype=torch.bfloat16: object() if dtype == torch.int8 else None)
    assert drafter_gemm_dtype("auto", torch.float32, CPU) == torch.int8  # where the int8 dot GEMM runs
    assert drafter_gemm_dtype("auto", torch.bfloat16, CPU) is None
    monkeypatch.setattr(draft_cpu, "dot_kernel", lambda dtype=torch.bfloat16: None)
    monkeypatch.setattr(linear, "native_bf16", lambda device: True)
    assert drafter_gemm_dtype("auto", torch.float32, CPU) == torch.bfloat16
    assert drafter_gemm_dtype("auto", torch.bfloat16, CPU) is None  # already bf16: nothing to cast
    assert drafter_gemm_dtype("float32", torch.float32, CPU) is None
    assert drafter_gemm_dtype("bfloat16", torch.float32, CPU) == torch.bfloat16
    assert drafter_gemm_dtype("float32", torch.bfloat16, CPU) == torch.float32
    monkeypatch.setattr(linear, "native_bf16", lambda device: False)
    monkeypatch.setattr(linear, "fbgemm_fp16", lambda: True)
    assert drafter_gemm_dtype("auto", torch.float32, CPU) == torch.float16  # emulated bf16 would be slower
    assert drafter_gemm_dtype("auto", torch.bfloat16, CPU) is None
    assert drafter_gemm_dtype("bfloat16", torch.float32, CPU) == torch.bfloat16  # asked for: done
    assert drafter_gemm_dtype("float16", torch.float32, CPU) == torch.float16
    monkeypatch.setattr(linear, "fbgemm_fp16", lambda: False)  # e.g. an ARM build
    assert drafter_gemm_dtype("auto", torch.float32, CPU) is None


def test_int8_drafter_gemms_are_refused_where_the_int8_kernel_does_not_run(monkeypatch):
    from trtllm_dflash.errors import InputError

    with pytest.raises(InputError, match="CUDA"):
        drafter_gemm_dtype("int8", torch.float32, torch.device("cuda"))
    monkeypatch.setattr(draft_cpu, "dot_kernel", lambda dtype=torch.bfloat16: None)
    with pytest.raises(InputError, match="compiled int8 CPU kernel") as refused:
        drafter_gemm_dtype("int8", torch.float32, CPU)
    assert refused.value.field == "--drafter-gemm-dtype"
    monkeypatch.setattr(draft_cpu, "dot_kernel", lambda dtype=torch.bfloat16: object())
    assert drafter_gemm_dtype("int8", torch.float32, CPU) == torch.int8


def target_with_head(half: bool) -> GptOssTarget:
    """A tiny float32 target whose LM head is float32 random (its own copy, float32) or bf16-born (fbgemm's
    float16 copy, where fbgemm runs)."""
    if half and not linear.fbgemm_fp16():
        pytest.skip(NO_FBGEMM)
    hf = random_target(tiny_target_config(), seed=3).float()
    if half:
        with torch.no_grad():
            hf.lm_head.weight.copy_(hf.lm_head.weight.bfloat16().float())
    target = GptOssTarget(hf)
    assert target.head.half == half and target.head.dtype == (torch.float16 if half else torch.float32)
    return target


@pytest.mark.parametrize("half", [False, True])
def test_target_lm_head_on_a_block_matches_row_by_row(half):
    """A verify block's logits equal each row's own to float32 rounding, and the float32 head's, whichever
    copy serves them."""
    target = target_with_head(half)
    hidden = torch.randn(2, 8, target.hidden_size)
    block = target.lm_head(hidden)
    rows = torch.stack([torch.stack([target.lm_head(hidden[b, t][None])[0] for t in range(8)]) for b in range(2)])
    assert block.shape == (2, 8, target.vocab_size)
    torch.testing.assert_close(block, rows, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(block, F.linear(hidden, target.hf.lm_head.weight, target.hf.lm_head.bias),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("half", [False, True])
def test_target_lm_head_keeps_gradients_for_training(half):
    """Training backpropagates through the (frozen) head into the drafter: fbgemm's op, which has no
    autograd, must not serve inputs that need gradients."""
    target = target_with_head(half)
    hidden = torch.randn(3, 5, target.hidden_size, requires_grad=True)
    target.lm_head(hidden).logsumexp(-1).sum().backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0


def test_the_dot_gemm_is_built_exactly_where_the_cpu_has_avx512_bf16_or_avx2(monkeypatch):
    """The kernels' module (built with -march=native) has the bf16 dot GEMM exactly where /proc/cpuinfo lists
    avx512_bf16 or avx2 and fma, and its int8 one where it lists avx512_vnni or avx2 (127 input levels with
    avx512_vnni, 63 without; the exact greedy head with it; AMX tiles for it only with amx_int8); where it has none,
    a bf16 GEMM keeps oneDNN's path (or F.linear on the copy where oneDNN does not pack)."""
    module = draft_cpu.cpu_kernel()
    if module is not None:
        flags = cpu_flags().split()
        assert bool(module.dot_available()) == ("avx512_bf16" in flags or {"avx2", "fma"} <= set(flags))
        assert bool(module.dot_int8_available()) == ("avx512_vnni" in flags or "avx2" in flags)
        vnni = "avx512_vnni" in flags and "avx512bw" in flags
        if module.dot_int8_available():
            assert module.dot_int8_input_levels() == (127 if vnni else 63)
        assert not module.dot_int8_tiles_available() or (vnni and "amx_int8" in flags)  # and Linux granted tiles
    monkeypatch.setattr(draft_cpu.KERNEL, "module",
                        lambda: SimpleNamespace(dot_available=lambda: False, dot_int8_available=lambda: False))
    assert draft_cpu.dot_kernel() is None and not draft_cpu.dot_serves(torch.empty(32, 64))
    layer = CastLinear(torch.randn(32, 64), None, torch.bfloat16)
    assert not layer.dot and layer.packed == linear.onednn_packs(torch.bfloat16, CPU)
