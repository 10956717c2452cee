"""The target's compiled CPU kernels (plugins/target/cpu_kernel.cpp) against the torch formulations they
replace (`routed_experts` without `compiled`; `sink_attention` after RoPE and the arena write), and the
target's forward through them against its torch path."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

from trtllm_dflash.models.random_pair import random_target, tiny_target_config
from trtllm_dflash.models.kv_cache import KVArena
from trtllm_dflash.models.rope import rotate
from trtllm_dflash.models.layers import causal_mask, routed_experts, sink_attention
from trtllm_dflash.models.target import GptOssTarget
from trtllm_dflash.plugins.compiled import AMX_VARIABLE
from trtllm_dflash.plugins.target import cpu
from trtllm_dflash.quant.codecs import mxfp4_decode, mxfp4_encode

pytestmark = pytest.mark.skipif(cpu.target_kernels() is None, reason=f"kernel not built: {cpu.unavailable_reason()}")


def random_mlp(experts: int, top_k: int, hidden: int, intermediate: int, seed: int, std: float = 0.5) -> GptOssMLP:
    config = tiny_target_config(hidden_size=hidden, intermediate_size=intermediate, experts=experts, top_k=top_k)
    torch.manual_seed(seed)
    mlp = GptOssMLP(config).eval()
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=std)
    with torch.no_grad():  # weights bf16 holds exactly (as MXFP4 experts are), so an exact bf16 copy exists
        mlp.experts.gate_up_proj.copy_(mlp.experts.gate_up_proj.bfloat16().float())
        mlp.experts.down_proj.copy_(mlp.experts.down_proj.bfloat16().float())
    return mlp


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 20), experts=st.integers(1, 9), top_k=st.integers(1, 4),
       hidden=st.sampled_from([16, 48, 64]), intermediate=st.sampled_from([16, 32, 80]), seed=st.integers(0, 2**16))
def test_kernel_equals_the_torch_formulation(tokens, experts, top_k, hidden, intermediate, seed):
    """Any token count, expert count, top-k and multiple-of-16 sizes: the kernel's sums are exact to float32
    rounding, from the float32 weights and from their exact bf16 pairs alike (bit-identical to each other: the same
    products in the same order); std 2 drives the SwiGLU's clamps (|gate_up| past the limit 7).

    "To float32 rounding" is measured against the float64 formulation: the kernel may be off by at most twice what
    the torch formulation in float32 is off, plus a few ulps of the largest output. (With std 2 the sums cancel,
    and the kernel's summation order is often the more accurate one: seed 401 once failed a direct comparison
    with the torch float32 result, which was the further from float64 of the two.)"""
    top_k = min(top_k, experts)
    mlp = random_mlp(experts, top_k, hidden, intermediate, seed, std=2.0 if seed % 2 else 0.5)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        exact = routed_experts(x.double(), copy.deepcopy(mlp).double())
        torch_float32 = routed_experts(x, mlp)
        from_float32 = routed_experts(x, mlp, compiled=True)
        copies = cpu.bf16_pairs(mlp.experts.gate_up_proj), cpu.bf16_pairs(mlp.experts.down_proj)
        assert all(isinstance(c, cpu.Bf16Pairs) for c in copies)
        from_bf16 = routed_experts(x, mlp, *copies, compiled=True)
    assert from_float32.shape == (tokens, hidden) and from_float32.dtype == torch.float32
    ulps = 2e-6 * max(float(exact.abs().max()), 1.0)
    kernel_error, torch_error = (float((y.double() - exact).abs().max()) for y in (from_float32, torch_float32))
    assert kernel_error <= 2 * torch_error + ulps, (kernel_error, torch_error, ulps)
    assert torch.equal(from_bf16, from_float32)


def mxfp4_experts(experts: int, inputs: int, outputs: int, seed: int) -> torch.Tensor:
    """Random experts [E, in, out] as an MXFP4 checkpoint holds them: blocks of 32 input rows a column, each value of
    {0, 0.5, .., 6} (signed) times the block's power of two (the codec's round trip of random weights)."""
    weight = torch.randn(experts, outputs, inputs, generator=torch.Generator().manual_seed(seed)) * 2.0 ** (seed % 7 - 3)
    return mxfp4_decode(*mxfp4_encode(weight)).transpose(1, 2).contiguous()


@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(1, 20), experts=st.integers(1, 9), top_k=st.integers(1, 4),
       hidden=st.sampled_from([32, 64]), intermediate=st.sampled_from([32, 96]), seed=st.integers(0, 2**16))
def test_int8_rows_hold_mxfp4_experts_exactly_and_the_kernel_reads_them_bit_for_bit(tokens, experts, top_k, hidden,
                                                                                    intermediate, seed):
    """`int8_rows` of MXFP4 experts gives back every weight exactly (through the tile-major layout, whose last tiles
    are 16 columns wide where a width is not a multiple of 64); the MoE kernel from them, scaling its inputs instead
    of the weights, equals the kernel from the float32 originals bit for bit, and so does the torch path."""
    top_k = min(top_k, experts)
    mlp = random_mlp(experts, top_k, hidden, intermediate, seed)
    with torch.no_grad():
        mlp.experts.gate_up_proj.copy_(mxfp4_experts(experts, hidden, 2 * intermediate, seed))
        mlp.experts.down_proj.copy_(mxfp4_experts(experts, intermediate, hidden, seed + 1))
    rows = cpu.int8_rows(mlp.experts.gate_up_proj), cpu.int8_rows(mlp.experts.down_proj)
    for copy, weight in zip(rows, (mlp.experts.gate_up_proj, mlp.experts.down_proj)):
        assert copy.values.dtype == torch.int8 and copy.values.abs().max() <= 127
        assert all(torch.equal(copy[e], weight[e]) for e in range(experts))
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        assert torch.equal(routed_experts(x, mlp, *rows, compiled=True), routed_experts(x, mlp, compiled=True))
        assert torch.equal(routed_experts(x, mlp, *rows), routed_experts(x, mlp))


def test_tile_major_keeps_each_tile_contiguous():
    """Columns 0-63 of every row first, then 64-79, then 80-95 (a width of 96: one whole tile, two of 16)."""
    matrices = torch.arange(2 * 3 * 96).view(2, 3, 96)
    tiled = cpu.tile_major(matrices)
    assert torch.equal(tiled[1].reshape(-1)[:64 * 3], matrices[1, :, :64].reshape(-1))
    assert torch.equal(tiled[1].reshape(-1)[64 * 3:80 * 3], matrices[1, :, 64:80].reshape(-1))
    assert all(torch.equal(cpu.untiled(tiled[e]), matrices[e]) for e in range(2))


def test_int8_rows_refuse_what_they_cannot_hold_exactly():
    assert cpu.int8_rows(torch.randn(2, 64, 16)) is None  # random float32: no int8 times a power of two
    spread = mxfp4_experts(1, 32, 16, 0)
    spread[0, 3, 0], spread[0, 3, 1] = 1.0, 2.0 ** -9  # one row's weights 9 octaves apart: no int8 holds both
    assert cpu.int8_rows(spread) is None
    assert cpu.int8_rows(mxfp4_experts(2, 32, 16, 0)[:, :, :8]) is None  # 8 columns: not a whole vector
    assert cpu.int8_rows(mxfp4_experts(2, 32, 16, 0).bfloat16()) is None  # only float32 originals
    zero = cpu.int8_rows(torch.zeros(1, 32, 16))  # all-zero rows: scale 2^-7, values 0
    assert zero is not None and torch.equal(zero[0], torch.zeros(32, 16))


@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(1, 20), experts=st.integers(1, 9), top_k=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_route_equals_the_router(tokens, experts, top_k, seed):
    """The router kernel picks transformers' GptOssTopKRouter's experts in its order (largest logit first) and
    their softmax to float32 rounding."""
    top_k = min(top_k, experts)
    router = random_mlp(experts, top_k, 32, 16, seed).router
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        _, scores, indices = router(x)
        got_indices, got_scores = cpu.route_cpu(x, router.weight, router.bias, top_k)
    assert torch.equal(got_indices, indices)
    torch.testing.assert_close(got_scores, scores, rtol=1e-6, atol=1e-6)


def test_a_hooked_router_is_called_as_it_is():
    """A forward hook on the router (calibration, the step-cost benchmark's count of experts touched) sees every
    call the compiled path makes: the module runs, the router kernel does not."""
    mlp = random_mlp(4, 2, 32, 32, seed=2)
    seen = []
    mlp.router.register_forward_hook(lambda module, inputs, output: seen.append(output[-1].shape))
    x = torch.randn(5, 32)
    with torch.inference_mode():
        torch.testing.assert_close(routed_experts(x, mlp, compiled=True), routed_experts(x, mlp), rtol=1e-5, atol=1e-5)
    assert seen == [(5, 2), (5, 2)]


def test_the_one_call_moe_equals_the_router_then_the_experts():
    """`moe_call` (a layer's router and experts in one kernel call, prepared once) gives the bits of `routed_experts`
    through the two compiled calls, from every storage the kernel takes; the embedded target's forward uses it per
    layer, except around a router or experts that a hook watches, where the modules run (and the hook sees them)."""
    from trtllm_dflash.checkpoints.gpt_oss import load_hf_gpt_oss
    from trtllm_dflash.embedded import pair_paths

    target = GptOssTarget(load_hf_gpt_oss(pair_paths()[0]))
    x = torch.randn(6, target.hidden_size, generator=torch.Generator().manual_seed(0))
    parts = target.layer_parts[1]
    with torch.inference_mode():
        for name, storages in target.expert_storages.items():
            call = cpu.moe_call(parts.mlp, *storages[1])
            if name == "float16":  # fbgemm's copies: the torch path's
                assert call is None
                continue
            assert torch.equal(call(x), routed_experts(x, parts.mlp, *storages[1], compiled=True)), name
        assert all(call is not None for call in target.moe_calls)
        calls = target.moe_calls
        target.use_expert_storage("bfloat16")
        target.use_expert_storage("float32")
        assert target.moe_calls is calls  # made once per storage
        tokens = torch.randint(0, target.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
        positions = torch.arange(5)[None]
        plain, _ = target(tokens, positions, target.new_cache(1, 5), [])
        seen = []
        handle = parts.router.register_forward_hook(lambda module, inputs, output: seen.append(output[-1].shape))
        hooked_logits, _ = target(tokens, positions, target.new_cache(1, 5), [])
        handle.remove()
    assert seen == [(5, 2)]
    torch.testing.assert_close(hooked_logits, plain, rtol=1e-5, atol=1e-5)


def test_threads_split_the_experts_and_change_no_number():
    """With two intra-op threads the experts run in parallel, each on one thread: the same bits as one thread."""
    mlp = random_mlp(8, 2, 64, 64, seed=4)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    outputs = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            with torch.inference_mode():
                outputs.append(routed_experts(x, mlp, compiled=True))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outputs[0], outputs[1])


def test_the_kernel_serves_only_what_it_takes():
    """Float32 tokens with float32 expert tensors or both experts' bf16 pairs, of multiple-of-16 sizes; not fbgemm's
    packed copies, plain bf16 tensors, mixed storages, bf16 tokens or other sizes, where the torch formulation runs."""
    mlp = random_mlp(4, 2, 64, 64, seed=0)
    gate_up, down = mlp.experts.gate_up_proj, mlp.experts.down_proj
    pairs = cpu.bf16_pairs(gate_up.bfloat16().float()), cpu.bf16_pairs(down.bfloat16().float())
    x = torch.randn(3, 64)
    assert cpu.moe_serves(x, gate_up, down) and cpu.moe_serves(x, *pairs)
    assert not cpu.moe_serves(x, [gate_up[0]], down)
    assert not cpu.moe_serves(x, gate_up.bfloat16(), down.bfloat16())
    assert not cpu.moe_serves(x, pairs[0], down)
    assert not cpu.moe_serves(x.bfloat16(), gate_up, down)
    odd = random_mlp(4, 2, 24, 64, seed=0)
    assert not cpu.moe_serves(torch.randn(3, 24), odd.experts.gate_up_proj, odd.experts.down_proj)
    with torch.inference_mode():  # there `compiled` falls back to the torch formulation: the same numbers
        y = torch.randn(3, 24)
        assert torch.equal(routed_experts(y, odd, compiled=True), routed_experts(y, odd))


def test_the_kernel_refuses_bad_input():
    """Indices outside the experts and mismatched shapes are errors, not reads out of bounds."""
    mlp = random_mlp(4, 2, 32, 32, seed=1)
    e = mlp.experts
    x, scores = torch.randn(2, 32), torch.rand(2, 2)
    with pytest.raises(RuntimeError, match="expert index 4 outside"):
        cpu.routed_experts_cpu(x, torch.tensor([[0, 4], [1, 2]]), scores, e.gate_up_proj, e.gate_up_proj_bias,
                               e.down_proj, e.down_proj_bias, e.alpha, e.limit)
    with pytest.raises(RuntimeError, match="expert shapes"):
        cpu.routed_experts_cpu(x, torch.tensor([[0, 1], [1, 2]]), scores, e.gate_up_proj[:, :16], e.gate_up_proj_bias,
                               e.down_proj, e.down_proj_bias, e.alpha, e.limit)


def test_the_target_decodes_the_same_tokens_through_the_kernel():
    """A tiny target's greedy continuation of a batch, step by step over its cache, through the compiled kernels
    (the MoE's, and the residual adds with their RMSNorms) and through torch: the same tokens, logits equal to
    float32 rounding; `compiled_parts` says which ran."""
    target = GptOssTarget(random_target(tiny_target_config(), seed=5))
    prompt = torch.randint(0, target.vocab_size, (3, 9), generator=torch.Generator().manual_seed(2))
    runs = {}
    for compiled in (True, False):
        target.use_cpu_kernels = compiled
        target_parts = ["attention", "moe", "add_rms_norm"] if compiled else []
        assert target.compiled_parts() == target_parts
        cache = target.new_cache(3, 40)
        positions = torch.arange(40).expand(3, -1)
        logits, _ = target(prompt, positions[:, :9], cache, [])
        tokens, all_logits = [logits[:, -1].argmax(-1)], [logits]
        for step in range(9, 39):
            logits, _ = target(tokens[-1][:, None], positions[:, step: step + 1], cache, [])
            tokens.append(logits[:, -1].argmax(-1))
            all_logits.append(logits)
        runs[compiled] = torch.stack(tokens, 1), all_logits
    assert torch.equal(runs[True][0], runs[False][0])
    for got, expected in zip(runs[True][1], runs[False][1]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_disabled_kernel_leaves_the_torch_path():
    """TRTLLM_DFLASH_CPU_KERNEL=0: no build, the reason said, the target on its torch formulations."""
    code = ("from trtllm_dflash.plugins.target import cpu\n"
            "from trtllm_dflash.models.random_pair import random_target, tiny_target_config\n"
            "from trtllm_dflash.models.target import GptOssTarget\n"
            "target = GptOssTarget(random_target(tiny_target_config()))\n"
            "print(cpu.target_kernels(), cpu.unavailable_reason(), target.compiled_parts())\n")
    env = {**os.environ, "TRTLLM_DFLASH_CPU_KERNEL": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["None", "TRTLLM_DFLASH_CPU_KERNEL=0", "[]"]


def attention_case(batch: int, hq: int, hkv: int, d: int, capacity: int, seed: int):
    """A filled one-layer arena, RoPE tables (`Rotary`'s layout: signed sin) over its positions and sink logits."""
    generator = torch.Generator().manual_seed(seed)
    arena = KVArena(1, batch, hkv, capacity, d, torch.float32, "cpu")
    arena.keys.normal_(generator=generator)
    arena.values.normal_(generator=generator)
    angles = torch.rand(capacity, d // 2, generator=generator) * 6.3
    table = torch.stack([torch.cat([angles.cos()] * 2, -1), torch.cat([-angles.sin(), angles.sin()], -1)], 1)
    return arena, table, torch.randn(hq, generator=generator), generator


def attention_reference(qkv, cos, sin, arena, positions, window, sinks, scale, hq, hkv, d):
    """The torch formulation in float64: rotate, write into a copy of the arena, `sink_attention` under the
    causal (windowed) mask of each query's position."""
    b, t, _ = qkv.shape
    keys, values = arena.keys[0].double().clone(), arena.values[0].double().clone()
    heads = qkv.double().view(b, t, -1, d)
    qk = rotate(heads[:, :, : hq + hkv], cos.double()[:, :, None], sin.double()[:, :, None])
    rows = torch.arange(b)[:, None]
    keys[rows, :, positions] = qk[:, :, hq:]
    values[rows, :, positions] = heads[:, :, hq + hkv:]
    length = int(positions.max()) + 1
    mask = causal_mask(positions, length, window)
    out = sink_attention(qk[:, :, :hq].transpose(1, 2), keys[:, :, :length], values[:, :, :length], mask,
                         None if sinks is None else sinks.double(), scale)
    return out, keys, values


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 3), t=st.integers(1, 9), start=st.integers(0, 70), group=st.sampled_from([1, 2, 4, 8]),
       hkv=st.integers(1, 3), d=st.sampled_from([16, 32, 64]), window=st.sampled_from([None, 1, 5, 64]),
       with_sinks=st.booleans(), seed=st.integers(0, 2**16))
def test_attention_kernel_equals_the_float64_reference(batch, t, start, group, hkv, d, window, with_sinks, seed):
    """Ragged batches (each row its own start), steps of 1 to 9 tokens, grouped heads, windows narrower and wider
    than the history, sinks on and off, groups up to gpt-oss-120b's 8 query heads a KV head: the output and the arena's keys and values match a float64 reference of
    rotate + write + sink attention to float32 rounding (the rest of the arena untouched)."""
    hq = hkv * group
    capacity = start + 2 * t + 8
    arena, table, sinks, generator = attention_case(batch, hq, hkv, d, capacity, seed)
    positions = (start + 3 * torch.arange(batch))[:, None] % (capacity - t) + torch.arange(t)
    cos, sin = table[positions][:, :, 0], table[positions][:, :, 1]
    qkv = torch.randn(batch, t, (hq + 2 * hkv) * d, generator=generator)
    scale, sinks = d ** -0.5, sinks if with_sinks else None
    expected, keys, values = attention_reference(qkv, cos, sin, arena, positions, window, sinks, scale, hq, hkv, d)
    got = cpu.sink_attention_cpu(qkv, cos, sin, arena.k[0], arena.v[0], positions, window, sinks, scale)
    assert got.shape == (batch, t, hq * d)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(arena.k[0].double(), keys, rtol=1e-6, atol=1e-6)
    assert torch.equal(arena.v[0].double(), values)


def test_attention_kernel_refuses_positions_outside_the_arena():
    arena, table, sinks, generator = attention_case(1, 2, 1, 16, 8, seed=0)
    qkv = torch.randn(1, 1, 4 * 16, generator=generator)
    with pytest.raises(RuntimeError, match="position 8 lies outside the arena"):
        cpu.sink_attention_cpu(qkv, table[None, :1, 0], table[None, :1, 1], arena.k[0], arena.v[0],
                               torch.tensor([[8]]), None, sinks, 0.25)


def bf16_exact(*shape: int, seed: int, std: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * std).bfloat16().float()


def linear_case(rows: int, inputs: int, outputs: int, with_bias: bool, seed: int):
    """A bf16-exact weight [inputs, outputs], a bias or None, and rows of x scaled by a power of two."""
    weight, bias = bf16_exact(inputs, outputs, seed=seed), torch.randn(outputs) if with_bias else None
    x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(seed + 1)) * 2.0 ** (seed % 9 - 4)
    return weight, bias, x


def assert_exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stored) -> torch.Tensor:
    """`linear_cpu` from `stored` (weight's copy in a kernel layout): every output within float32 summation rounding of
    the float64 product, each row the same bits as that row alone (a step's numbers do not depend on its width) and
    on two threads. Returns the outputs."""
    got = cpu.linear_cpu(x, stored, bias)
    expected = x.double() @ weight.double() + (0 if bias is None else bias.double())
    magnitudes = x.double().abs() @ weight.double().abs() + (0 if bias is None else bias.double().abs())
    bound = magnitudes * x.shape[-1] * 2.0**-23
    assert got.shape == expected.shape and bool(((got.double() - expected).abs() <= bound + 1e-30).all())
    assert torch.equal(cpu.linear_cpu(x[-1:].contiguous(), stored, bias), got[-1:])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(cpu.linear_cpu(x, stored, bias), got)
    finally:
        torch.set_num_threads(threads)
    return got


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 20), inputs=st.sampled_from([2, 16, 64, 256]), outputs=st.sampled_from([16, 48, 80, 512]),
       with_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_linear_from_bf16_pairs_gives_the_float32_weights_bits(rows, inputs, outputs, with_bias, seed):
    """The pair layout changes how the kernel widens the weights, not the products or the order of the sums: the
    float32 weight's bits (themselves within float32 summation rounding of the float64 product), over row counts that
    fill the passes in every way, each row the same bits as that row alone and on two threads."""
    weight, bias, x = linear_case(rows, inputs, outputs, with_bias, seed)
    got = assert_exact_linear(x, weight, bias, cpu.bf16_pairs(weight))
    assert torch.equal(got, cpu.linear_cpu(x, weight, bias))


