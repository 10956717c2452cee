"""The compiled dot GEMMs of the drafter (plugins/draft_block/dot_gemm.h): the bf16 one's sums against a float64
GEMM of the bf16-rounded operands, the int8 one's against a float64 GEMM of the quantized operands, their packing,
threads, refusals, and `CastLinear`'s use of them for bf16 and int8 GEMMs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from trtllm_dflash.models import linear
from trtllm_dflash.models.linear import CastLinear
from trtllm_dflash.plugins.draft_block import cpu
from trtllm_dflash.runtime.accept import greedy_accept

pytestmark = pytest.mark.skipif(cpu.dot_kernel() is None,
                                reason=f"no AVX512-BF16 GEMM here ({cpu.unavailable_reason() or 'CPU lacks avx512_bf16'})")
needs_int8 = pytest.mark.skipif(cpu.dot_kernel(torch.int8) is None, reason="no int8 dot GEMM here (no AVX2)")


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
    packed, _ = cpu.dot_pack(weight)
    got = cpu.dot_linear_cpu(x, packed, bias)
    expected = bf16_reference(x, weight, bias)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    scale = (x.bfloat16().double().abs() @ weight.bfloat16().double().abs().t()).max()  # sum of |products|
    assert (got.double() - expected).abs().max() <= 1e-6 * scale + 1e-6


def test_dot_pack_is_pairs_of_inputs_per_group_of_sixteen_columns():
    weight = torch.arange(32 * 64, dtype=torch.float32).remainder(256).view(32, 64)  # every value exact in bf16
    packed, scales = cpu.dot_pack(weight)
    assert packed.shape == (2, 32, 16, 2) and packed.dtype == torch.bfloat16 and scales is None
    # group g, input pair p, lane c, member j  <->  W[16 g + c, 2 p + j]
    assert packed[1, 5, 3, 1] == weight[16 + 3, 11]
    assert packed[0, 31, 15, 0] == weight[15, 62]


@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.int8, marks=needs_int8)])
def test_threads_change_no_bit(dtype):
    gen = torch.Generator().manual_seed(3)
    weight, x, bias = torch.randn(512, 256, generator=gen), torch.randn(9, 256, generator=gen), torch.randn(512)
    packed, scales = cpu.dot_pack(weight, dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.dot_linear_cpu(x, packed, bias, scales)
        torch.set_num_threads(2)
        two = cpu.dot_linear_cpu(x, packed, bias, scales)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_dot_linear_refuses_what_it_does_not_take():
    packed, _ = cpu.dot_pack(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="input width"):
        cpu.dot_linear_cpu(torch.randn(3, 32), packed, None)
    with pytest.raises(RuntimeError, match="bias"):
        cpu.dot_linear_cpu(torch.randn(3, 64), packed, torch.randn(16))
    with pytest.raises(RuntimeError, match="float32"):
        cpu.dot_linear_cpu(torch.randn(3, 64, dtype=torch.float64), packed, None)
    with pytest.raises(RuntimeError, match="scales"):
        cpu.dot_linear_cpu(torch.randn(3, 64), packed, None, torch.ones(32))
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


def int8_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The GEMM the int8 kernel promises: each row of x quantized symmetrically to [-L, L] (L = `int8_input_levels`:
    127, or 63 on AVX2) and each output column of W to [-127, 127], each with its own float32 scale (max |.| / levels;
    the row's reciprocal scale multiplied in float32, then rounded to nearest even), exact integer products and sums,
    both scales applied in float64."""
    def quantized(t: torch.Tensor, levels: int, reciprocal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        amax = t.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(amax > 0, amax / levels, torch.ones_like(amax)) if reciprocal else (
            amax / levels).clamp_min(torch.finfo(torch.float32).tiny)
        q = (t * (1 / scale)).round() if reciprocal else (t / scale).round()
        return q.clamp(-levels, levels).double(), scale.double()

    qx, sx = quantized(x, cpu.int8_input_levels(), reciprocal=True)
    qw, sw = quantized(weight, 127, reciprocal=False)
    y = (qx @ qw.t()) * sx * sw.t()
    return y if bias is None else y + bias.double()


@needs_int8
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 21), inputs=st.sampled_from([32, 64, 96, 256]), groups=st.integers(1, 19),
       with_bias=st.booleans(), lead=st.sampled_from([(), (2,)]), zero_row=st.booleans(), seed=st.integers(0, 2**16))
