"""The compiled CPU kernels (plugins/draft_block/cpu_kernel.cpp) against the reference formulations, and the
drafter's compiled path against its torch one."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from trtllm_dflash.models.drafter import DFlashDrafter, normed_rotated
from trtllm_dflash.models.random_pair import drafter_config_for, random_drafter, random_target, tiny_target_config
from trtllm_dflash.models.layers import lean_rms_norm
from trtllm_dflash.models.target import GptOssTarget
from trtllm_dflash.plugins.draft_block import cpu
from trtllm_dflash.plugins.draft_block.reference import draft_block_attention_reference
from trtllm_dflash.runtime.accept import greedy_accept, greedy_accept_logits
from trtllm_dflash.runtime.proposers import DFlashProposer
from trtllm_dflash.runtime.sampling import SamplingParams

pytestmark = pytest.mark.skipif(cpu.cpu_kernel() is None, reason=f"kernels not built: {cpu.unavailable_reason()}")


def rotation(rows: int, d: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [rows, D] as `Rotary` gives them (sin signed for rotate-half)."""
    angles = torch.rand(rows, d // 2, generator=gen) * 6
    return torch.cat([angles.cos(), angles.cos()], -1), torch.cat([-angles.sin(), angles.sin()], -1)


def block_case(lens: list[int], block: int, hq: int, hkv: int, d: int, seed: int = 0):
    """Raw q/k/v as strided views of one projection [b, B, Hq + 2 Hkv, D], an arena with NaN past each
    request's context, and the prologue's weights and rotation."""
    gen = torch.Generator().manual_seed(seed)
    b, capacity = len(lens), max(lens) + 5
    qkv = torch.randn(b, block, hq + 2 * hkv, d, generator=gen)
    q, k, v = (part.reshape(b * block, -1, d) for part in (qkv[:, :, :hq], qkv[:, :, hq: hq + hkv], qkv[:, :, hq + hkv:]))
    arena = torch.randn(2, b, hkv, capacity, d, generator=gen)
    for i, n in enumerate(lens):
        arena[:, i, :, n:] = float("nan")  # garbage: never read into a result
    cos, sin = rotation(b * block, d, gen)
    norms = (torch.rand(d, generator=gen) + 0.5, torch.rand(d, generator=gen) + 0.5)
    return q, k, v, arena[0], arena[1], torch.tensor(lens), (*norms, cos, sin)


CASES = [  # (lens, block, Hq, Hkv, D, window)
    ([200], 8, 4, 2, 64, None),  # the embedded drafter's lone request
    ([200], 8, 4, 2, 64, 512),  # a window longer than the context changes nothing
    ([40, 0, 23], 4, 4, 2, 16, 6),  # ragged, an empty context, a window that cuts slot by slot
    ([7, 30], 5, 6, 2, 32, None),  # 15 rows a KV head: the tile's padding
    ([77, 9], 10, 8, 1, 128, 64),  # head_dim 128, one KV head
    ([333, 65], 8, 4, 2, 64, 100),  # values summed in tiles of 32 keys: a ragged last tile, a window across tiles
]


@pytest.mark.parametrize("lens,block,hq,hkv,d,window", CASES)
def test_attention_matches_the_float64_reference(lens, block, hq, hkv, d, window):
    q, k, v, ctx_k, ctx_v, ctx_lens, prologue = block_case(lens, block, hq, hkv, d)
    scale = d ** -0.5
    got = cpu.draft_block_attention_cpu(q, k, v, ctx_k, ctx_v, ctx_lens, scale, window)
    expected = draft_block_attention_reference(*(x.double() for x in (q, k, v, ctx_k, ctx_v)), ctx_lens, scale, window)
    torch.testing.assert_close(got.double().view_as(expected), expected, rtol=1e-5, atol=1e-5)
    q_norm, k_norm, cos, sin = prologue  # with the prologue: QK-norm and RoPE as the torch path applies them
    got = cpu.draft_block_attention_cpu(q, k, v, ctx_k, ctx_v, ctx_lens, scale, window, prologue, 1e-5)
    q, k = (normed_rotated(x, w, cos[:, None], sin[:, None], 1e-5).double() for x, w in ((q, q_norm), (k, k_norm)))
    expected = draft_block_attention_reference(q, k, v.double(), ctx_k.double(), ctx_v.double(), ctx_lens, scale, window)
    torch.testing.assert_close(got.double().view_as(expected), expected, rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), batch=st.integers(1, 3), block=st.integers(1, 9), hkv=st.integers(1, 3),
       group=st.integers(1, 4), d=st.sampled_from([16, 32, 64]), window=st.one_of(st.none(), st.integers(1, 40)))