def test_bf16_pairs_hold_the_matrix_and_refuse_what_they_cannot():
    """The matrix comes back exactly; random float32 (not bf16) and an odd count of inputs are refused; a target
    whose dense weights bf16 holds multiplies its projections from pairs where AMX does not take them."""
    weight = bf16_exact(6, 32, seed=0)
    pairs = cpu.bf16_pairs(weight)
    assert pairs.values.dtype == torch.int32 and pairs.values.shape == (3, 32)
    assert torch.equal(pairs.matrix(), weight)
    assert cpu.bf16_pairs(torch.randn(6, 32)) is None and cpu.bf16_pairs(bf16_exact(5, 32, seed=1)) is None
    hf = random_target(tiny_target_config(), seed=5)
    with torch.no_grad():
        for parameter in hf.parameters():
            parameter.copy_(parameter.bfloat16().float())
    target = GptOssTarget(hf)
    kinds = {type(k.weight) for k in target.qkv_kernel + target.o_proj_kernel if k}
    assert kinds == {cpu.AmxTiles if cpu.amx_available() else cpu.Bf16Pairs}


amx = pytest.mark.skipif(not cpu.amx_available(), reason="no AMX-BF16 on this CPU (or the kernel's build lacks it)")


@amx
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), inputs=st.sampled_from([32, 64, 256]), outputs=st.sampled_from([16, 48, 80, 512]),
       with_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_amx_linear_equals_the_float64_product_to_float32_rounding(rows, inputs, outputs, with_bias, seed):
    """Inputs split into three bf16 parts: every output within float32 summation rounding of the float64 product
    (over row counts that fill 16-row tiles in every way and column counts that fill 3-tile groups in every way),
    and each row the same bits as that row alone (a step's numbers do not depend on its width) and on two threads."""
    weight, bias, x = linear_case(rows, inputs, outputs, with_bias, seed)
    assert_exact_linear(x, weight, bias, cpu.amx_tiles(weight))