def test_int8_dot_linear_sums_the_quantized_products_exactly(rows, inputs, groups, with_bias, lead, zero_row, seed):
    """Every row count and column count a tile splits, a row of zeros (scale 1), the +128 offset taken back out."""
    gen = torch.Generator().manual_seed(seed)
    out = groups * cpu.DOT_GROUP
    weight = torch.randn(out, inputs, generator=gen)
    bias = torch.randn(out, generator=gen) if with_bias else None
    x = torch.randn(*lead, rows, inputs, generator=gen) * 3
    if zero_row:
        x[..., 0, :] = 0
    packed, scales = cpu.dot_pack(weight, torch.int8)
    got = cpu.dot_linear_cpu(x, packed, bias, scales)
    expected = int8_reference(x, weight, bias)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert (got.double() - expected).abs().max() <= 1e-6 * expected.abs().max() + 1e-5
    # and the quantized GEMM is the float one to within the rounding of both operands (half a step each)
    exact = F.linear(x, weight, bias).double()
    steps = 0.5 / 127 + 0.5 / cpu.int8_input_levels()
    bound = (x.abs().amax(-1, keepdim=True) @ weight.abs().amax(-1, keepdim=True).t()).double() * inputs * steps
    assert ((got.double() - exact).abs() <= bound + 1e-5).all()


@pytest.mark.skipif(cpu.dot_kernel(torch.int8) is None or not cpu.dot_kernel(torch.int8).dot_int8_tiles_available(),
                    reason="the int8 GEMM has no AMX tiles here (no AMX-INT8, or TRTLLM_DFLASH_AMX=0)")
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 16, 21, 40])
@pytest.mark.parametrize("inputs,groups", [(64, 1), (256, 5), (768, 16), (96, 3)])
def test_the_int8_gemm_on_amx_tiles_gives_the_avx512_gemms_numbers_bit_for_bit(rows, inputs, groups):
    """From 4 rows (and inputs a multiple of 64) the int8 GEMM runs on AMX tiles: the same int32 sums and epilogue,
    so the same float32 outputs, over partial 16-row tiles and column groups that do not fill a 3-group pass."""
    module = cpu.dot_kernel(torch.int8)
    gen = torch.Generator().manual_seed(rows * inputs + groups)
    weight, bias = torch.randn(groups * cpu.DOT_GROUP, inputs, generator=gen), torch.randn(groups * cpu.DOT_GROUP)
    x = torch.randn(rows, inputs, generator=gen) * 3
    packed, scales = cpu.dot_pack(weight, torch.int8)
    try:
        module.set_int8_tiles(False)
        avx512 = [cpu.dot_linear_cpu(x, packed, b, scales) for b in (bias, None)]
    finally:
        module.set_int8_tiles(True)
    for b, expected in zip((bias, None), avx512):
        assert torch.equal(cpu.dot_linear_cpu(x, packed, b, scales), expected)


@needs_int8
def test_int8_dot_pack_offsets_each_columns_quantized_weights_by_128():
    weight = torch.zeros(32, 64)
    weight[3, 10] = 127.0  # column 3's peak: scale 1
    weight[3, 11] = -63.5  # -> -64 (nearest even)
    weight[17, 62] = -0.5  # column 17's peak: -127
    packed, scales = cpu.dot_pack(weight, torch.int8)
    assert packed.shape == (2, 16, 16, 4) and packed.dtype == torch.uint8 and scales.shape == (32,)
    # group g, input word p, lane c, byte j  <->  W[16 g + c, 4 p + j]
    assert packed[0, 2, 3, 2] == 128 + 127 and packed[0, 2, 3, 3] == 128 - 64
    assert packed[1, 15, 1, 2] == 128 - 127 and packed[1, 15, 1, 3] == 128
    torch.testing.assert_close(scales[[3, 17]], torch.tensor([1.0, 0.5 / 127]))
    assert scales[0] > 0  # an all-zero column divides by a tiny scale, not by zero


