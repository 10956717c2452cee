"""The lean inference paths against the reference formulations they replace: transformers' MoE,
the plain sink attention, the drafter's per-layer context K/V and its concatenating block attention."""

from __future__ import annotations

import pytest
import torch
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

from trtllm_dflash.models.drafter_weights import InferenceWeights
from trtllm_dflash.models.random_pair import drafter_config_for, random_drafter, random_target, tiny_target_config
from trtllm_dflash.models.layers import (attention_bias, causal_mask, fused_attention, half_copies, routed_experts,
                                         sink_attention)
from trtllm_dflash.models.linear import fbgemm_fp16
from trtllm_dflash.models.target import GptOssTarget
from trtllm_dflash.plugins.target import cpu as target_cpu
from trtllm_dflash.plugins.target.cpu import amx_available


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (3, 8, 2), (8, 8, 2), (40, 4, 3), (2, 32, 4)])
def test_routed_experts_equal_transformers_mlp(tokens, experts, top_k, dtype):
    """Same router, same grouped sums: equal to GptOssMLP (transformers' grouped_mm experts) on
    random inputs, with experts that no token routes to (8 tokens rarely reach all 32)."""
    config = tiny_target_config(experts=experts, top_k=top_k)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(tokens)
    mlp = GptOssMLP(config).eval()
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.5)
    mlp = mlp.to(dtype)
    x = torch.randn(tokens, config.hidden_size).to(dtype)
    with torch.inference_mode():
        expected, _ = mlp(x[None])
        got = routed_experts(x, mlp)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected[0], rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(got, expected[0], rtol=1.6e-2, atol=1e-2)


def test_experts_read_from_exact_copies_give_the_same_numbers():
    """Experts that bf16 holds exactly (as MXFP4 ones) are kept as bf16 pairs and widened back per GEMM:
    bit-identical to the float32 weights; and as fbgemm's float16 copies where it runs: the same to
    float32 rounding. Others (random float32) get neither."""
    config = tiny_target_config(experts=8, top_k=2)
    torch.manual_seed(3)
    mlp = GptOssMLP(config).eval()
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.5)
    experts = mlp.experts
    assert target_cpu.bf16_pairs(experts.gate_up_proj) is None  # random float32: no exact bf16 copy
    assert half_copies(experts.gate_up_proj) is None
    with torch.no_grad():
        experts.gate_up_proj.copy_(experts.gate_up_proj.bfloat16().float())
        experts.down_proj.copy_(experts.down_proj.bfloat16().float())
    gate_up, down = target_cpu.bf16_pairs(experts.gate_up_proj), target_cpu.bf16_pairs(experts.down_proj)
    assert isinstance(gate_up, target_cpu.Bf16Pairs) and isinstance(down, target_cpu.Bf16Pairs)
    x = torch.randn(8, config.hidden_size)
    with torch.inference_mode():
        expected = routed_experts(x, mlp)
        assert torch.equal(routed_experts(x, mlp, gate_up, down), expected)
        if fbgemm_fp16():
            half = half_copies(experts.gate_up_proj), half_copies(experts.down_proj)
            assert all(isinstance(copies, list) and len(copies) == 8 for copies in half)
            torch.testing.assert_close(routed_experts(x, mlp, *half), expected, rtol=1e-5, atol=1e-5)


def test_the_embedded_targets_mxfp4_experts_read_from_each_storage_give_the_same_logits():
    """MXFP4 experts: float32 originals, exact bf16 pairs, (where fbgemm runs) float16 ones, exact int8 rows and
    (where AMX runs) AMX tiles, switchable; the same logits from the bf16 pairs and the int8 rows, the same to
    float32 rounding and the same greedy tokens from the float16 ones and the AMX tiles; a target with random float32
    experts has one storage."""
    from trtllm_dflash.checkpoints.gpt_oss import load_hf_gpt_oss
    from trtllm_dflash.embedded import pair_paths

    target = GptOssTarget(load_hf_gpt_oss(pair_paths()[0]))
    assert target.hf.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32
    expected = ["float32", "bfloat16"] + (["float16"] if fbgemm_fp16() else []) + ["int8"]
    expected += ["amx"] if amx_available() else []
    assert list(target.expert_storages) == expected and target.expert_storage == "float32"
    # its bf16 LM head and attention projections fit float16
    assert all(linear.half == fbgemm_fp16() for linear in [*target.qkv, *target.o_proj, target.head])
    tokens = torch.randint(0, target.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12).expand(2, -1)
    logits = {}
    for storage in reversed(expected):
        target.use_expert_storage(storage)
        assert target.expert_weights is target.expert_storages[storage]
        logits[storage], _ = target(tokens, positions, target.new_cache(2, 12), [])
    assert target.expert_storage == "float32"
    assert torch.equal(logits["bfloat16"], logits["float32"]) and torch.equal(logits["int8"], logits["float32"])
    for rounded in {"float16", "amx"} & set(logits):
        torch.testing.assert_close(logits[rounded], logits["float32"], rtol=1e-5, atol=1e-4)
        assert torch.equal(logits[rounded].argmax(-1), logits["float32"].argmax(-1))
    assert list(GptOssTarget(random_target(tiny_target_config())).expert_storages) == ["float32"]