@amx
def test_amx_tiles_hold_the_matrices_and_refuse_what_they_cannot():
    """Each matrix comes back from the tile layout exactly; random float32 (not bf16), inputs not a multiple of 32 and
    outputs not a multiple of 16 are refused."""
    experts = bf16_exact(3, 64, 48, seed=0)
    tiles = cpu.amx_tiles(experts)
    assert tiles.values.dtype == torch.bfloat16 and tiles.values.shape == experts.shape
    assert all(torch.equal(tiles[e], experts[e]) for e in range(3))
    assert cpu.amx_tiles(torch.randn(64, 48)) is None
    assert cpu.amx_tiles(bf16_exact(48, 48, seed=1)) is None and cpu.amx_tiles(bf16_exact(64, 40, seed=1)) is None


@amx
@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(1, 20), experts=st.integers(1, 9), top_k=st.integers(1, 4),
       hidden=st.sampled_from([32, 64]), intermediate=st.sampled_from([32, 96]), seed=st.integers(0, 2**16))
def test_amx_experts_equal_the_torch_formulation(tokens, experts, top_k, hidden, intermediate, seed):
    """The MoE kernel from AMX tiles: the torch formulation's sums to float32 rounding, as from the float32 weights;
    the torch path reads the tiles' matrices (`AmxTiles[e]`) and gives its own numbers exactly."""
    top_k = min(top_k, experts)
    mlp = random_mlp(experts, top_k, hidden, intermediate, seed, std=2.0 if seed % 2 else 0.5)
    tiles = cpu.amx_tiles(mlp.experts.gate_up_proj), cpu.amx_tiles(mlp.experts.down_proj)
    assert cpu.moe_serves(torch.randn(1, hidden), *tiles)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        expected = routed_experts(x, mlp)
        scale = float(expected.abs().max())
        torch.testing.assert_close(routed_experts(x, mlp, *tiles, compiled=True), expected, rtol=1e-5,
                                   atol=2e-6 * max(scale, 1.0))
        assert torch.equal(routed_experts(x, mlp, *tiles), expected)