@needs_int8
def test_an_int8_cast_linear_runs_the_int8_dot_gemm_and_falls_back_to_bf16_where_it_cannot():
    gen = torch.Generator().manual_seed(6)
    weight, bias = torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen)
    assert linear.gemm_dtype(weight, torch.int8) == torch.int8
    layer = CastLinear(weight, bias, torch.int8)
    assert layer.dot and layer.weight.dtype == torch.uint8 and layer.scales is not None
    x = torch.randn(2, 7, 64, generator=gen)
    assert torch.equal(layer.native(x), cpu.dot_linear_cpu(x, layer.weight, layer.bias, layer.scales))
    coarse = 127 / cpu.int8_input_levels()  # the inputs' step, relative to 127 levels
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=0.05 * coarse, atol=0.15 * coarse)
    odd = torch.randn(40, 64, generator=gen)  # 40 columns: no packed groups of 16
    assert linear.gemm_dtype(odd, torch.int8) == linear.gemm_dtype(odd, torch.bfloat16)
    with pytest.raises(ValueError, match="int8 dot GEMM"):
        CastLinear(odd, None, torch.int8)


def float64_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """hidden @ W.T + b in float64, every output summed in the same order (a GEMM's tiles may sum two equal rows of W
    differently, and break their tie by rounding)."""
    return (hidden.double()[..., None, :] * weight.double()).sum(-1) + (0 if bias is None else bias.double())