def test_attention_fuzzed_against_the_float64_reference(data, batch, block, hkv, group, d, window):
    """Any lengths in [0, 30] (full arenas included), blocks of one slot, windows down to 1, odd tiles."""
    lens = data.draw(st.lists(st.integers(0, 30), min_size=batch, max_size=batch))
    q, k, v, ctx_k, ctx_v, ctx_lens, prologue = block_case(lens, block, hkv * group, hkv, d, seed=len(lens))
    ctx_k, ctx_v = ctx_k[:, :, : max(lens)], ctx_v[:, :, : max(lens)]  # the longest context fills its arena row
    got = cpu.draft_block_attention_cpu(q, k, v, ctx_k, ctx_v, ctx_lens, 0.3, window, prologue, 1e-5)
    q_norm, k_norm, cos, sin = prologue
    q, k = (normed_rotated(x, w, cos[:, None], sin[:, None], 1e-5).double() for x, w in ((q, q_norm), (k, k_norm)))
    expected = draft_block_attention_reference(q, k, v.double(), ctx_k.double(), ctx_v.double(), ctx_lens, 0.3, window)
    torch.testing.assert_close(got.double().view_as(expected), expected, rtol=1e-5, atol=1e-5)


def test_attention_refuses_what_it_does_not_take():
    q, k, v, ctx_k, ctx_v, ctx_lens, prologue = block_case([5], 4, 4, 2, 16)
    with pytest.raises(RuntimeError, match="float32"):
        cpu.draft_block_attention_cpu(q.double(), k, v, ctx_k, ctx_v, ctx_lens, 0.25)
    with pytest.raises(RuntimeError, match="lies outside"):
        cpu.draft_block_attention_cpu(q, k, v, ctx_k, ctx_v, torch.tensor([99]), 0.25)
    q, k, v, ctx_k, ctx_v, ctx_lens, _ = block_case([5], 4, 4, 2, 24)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu.draft_block_attention_cpu(q, k, v, ctx_k, ctx_v, ctx_lens, 0.25)