def test_amx_switched_off_leaves_the_avx512_paths(monkeypatch):
    """TRTLLM_DFLASH_AMX=0: no AMX tiles anywhere (a target then has no "amx" expert storage and its projections
    keep their bf16 pairs), where AMX runs as where it does not."""
    monkeypatch.setenv(AMX_VARIABLE, "0")
    assert not cpu.amx_available() and cpu.amx_tiles(bf16_exact(64, 48, seed=0)) is None
    target = GptOssTarget(random_target(tiny_target_config(), seed=5))
    assert "amx" not in target.expert_storages
    assert not any(isinstance(k.weight, cpu.AmxTiles) for k in target.qkv_kernel + target.o_proj_kernel if k)


def exact_storage_target(seed: int) -> GptOssTarget:
    """A tiny target whose experts are MXFP4 values and whose attention weights are bf16 values (as a gpt-oss
    checkpoint's): every storage the kernels take serves it."""
    hf = random_target(tiny_target_config(experts=4, intermediate_size=64), seed=seed)
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            experts = layer.mlp.experts
            for name, weight in (("gate_up_proj", experts.gate_up_proj), ("down_proj", experts.down_proj)):
                weight.copy_(mxfp4_experts(*weight.shape, seed=seed + 2 * i + (name == "down_proj")))
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                               layer.self_attn.o_proj):
                projection.weight.copy_(projection.weight.bfloat16().float())
    return GptOssTarget(hf)