def float32_greedy(hidden: torch.Tensor, drafts: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The greedy accept rule on the float64 logits' argmax (the float32 GEMM's wherever gaps exceed its rounding)."""
    return greedy_accept(drafts, float64_logits(hidden, weight, bias).argmax(dim=-1))


@needs_int8
@settings(max_examples=30, deadline=None)
@given(batch=st.integers(1, 4), drafts=st.integers(0, 8), groups=st.integers(1, 40), inputs=st.sampled_from([32, 256]),
       with_bias=st.booleans(), near=st.floats(1e-4, 3e-2), seed=st.integers(0, 2**16))
def test_the_exact_greedy_head_takes_the_float32_argmax(batch, drafts, groups, inputs, with_bias, near, seed):
    """Near-ties the int8 logits cannot order (a rival row within `near` of each row's winner, far below int8's
    resolution for the small gaps, as a scaled copy of the winner's row and as a row of another direction), exact ties (a duplicated row: the first index wins), drafts that follow the target
    for a while: the float32 answer every time, and some logits recomputed in float32."""
    gen = torch.Generator().manual_seed(seed)
    vocab = groups * cpu.DOT_GROUP
    weight = torch.randn(vocab, inputs, generator=gen) * 0.05
    bias = torch.randn(vocab, generator=gen) * 0.1 if with_bias else None
    hidden = torch.randn(batch, drafts + 1, inputs, generator=gen)
    winner = float64_logits(hidden, weight, bias).argmax(-1)
    rival = (winner[0, 0] + 1) % vocab  # a row that nearly ties with the first row's winner ...
    weight[rival] = weight[winner[0, 0]] * (1 + near * torch.sign(torch.randn(1, generator=gen)))
    if bias is not None:
        bias[rival] = bias[winner[0, 0]]
    if vocab > 2:
        weight[-1] = weight[0]  # ... and an exact tie elsewhere
    if vocab > 3:  # a row of its own direction moved to within `near` of that winner on the first row's input: the
        x = hidden[0, 0].double()  # input's quantization errs differently for the two, so only its bound orders them
        logits = float64_logits(hidden[:1, :1], weight, bias)[0, 0]
        crossing = (winner[0, 0] + 2) % vocab
        gap = near * (logits[winner[0, 0]].abs() + 1) * torch.sign(torch.randn(1, generator=gen, dtype=torch.float64))
        weight[crossing] += ((logits[winner[0, 0]] + gap - logits[crossing]) * x / x.dot(x)).float()
    tokens = float64_logits(hidden, weight, bias).argmax(-1)
    follow = torch.randint(0, drafts + 1, (batch,), generator=gen)
    draft_tokens = torch.where(torch.arange(drafts) < follow[:, None], tokens[:, :drafts], (tokens[:, :drafts] + 1) % vocab)
    head = cpu.ExactGreedyHead(weight, bias)
    got = head(hidden, draft_tokens)
    expected = float32_greedy(hidden, draft_tokens, weight, bias)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), (got, expected)
    block = torch.cat([tokens[:, :1], draft_tokens], dim=1)  # the drafts as the loop hands them: a block's view
    assert all(torch.equal(g, e) for g, e in zip(head(hidden, block[:, 1:]), expected))
    assert head.recomputed >= 1  # at least the first row's winner and its rival


@needs_int8
def test_the_exact_greedy_heads_bound_covers_the_inputs_rounding_at_its_worst():
    """Every input just below half a level, so each rounds down by almost half a step, against rows of +1 and of -1:
    the int8 logits err by ~0.5 per input in opposite directions and rank the two rows wrongly by ~n; only a bound
    with the input's own rounding (half a step of max|x| / `int8_input_levels()`) keeps the true winner."""
    levels, n = cpu.int8_input_levels(), 64
    gen = torch.Generator().manual_seed(0)
    pairs = torch.randint(-levels + 2, levels - 1, (n // 2 - 1,), generator=gen).double()
    whole = torch.cat([pairs, -pairs, torch.tensor([-(n // 2 - 1.0)])])  # sum -31 so that the true logits nearly cancel
    x = torch.cat([torch.tensor([float(levels)], dtype=torch.float64), whole + 0.4999])  # the peak: exactly a level
    weight = torch.zeros(cpu.DOT_GROUP, n)
    weight[0, 1:], weight[1, 1:] = 1.0, -1.0
    bias = torch.full((cpu.DOT_GROUP,), -1e4)
    bias[:2] = 0.0
    hidden = x.float().view(1, 1, n)
    logits = float64_logits(hidden, weight, bias)[0, 0]
    assert logits[0] > logits[1] and logits[0] - logits[1] < 2  # row 0 wins, by less than int8 could tell
    head = cpu.ExactGreedyHead(weight, bias)
    accepted, bonus = head(hidden, torch.zeros(1, 0, dtype=torch.long))
    assert bonus.tolist() == [0] and accepted.tolist() == [0]


@needs_int8
def test_the_exact_greedy_head_refuses_what_it_does_not_take():
    head = cpu.ExactGreedyHead(torch.randn(32, 64), None)
    with pytest.raises(RuntimeError, match="drafts"):
        head(torch.randn(1, 3, 64), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"weight must be contiguous float32 \[V, H\]"):
        head(torch.randn(1, 3, 32), torch.zeros(1, 2, dtype=torch.long))


@needs_int8
def test_an_int8_drafter_head_reads_the_bytes_of_the_targets_exact_greedy_head():
    """One int8 packing of the LM head, not two: the drafter's logits read what the verify has just read."""
    from trtllm_dflash.models.random_pair import drafter_config_for, random_drafter, random_target, tiny_target_config
    from trtllm_dflash.models.target import GptOssTarget
    from trtllm_dflash.runtime.proposers import DFlashProposer

    config = tiny_target_config(vocab_size=272)  # whole groups of 16 columns: the int8 head serves
    target = GptOssTarget(random_target(config))
    assert target.greedy_head is not None
    proposer = DFlashProposer(random_drafter(drafter_config_for(config)), target, matmul_dtype=torch.int8)
    assert proposer.head.weight.data_ptr() == target.greedy_head.packed.data_ptr()
    own = CastLinear(target.hf.lm_head.weight, target.hf.lm_head.bias, torch.int8)
    hidden = torch.randn(2, 7, config.hidden_size, generator=torch.Generator().manual_seed(3))
    assert torch.equal(proposer.head(hidden), own(hidden))