@pytest.mark.parametrize("delta_dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_residual_add_then_the_norm(delta_dtype):
    gen = torch.Generator().manual_seed(1)
    x, delta = torch.randn(2, 7, 256, generator=gen), torch.randn(2, 7, 256, generator=gen).to(delta_dtype)
    weight = torch.rand(256, generator=gen).repeat(2)  # a doubled weight: the first H entries are read
    total, normed = cpu.add_rms_norm_cpu(x, delta, weight, 1e-5)
    assert torch.equal(total, x + delta)
    torch.testing.assert_close(normed, lean_rms_norm(x + delta, weight, 1e-5), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_swiglus_gate(dtype):
    gate_up = (torch.randn(3, 5, 2 * 520, generator=torch.Generator().manual_seed(2)) * 6).to(dtype)  # a ragged tail
    gate, up = gate_up.float().chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = cpu.silu_mul_cpu(gate_up)
    assert got.dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # one rounding to bf16 against torch's two
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)


def test_greedy_peak_is_argmax_and_the_softmax_peak():
    logits = torch.randn(3, 7, 4100, generator=torch.Generator().manual_seed(3)) * 5  # a ragged tail
    logits[0, 0, [17, 4099]] = 100.0  # a tie: the first index wins, as argmax's
    tokens, peak = cpu.greedy_peak_cpu(logits)
    assert torch.equal(tokens, logits.argmax(dim=-1)) and tokens[0, 0] == 17
    torch.testing.assert_close(peak, torch.softmax(logits, dim=-1).amax(dim=-1), rtol=1e-6, atol=1e-7)


@settings(max_examples=60, deadline=None)
@given(batch=st.integers(1, 5), drafts=st.integers(0, 8), vocab=st.sampled_from([5, 16, 37, 4096]),
       seed=st.integers(0, 2**16))
def test_greedy_verify_is_argmax_and_the_accept_rule(batch, drafts, vocab, seed):
    """Per request: drafts that copy the target's argmax up to a random point (then a miss or the end), ties in the
    logits (the first index wins, as argmax's) and NaN-free garbage after the first mismatch, which it need not read."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, drafts + 1, vocab, generator=gen).round()  # integers: many ties
    target = logits.argmax(dim=-1)
    agree = torch.randint(0, drafts + 1, (batch,), generator=gen)  # leading drafts equal to the target's
    draft_tokens = torch.where(torch.arange(drafts) < agree[:, None], target[:, :drafts],
                               (target[:, :drafts] + 1) % vocab)
    expected = greedy_accept(draft_tokens, target)
    assert torch.equal(expected[0], agree)
    got = cpu.greedy_verify_cpu(logits, draft_tokens)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert all(torch.equal(g, e) for g, e in zip(greedy_accept_logits(draft_tokens, logits), expected))
    block = torch.cat([target[:, :1], draft_tokens], dim=1)  # the drafts as the loop hands them: a block's view
    assert all(torch.equal(g, e) for g, e in zip(cpu.greedy_verify_cpu(logits, block[:, 1:]), expected))


def test_greedy_verify_refuses_what_it_does_not_take():
    with pytest.raises(RuntimeError, match="drafts"):
        cpu.greedy_verify_cpu(torch.randn(2, 4, 16), torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="each row contiguous"):  # a row's drafts strided
        cpu.greedy_verify_cpu(torch.randn(3, 4, 16), torch.zeros(3, 3, dtype=torch.int64).t())
    with pytest.raises(RuntimeError, match="float32"):
        cpu.greedy_verify_cpu(torch.randn(2, 4, 16).double(), torch.zeros(2, 3, dtype=torch.int64))


def compiled_and_torch(drafter: DFlashDrafter, run) -> tuple:
    """run(drafter) with the compiled kernels, then with the torch formulation."""
    outs = []
    for use in (True, False):
        drafter.use_cpu_kernel = use
        outs.append(run(drafter))
    drafter.use_cpu_kernel = True
    return tuple(outs)


@pytest.mark.parametrize("lens,window,committed", [([19], None, 0), ([19], None, 3), ([19], 12, 2),
                                                   ([5, 30, 0], 9, 0), ([5, 30, 0], None, 2)])
def test_drafter_compiled_path_matches_its_torch_path(lens, window, committed):
    """Lone requests and ragged batches, with and without committed tokens' context written in the step,
    with a window that cuts: the same hidden states and the same context K/V in the arena (the prompts' written
    by `write_context`, the committed tokens' by the step)."""
    config = dataclasses.replace(drafter_config_for(tiny_target_config(), num_layers=2, block_size=4),
                                 sliding_window=window)
    drafter = random_drafter(config, seed=5)
    assert drafter.uses_cpu_kernels()
    b, width, features = len(lens), config.block_size, len(config.target_layer_ids) * config.hidden_size

    def run(model):
        gen = torch.Generator().manual_seed(6)
        cache = model.new_cache(b, max(lens) + committed + width)
        model.write_context(torch.randn(b, max(lens), features, generator=gen), torch.arange(max(lens)).expand(b, -1), cache)
        embeds = torch.randn(b, width, config.hidden_size, generator=gen)
        context_lens = torch.tensor(lens) + committed
        new = torch.randn(b, committed, features, generator=gen)
        if b == 1:
            positions, context = int(context_lens[0]), (new, lens[0])
        else:
            positions = context_lens[:, None] + torch.arange(width)
            context = (new, torch.tensor(lens)[:, None] + torch.arange(committed))
        hidden = model(embeds, positions, cache, context_lens, context=context if committed else None)
        return hidden, [arena[:, i, :, :n] for i, n in enumerate(context_lens.tolist()) for arena in (cache.keys, cache.values)]

    (compiled, compiled_keys), (plain, plain_keys) = compiled_and_torch(drafter, run)
    torch.testing.assert_close(compiled, plain, rtol=1e-5, atol=1e-5)
    for got, expected in zip(compiled_keys, plain_keys):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_disabled_kernels_leave_the_torch_path():
    """TRTLLM_DFLASH_CPU_KERNEL=0: no build, the reason said, the drafter on its torch formulation."""
    code = ("from trtllm_dflash.plugins.draft_block import cpu\n"
            "from trtllm_dflash.models.random_pair import drafter_config_for, random_drafter, tiny_target_config\n"
            "drafter = random_drafter(drafter_config_for(tiny_target_config()))\n"
            "print(cpu.cpu_kernel(), cpu.unavailable_reason(), drafter.uses_cpu_kernels())\n")
    env = {**os.environ, cpu.DISABLE_VARIABLE: "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["None", f"{cpu.DISABLE_VARIABLE}=0", "False"]


def test_greedy_drafts_and_their_confidence_match_the_torch_path():
    """The proposer's greedy step through the kernels (argmax and softmax peak in one pass) drafts what the
    torch path drafts, with the same confidences."""
    config = tiny_target_config()
    target = GptOssTarget(random_target(config, seed=1))
    drafter = random_drafter(drafter_config_for(config, num_layers=2, block_size=4), seed=2)
    prompt = torch.randint(2, 250, (1, 12), generator=torch.Generator().manual_seed(7))

    def run(model):
        proposer = DFlashProposer(model, target)
        proposer.keep_confidence = True
        cache = target.new_cache(1, 40)
        _, features = target(prompt, torch.arange(12)[None], cache, proposer.feature_layers)
        proposer.start(features, torch.tensor([12]), 40)
        drafts, q = proposer.draft(torch.tensor([5]), torch.tensor([12]), 3, SamplingParams(), torch.Generator())
        return drafts, q, proposer.confidence

    (drafts, q, confidence), (expected_drafts, expected_q, expected_confidence) = compiled_and_torch(drafter, run)
    assert torch.equal(drafts, expected_drafts) and q is None and expected_q is None
    torch.testing.assert_close(confidence, expected_confidence, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batch,window,greedy,dtype", [
    (1, None, True, torch.bfloat16), (1, 10, False, torch.bfloat16), (3, None, True, torch.bfloat16),
    (3, 10, False, torch.bfloat16), (1, None, True, torch.int8), (3, 10, False, torch.int8)])
def test_the_whole_compiled_step_drafts_what_the_per_call_path_drafts(batch, window, greedy, dtype, monkeypatch):
    """A drafter step in one compiled call (`WholeDraftStep`, every GEMM the bf16 or int8 dot kernel) from the same
    state as the per-call compiled path, over steps that commit 1-4 tokens, steps that only write the committed
    tokens' context (as a suffix-drafted step does; the prompts' too) and a window that cuts: the same verify blocks
    (the anchors, then the drafts), confidences and sampling distributions, and the same context K/V in the arena."""
    if cpu.dot_kernel(dtype) is None:
        pytest.skip(f"no {dtype} dot GEMM here")
    config = tiny_target_config(vocab_size=272)  # widths the dot GEMM takes (multiples of 16 out, 32 in)
    target = GptOssTarget(random_target(config, seed=1))
    drafter = random_drafter(dataclasses.replace(drafter_config_for(config, num_layers=2, block_size=4),
                                                 sliding_window=window), seed=2)
    norms = torch.Generator().manual_seed(3)
    for name, param in drafter.named_parameters():  # distinct norms, so that swapping two would show
        if name.endswith("norm.weight"):
            param.data.uniform_(0.5, 1.5, generator=norms)
    prompts = torch.randint(2, 250, (batch, 12), generator=torch.Generator().manual_seed(7))
    lens = torch.tensor([12, 7, 10][:batch])
    params = SamplingParams() if greedy else SamplingParams(temperature=0.7)
    accepted = [[0, 3, 1][:batch], [3, 0, 2][:batch], [1, 1, 3][:batch]]

    def run(whole: bool):
        proposer = DFlashProposer(drafter, target, matmul_dtype=dtype)
        proposer.keep_confidence = True
        _, features = target(prompts, torch.arange(12).expand(batch, -1), target.new_cache(batch, 60),
                             proposer.feature_layers)
        with monkeypatch.context() as patch:
            if not whole:  # the prompts' context through the per-call path too
                patch.setattr(drafter, "whole_step", lambda *args: None)
            proposer.start(features, lens, 60)
        assert (proposer.whole_step is not None) == whole
        gen, steps, positions = torch.Generator().manual_seed(8), [], lens.clone()
        for step, kept in enumerate(accepted):
            anchors = torch.randint(2, 250, (batch,), generator=gen)
            block, q = proposer.draft(anchors, positions, 3, params, torch.Generator().manual_seed(step))
            assert block.shape == (batch, 4) and torch.equal(block[:, 0], anchors)
            steps.append((block, q, proposer.confidence))
            for _ in range(2):  # two steps' commits written alone (`write_pending_context`, as `start` writes the
                # prompts'): the next draft then has no committed rows of its own
                proposer.commit(torch.randn(batch, 4, features.shape[-1], generator=gen), torch.tensor(kept))
                positions = positions + torch.tensor(kept) + 1
            proposer.write_pending_context()
        return steps, proposer.cache

    (whole_steps, whole_cache), (steps, cache) = run(True), run(False)
    for (block, q, confidence), (expected_block, expected_q, expected_confidence) in zip(whole_steps, steps):
        assert torch.equal(block, expected_block)
        torch.testing.assert_close(confidence, expected_confidence, rtol=1e-6, atol=1e-7)
        assert (q is None) == greedy and (expected_q is None) == greedy
        if not greedy:
            torch.testing.assert_close(q, expected_q, rtol=1e-6, atol=1e-7)
    assert torch.equal(whole_cache.keys, cache.keys) and torch.equal(whole_cache.values, cache.values)