def test_the_whole_step_is_the_per_call_path_bit_for_bit():
    """`TargetStep` (the decoder layers in one compiled call) against the same layers part by part, on every expert
    storage the kernels take: the same final-normed hidden states, features and K/V bit for bit, at one token, a block
    of 8 and a ragged batch of 3."""
    target = exact_storage_target(seed=4)
    storages = [name for name in target.expert_storages if name not in ("float16", "amx")]
    assert {"float32", "bfloat16", "int8"} <= set(storages)
    assert all(isinstance(kernel.weight, (cpu.Bf16Pairs, cpu.AmxTiles)) for kernel in target.qkv_kernel)
    generator = torch.Generator().manual_seed(1)
    for storage in storages:
        target.use_expert_storage(storage)
        assert target.whole_step() is not None
        for batch, width, context in ((1, 1, 30), (1, 8, 21), (3, 3, 17)):
            prompt = torch.randint(0, target.vocab_size, (batch, context), generator=generator)
            block = torch.randint(0, target.vocab_size, (batch, width), generator=generator)
            starts = torch.arange(batch) * 3 + context  # ragged: each row's block at its own position
            runs = []
            for whole in (True, False):
                target.use_whole_step = whole
                cache = target.new_cache(batch, context + batch * 3 + width)
                target(prompt, torch.arange(context).expand(batch, -1), cache, [])
                hidden, features = target(block, starts[:, None] + torch.arange(width), cache, [2, 0], head=False)
                runs.append((hidden, features, cache.keys, cache.values))
            target.use_whole_step = True
            for got, expected in zip(*runs):
                assert torch.equal(got, expected), (storage, batch, width)
            assert runs[0][1].shape == (batch, width, 2 * target.hidden_size)


@pytest.mark.parametrize("watched", ["router", "embedding"])
def test_a_hook_sends_the_step_down_the_per_call_path(watched):
    """Calibration hooks a router (or the embedding, which the whole step looks up itself): the step then runs part
    by part, so the hook sees the module's input."""
    target = exact_storage_target(seed=6)
    module = target.layer_parts[1].router if watched == "router" else target.hf.model.embed_tokens
    seen = []
    handle = module.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0]))
    try:
        target(torch.tensor([[3, 4, 5]]), torch.arange(3)[None], target.new_cache(1, 3), [])
    finally:
        handle.remove()
    assert len(seen) == 1 and seen[0].shape == ((3, target.hidden_size) if watched == "router" else (1, 3))
    assert target.whole_step() is not None  # served, but not taken while hooked