def test_a_prefill_reads_the_prefill_storage_and_the_decode_keeps_its_own(monkeypatch):
    """The embedded target decoding from its int8 rows prefills from the AMX tiles where the CPU has them (else from
    the int8 rows): the prefill's logits are the int8 prefill's to float32 rounding, the same greedy token, and the
    storage is int8 again for the steps after it."""
    from trtllm_dflash.checkpoints.gpt_oss import load_hf_gpt_oss
    from trtllm_dflash.embedded import pair_paths
    from trtllm_dflash.runtime.reference import prefill

    target = GptOssTarget(load_hf_gpt_oss(pair_paths()[0]))
    target.use_expert_storage("int8")
    assert target.prefill_storage == ("amx" if amx_available() else "int8")
    prompts = [torch.randint(0, target.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (40, 23)]
    used = []
    original = target.use_expert_storage
    target.use_expert_storage = lambda name: (used.append(name), original(name))[1]
    with torch.inference_mode():
        _, logits, features, _ = prefill(target, prompts, [1, 2], 48)
    assert used == [target.prefill_storage, "int8"] and target.expert_storage == "int8"
    monkeypatch.setattr(GptOssTarget, "prefill_storage", property(lambda self: "int8"))
    with torch.inference_mode():
        _, expected, expected_features, _ = prefill(target, prompts, [1, 2], 48)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(features, expected_features, rtol=1e-5, atol=1e-4)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_sinks", [True, False])
def test_fused_attention_equals_sink_attention(with_sinks, dtype):
    """Ragged causal / windowed masks over a cache slice, grouped heads, sinks on and off."""
    torch.manual_seed(0)
    b, hq, hkv, t, d, length = 3, 4, 2, 5, 16, 23
    q = torch.randn(b, hq, t, d).to(dtype)
    k, v = (torch.randn(b, hkv, 40, d)[:, :, :length].to(dtype) for _ in range(2))
    positions = torch.tensor([[18, 19, 20, 21, 22], [3, 4, 5, 6, 7], [0, 1, 2, 3, 4]])
    sinks = torch.randn(hq) if with_sinks else None
    for window in (None, 4):
        mask = causal_mask(positions, length, window)
        expected = sink_attention(q, k, v, mask, sinks, d ** -0.5)
        packed_sinks = None if sinks is None else sinks.view(hkv, hq // hkv, 1)
        got = fused_attention(q, k, v, attention_bias(mask, hq // hkv, dtype), packed_sinks, d ** -0.5)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("bf16_weights", [False, True])
def test_target_logits_equal_transformers_forward(bf16_weights):
    """The lean forward (fused qkv, fused attention, routed experts) against transformers' own forward; with
    bf16-valued weights (as gpt-oss checkpoints store them) the dense GEMMs run in fbgemm's float16 where it runs."""
    hf = random_target(tiny_target_config(num_layers=4, sliding_window=4, experts=8, top_k=2), seed=5).float()
    if bf16_weights:
        with torch.no_grad():
            for parameter in hf.parameters():
                parameter.copy_(parameter.bfloat16().float())
    target = GptOssTarget(hf)
    half = bf16_weights and fbgemm_fp16()
    assert all(linear.half == half for linear in [*target.qkv, *target.o_proj, target.head])
    tokens = torch.randint(0, 256, (2, 14))
    logits, _ = target(tokens, torch.arange(14).expand(2, -1), target.new_cache(2, 14), [])
    with torch.no_grad():
        expected = hf(tokens).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def drafter():
    return random_drafter(drafter_config_for(tiny_target_config(), num_layers=3, block_size=5), seed=7, std=0.1)


def test_fused_context_kv_equals_per_layer_path(drafter):
    """One GEMM over the stacked k/v weights == each layer's own k_proj -> k_norm -> RoPE and v_proj."""
    cfg = drafter.config
    features = torch.randn(2, 6, len(cfg.target_layer_ids) * cfg.hidden_size)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [9, 10, 11, 12, 13, 14]])
    cache = drafter.new_cache(2, 16)
    drafter.write_context(features, positions, cache)
    with torch.no_grad():
        fused = drafter.hidden_norm(drafter.fc(features))
        cos, sin = drafter.rotary(positions, fused.dtype)
        rows = torch.arange(2)[:, None]
        for i, layer in enumerate(drafter.layers):
            k, v = layer.self_attn.keys_values(fused, cos, sin)  # [b, Hkv, n, D]
            torch.testing.assert_close(cache.k[i][rows, :, positions], k.transpose(1, 2), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(cache.v[i][rows, :, positions], v.transpose(1, 2), rtol=1e-6, atol=1e-6)


def concatenating_forward(drafter, block, positions, cache, context_lens):
    """The previous inference path: per-module layers, block K/V concatenated after the context."""
    cos, sin = drafter.rotary(positions, block.dtype)
    b, width = block.shape[:2]
    ctx_len = int(context_lens.max())
    visible = torch.arange(ctx_len) < context_lens[:, None]
    mask = torch.cat([visible, visible.new_ones(b, width)], dim=1)[:, None].expand(b, width, -1)

    def attend(i, q, k, v):
        ctx_k, ctx_v = cache.read(i, ctx_len)
        return sink_attention(q, torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2), mask, None, drafter.scale)

    with torch.no_grad():
        return drafter.run_layers(block, cos, sin, attend)


def test_lean_block_forward_equals_concatenating_path_and_keeps_context(drafter):
    """Ragged contexts (one empty): equal outputs, and the context slots of the arena are untouched
    by the block K/V the forward writes past them."""
    cfg = drafter.config
    lens = torch.tensor([9, 0, 4])
    cache = drafter.new_cache(3, 9 + cfg.block_size)
    drafter.write_context(torch.randn(3, 9, len(cfg.target_layer_ids) * cfg.hidden_size), torch.arange(9).expand(3, -1),
                          cache)
    before = cache.keys.clone(), cache.values.clone()
    block = torch.randn(3, cfg.block_size, cfg.hidden_size)
    positions = lens[:, None] + torch.arange(cfg.block_size)
    expected = concatenating_forward(drafter, block, positions, cache, lens)
    got = drafter(block, positions, cache, lens)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for row, n in enumerate(lens.tolist()):
        assert torch.equal(cache.keys[:, row, :, :n], before[0][:, row, :, :n])
        assert torch.equal(cache.values[:, row, :, :n], before[1][:, row, :, :n])


def test_a_lone_requests_span_writes_equal_indexed_writes(drafter):
    """Batch 1 writes its context and its block as one span each (int positions): the arena, the RoPE
    and the block's outputs are those of the indexed path, bit for bit."""
    cfg = drafter.config
    features = torch.randn(1, 7, len(cfg.target_layer_ids) * cfg.hidden_size)
    spans, indexed = drafter.new_cache(1, 20), drafter.new_cache(1, 20)
    drafter.write_context(features[:, :4], 0, spans)
    drafter.write_context(features[:, 4:], 4, spans)  # a second commit, past the first
    drafter.write_context(features[:, :4], torch.arange(4)[None], indexed)
    drafter.write_context(features[:, 4:], torch.arange(4, 7)[None], indexed)
    assert torch.equal(spans.keys, indexed.keys) and torch.equal(spans.values, indexed.values)
    cos, sin = drafter.rotary.span(5, 3, torch.float32, torch.device("cpu"))
    expected = drafter.rotary(torch.tensor([[5, 6, 7]]), torch.float32)
    assert torch.equal(cos, expected[0]) and torch.equal(sin, expected[1])
    block, lens = torch.randn(1, cfg.block_size, cfg.hidden_size), torch.tensor([7])
    positions = 7 + torch.arange(cfg.block_size)[None]
    assert drafter.block_layout(lens, cfg.block_size, block.dtype).slots == 7
    k, v = torch.randn(2, 1, cfg.block_size, cfg.num_key_value_heads, cfg.head_dim)
    spans.write(0, 7, k, v)
    indexed.write(0, positions, k, v)
    assert torch.equal(spans.keys, indexed.keys) and torch.equal(spans.values, indexed.values)
    for dtype in (None, torch.bfloat16):
        got = drafter(block, positions, spans, lens, dtype)
        expected = concatenating_forward(drafter, block, positions, indexed, lens)
        tolerance = 1e-5 if dtype is None else 0.05  # bf16 GEMMs (and the SiLU gate in bf16)
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("lone", [True, False])
def test_context_folded_into_the_first_layer_equals_writing_it_first(drafter, lone, dtype):
    """`forward(context=...)` computes the committed tokens' context K/V in the first layer's GEMM: the
    arena and the block's outputs are those of `write_context` then `forward`, for a lone request (span
    positions) and for ragged rows whose padded queue entries land past their context."""
    cfg = drafter.config
    torch.manual_seed(3)
    old = torch.tensor([5]) if lone else torch.tensor([5, 0, 9])
    queued = torch.tensor([3]) if lone else torch.tensor([3, 1, 2])
    b, width, capacity = len(old), cfg.block_size, 9 + 3 + cfg.block_size
    features = torch.randn(b, 9, len(cfg.target_layer_ids) * cfg.hidden_size)
    new = torch.randn(b, 3, features.shape[-1])
    block = torch.randn(b, width, cfg.hidden_size)
    lens = old + queued
    if lone:
        context_positions, block_positions = int(old[0]), int(lens[0])
    else:
        context_positions = old[:, None] + torch.arange(3)
        block_positions = lens[:, None] + torch.arange(width)
    separate, folded = drafter.new_cache(b, capacity), drafter.new_cache(b, capacity)
    for cache in (separate, folded):
        drafter.write_context(features, torch.arange(9).expand(b, -1), cache, dtype)
    drafter.write_context(new, context_positions, separate, dtype)
    expected = drafter(block, block_positions, separate, lens, dtype)
    got = drafter(block, block_positions, folded, lens, dtype, context=(new, context_positions))
    # float32: the same GEMMs over other row counts (summation order); bf16: where oneDNN packs it, the
    # stacked rows reach 16 and take it, while the separate write's few rows take fbgemm's float16
    tolerance = 1e-5 if dtype is None else 5e-2
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    for row, n in enumerate(lens.tolist()):
        for got_kv, expected_kv in ((folded.keys, separate.keys), (folded.values, separate.values)):
            torch.testing.assert_close(got_kv[:, row, :, :n], expected_kv[:, row, :, :n], rtol=tolerance,
                                       atol=tolerance)


def test_inference_weights_follow_parameter_updates():
    """An in-place update (an optimizer step) or new data (`.to()`) rebuilds the fused copies."""
    drafter = random_drafter(drafter_config_for(tiny_target_config(), num_layers=1, block_size=4), seed=1, std=0.1)
    first = drafter.inference_weights()
    assert drafter.inference_weights() is first  # nothing changed: no rebuild
    with torch.no_grad():
        drafter.layers[0].self_attn.k_proj.weight.mul_(2)
    rebuilt = drafter.inference_weights()
    assert rebuilt is not first
    fresh = InferenceWeights.build(drafter)
    assert torch.equal(rebuilt.qkv[0].weight, fresh.qkv[0].weight)
    assert torch.equal(rebuilt.context_kv.weight, fresh.context_kv.weight)
    drafter.to(torch.float64)
    assert drafter.inference_weights().gate_up[0].weight.dtype == torch.float64


def test_hooked_projections_are_called_and_give_the_same_outputs(drafter):
    """Calibration hooks q/k/v, gate/up and the experts: the lean paths call those modules then
    (the hooks fire) and the outputs stay those of the fused path."""
    cfg = drafter.config
    hf = random_target(tiny_target_config(), seed=2).float()
    target = GptOssTarget(hf)
    tokens = torch.randint(0, 256, (1, 9))
    features = torch.randn(1, 9, len(cfg.target_layer_ids) * cfg.hidden_size)
    block = torch.randn(1, cfg.block_size, cfg.hidden_size)

    def outputs():
        logits, _ = target(tokens, torch.arange(9)[None], target.new_cache(1, 9), [])
        cache = drafter.new_cache(1, 9 + cfg.block_size)
        drafter.write_context(features[:, :5], torch.arange(5)[None], cache)
        return logits, drafter(block, 9 + torch.arange(cfg.block_size)[None], cache, torch.tensor([9]),
                               context=(features[:, 5:], 5 + torch.arange(4)[None]))

    lean = outputs()
    seen = set()
    watched = {"q": hf.model.layers[0].self_attn.q_proj, "experts": hf.model.layers[1].mlp.experts,
               "draft_k": drafter.layers[0].self_attn.k_proj, "draft_up": drafter.layers[1].mlp.up_proj,
               "draft_fc": drafter.fc, "draft_down": drafter.layers[0].mlp.down_proj}
    handles = [m.register_forward_pre_hook(lambda m, args, name=name: seen.add(name)) for name, m in watched.items()]
    try:
        hooked_outputs = outputs()
    finally:
        for handle in handles:
            handle.remove()
    assert seen == set(watched)
    for got, expected in zip(hooked_outputs, lean):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
