"""The compiled AVX512-BF16 GEMM of the drafter (plugins/draft_block/dot_gemm.h): its sums against a float64
GEMM of the bf16-rounded operands, its packing, threads, refusals, and `CastLinear`'s use of it for bf16 GEMMs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from trtllm_dflash.models import linear
from trtllm_dflash.models.linear import CastLinear
from trtllm_dflash.plugins.draft_block import cpu

pytestmark = pytest.mark.skipif(cpu.dot_kernel() is None,
                                reason=f"no AVX512-BF16 GEMM here ({cpu.unavailable_reason() or 'CPU lacks avx512_bf16'})")


def bf16_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The GEMM the kernel promises: x and W rounded to bf16 (nearest even), exact products, float64 sums."""
    y = x.bfloat16().double() @ weight.bfloat16().double().t()
    return y if bias is None else y + bias.double()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 21), inputs=st.sampled_from([32, 64, 96, 256]), groups=st.integers(1, 19),
       with_bias=st.booleans(), lead=st.sampled_from([(), (1,), (2,)]), seed=st.integers(0, 2**16))
def test_dot_linear_sums_the_bf16_products_in_float32(rows, inputs, groups, with_bias, lead, seed):
    """Every row count (whole and partial blocks of 8), column groups beyond and below a tile's 4 or 2."""
    gen = torch.Generator().manual_seed(seed)
    out = groups * cpu.DOT_GROUP
    weight = torch.randn(out, inputs, generator=gen)
    bias = torch.randn(out, generator=gen) if with_bias else None
    x = torch.randn(*lead, rows, inputs, generator=gen)
    got = cpu.dot_linear_cpu(x, cpu.dot_pack(weight), bias)
    expected = bf16_reference(x, weight, bias)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    scale = (x.bfloat16().double().abs() @ weight.bfloat16().double().abs().t()).max()  # sum of |products|
    assert (got.double() - expected).abs().max() <= 1e-6 * scale + 1e-6


def test_dot_pack_is_pairs_of_inputs_per_group_of_sixteen_columns():
    weight = torch.arange(32 * 64, dtype=torch.float32).remainder(256).view(32, 64)  # every value exact in bf16
    packed = cpu.dot_pack(weight)
    assert packed.shape == (2, 32, 16, 2) and packed.dtype == torch.bfloat16
    # group g, input pair p, lane c, member j  <->  W[16 g + c, 2 p + j]
    assert packed[1, 5, 3, 1] == weight[16 + 3, 11]
    assert packed[0, 31, 15, 0] == weight[15, 62]


def test_threads_change_no_bit():
    gen = torch.Generator().manual_seed(3)
    weight, x, bias = torch.randn(512, 256, generator=gen), torch.randn(9, 256, generator=gen), torch.randn(512)
    packed = cpu.dot_pack(weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.dot_linear_cpu(x, packed, bias)
        torch.set_num_threads(2)
        two = cpu.dot_linear_cpu(x, packed, bias)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_dot_linear_refuses_what_it_does_not_take():
    packed = cpu.dot_pack(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="input width"):
        cpu.dot_linear_cpu(torch.randn(3, 32), packed, None)
    with pytest.raises(RuntimeError, match="bias"):
        cpu.dot_linear_cpu(torch.randn(3, 64), packed, torch.randn(16))
    with pytest.raises(RuntimeError, match="float32"):
        cpu.dot_linear_cpu(torch.randn(3, 64, dtype=torch.float64), packed, None)
    assert cpu.dot_serves(torch.empty(32, 64)) and not cpu.dot_serves(torch.empty(24, 64))
    assert not cpu.dot_serves(torch.empty(32, 48))


def test_a_bf16_cast_linear_runs_the_dot_gemm_where_it_serves():
    """A bf16 GEMM on this CPU: the dot kernel at every row count, float32 out, gradient-free like oneDNN's;
    a weight whose widths it does not take keeps oneDNN's path."""
    gen = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen)
    layer = CastLinear(weight, bias, torch.bfloat16)
    assert layer.dot and not layer.packed and layer.few_rows is None
    for rows in (1, 7, 40):
        x = torch.randn(2, rows, 64, generator=gen)
        native = layer.native(x)
        assert native.dtype == torch.float32
        assert torch.equal(native, cpu.dot_linear_cpu(x, layer.weight, layer.bias))
        torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=0.03, atol=0.05)
    odd = CastLinear(torch.randn(40, 64, generator=gen), None, torch.bfloat16)
    assert not odd.dot and odd.packed == linear.onednn_packs(torch.bfloat16, torch.device("cpu"))
