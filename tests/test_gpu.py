"""Checks that need a CUDA GPU: compiled Triton kernels, custom ops, the drafter and the runtime on CUDA.

Skipped on machines without CUDA (CI); run on a GPU host with ``pytest -q tests/test_gpu.py``. Each
test compares the CUDA path with a CPU reference, never with a stored number.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="Triton runs in interpreter mode in this session; the GPU checks need compiled kernels"),
]

CUDA = "cuda"
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


# ---- draft-block kernels, compiled, against the float64 reference ----------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 1, 7, 150])
@pytest.mark.parametrize("split_size", [None, 64, 128])
def test_block_attention_ragged(dtype, window, split_size):
    from draft_block_cases import check_against_float64, problem

    args = problem(4, 3, 6, 2, 16, 300, [0, 1, 130, 300], seed=0, device=CUDA, dtype=dtype)
    check_against_float64(args, 0.3, window, split_size, tol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 2048])
@pytest.mark.parametrize("split_size", [None, 512, 16384])  # planned, split-K, one split (fused kernel)
def test_block_attention_real_drafter_shapes(dtype, window, split_size):
    """gpt-oss-120b drafter (Hq 64, Hkv 8, D 64, B 10) with long, ragged and empty contexts."""
    from draft_block_cases import check_against_float64, problem

    args = problem(3, 10, 64, 8, 64, 12000, [12000, 3001, 0], seed=1, device=CUDA, dtype=dtype)
    check_against_float64(args, 64**-0.5, window, split_size, tol=TOLERANCE[dtype])


@pytest.mark.parametrize("block_n", [32, 64, 128])
@pytest.mark.parametrize("num_warps", [4, 8])
def test_every_benchmarked_launch_config_is_correct(block_n, num_warps):
    """Each launch configuration the tuning sweep may pick computes the same attention."""
    from draft_block_cases import check_against_float64, problem

    from trtllm_dflash.plugins.draft_block.triton_kernels import LaunchConfig

    args = problem(2, 10, 64, 8, 64, 1500, [1500, 700], seed=2, device=CUDA, dtype=torch.bfloat16)
    for split_size in (None, 1536):
        check_against_float64(args, 0.125, None, split_size, tol=2e-2,
                              launch=LaunchConfig(block_n, num_warps, num_stages=3))


def test_block_attention_strided_arena_view():
    from draft_block_cases import check_against_float64, problem

    q, k_blk, v_blk, ctx_k, ctx_v, lens = problem(2, 4, 4, 2, 16, 96, [50, 96], seed=3, device=CUDA)
    stacked_k = torch.stack([torch.zeros_like(ctx_k), ctx_k], dim=1)
    stacked_v = torch.stack([torch.zeros_like(ctx_v), ctx_v], dim=1)
    args = (q, k_blk, v_blk, stacked_k[:, 1], stacked_v[:, 1], lens)
    assert not args[3].is_contiguous()
    check_against_float64(args, 0.25, None, split_size=64)


@pytest.mark.parametrize("num_drafts", [0, 1, 9])
def test_greedy_accept_kernel(num_drafts):
    from trtllm_dflash.plugins.draft_block.reference import greedy_accept_reference
    from trtllm_dflash.plugins.draft_block.triton_kernels import greedy_accept_triton

    g = torch.Generator().manual_seed(num_drafts)
    target = torch.randint(0, 4, (64, num_drafts + 1), generator=g)
    drafts = torch.where(torch.rand(64, num_drafts, generator=g) < 0.8, target[:, :-1], 5)
    lengths = torch.randint(0, 1000, (64,), generator=g, dtype=torch.int32)
    got = greedy_accept_triton(drafts.to(CUDA), target.to(CUDA), lengths.to(CUDA))
    for a, b in zip(got, greedy_accept_reference(drafts, target, lengths)):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b)


# ---- torch custom ops on CUDA: opcheck, torch.compile, CUDA graphs ---------------------------

def _op_args(dtype=torch.float32):
    from draft_block_cases import problem

    return problem(3, 4, 8, 2, 32, 700, [700, 0, 333], seed=4, device=CUDA, dtype=dtype)


def test_opcheck_on_cuda():
    importlib.import_module("trtllm_dflash.plugins.draft_block.ops")  # registers torch.ops.dflash.*

    args = [t.nan_to_num(0.0, 0.0, 0.0) if t.is_floating_point() else t for t in _op_args()]
    torch.library.opcheck(torch.ops.dflash.draft_block_attention.default, (*args, 0.2, None))
    drafts = torch.tensor([[1, 2, 0], [1, 1, 1]], device=CUDA)
    target = torch.tensor([[1, 2, 2, 5], [1, 0, 1, 1]], device=CUDA)
    torch.library.opcheck(torch.ops.dflash.dflash_accept.default, (drafts, torch.tensor([3, 4], device=CUDA)),
                          {"target_tokens": target})


def test_torch_compile_inductor_fullgraph():
    from trtllm_dflash.plugins.draft_block import draft_block_attention, greedy_accept_update

    def step(q, k_blk, v_blk, ctx_k, ctx_v, lens, drafts, target):
        out = draft_block_attention(q * 2, k_blk, v_blk, ctx_k, ctx_v, lens, 0.2, 64)
        accepted, bonus, new_lens = greedy_accept_update(drafts, target, lens)
        return out.float().sum(-1), accepted, bonus, new_lens

    compiled = torch.compile(step, fullgraph=True)
    drafts = torch.tensor([[1, 2, 0], [1, 1, 1], [0, 0, 0]], device=CUDA)
    target = torch.tensor([[1, 2, 2, 5], [1, 0, 1, 1], [0, 0, 0, 0]], device=CUDA)
    args = (*_op_args(torch.bfloat16), drafts, target)
    got, want = compiled(*args), step(*args)
    torch.testing.assert_close(got[0], want[0], rtol=1e-2, atol=1e-2)
    for a, b in zip(got[1:], want[1:]):
        assert torch.equal(a, b)


def test_cuda_graph_replay_follows_new_lengths():
    """Captured once; replays with other live lengths (same S_cap) give the reference result."""
    from trtllm_dflash.plugins.draft_block import draft_block_attention
    from trtllm_dflash.plugins.draft_block.reference import draft_block_attention_reference

    q, k_blk, v_blk, ctx_k, ctx_v, lens = (t.nan_to_num(0.0, 0.0, 0.0) if t.is_floating_point() else t
                                           for t in _op_args())
    draft_block_attention(q, k_blk, v_blk, ctx_k, ctx_v, lens, 0.2)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = draft_block_attention(q, k_blk, v_blk, ctx_k, ctx_v, lens, 0.2)
    for new_lens in ([1, 700, 64], [0, 0, 0], [699, 5, 512]):
        lens.copy_(torch.tensor(new_lens))
        graph.replay()
        expected = draft_block_attention_reference(*(t.cpu() for t in (q, k_blk, v_blk, ctx_k, ctx_v, lens)), 0.2,
                                                   compute_dtype=torch.float64)
        torch.testing.assert_close(out.cpu().double(), expected.double(), rtol=2e-5, atol=2e-5)


# ---- the drafter and the reference runtime on CUDA -------------------------------------------

@pytest.fixture(scope="module")
def embedded_on_cuda():
    from trtllm_dflash.checkpoints.gpt_oss import load_hf_gpt_oss
    from trtllm_dflash.embedded import pair_paths
    from trtllm_dflash.models.drafter import load_drafter
    from trtllm_dflash.models.target import GptOssTarget

    target_dir, drafter_dir = pair_paths()
    hf = load_hf_gpt_oss(target_dir, CUDA, torch.float32)
    return hf, GptOssTarget(hf), load_drafter(drafter_dir, CUDA, torch.float32), target_dir


def _heldout_token_prompts(target_dir, count):
    from trtllm_dflash.embedded import heldout_prompts
    from trtllm_dflash.prompts import load_tokenizer

    tokenizer = load_tokenizer(target_dir)
    return [tokenizer.encode(p) for p in heldout_prompts(count)]


@torch.no_grad()
def _greedy_generate(hf, prompts, max_new_tokens):
    """transformers' greedy `generate` of each prompt alone on CUDA: the tokens the runtime must reproduce."""
    return [hf.generate(torch.tensor([p], device=CUDA), attention_mask=torch.ones(1, len(p), device=CUDA,
                        dtype=torch.long), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def test_drafter_plugin_switch_on_cuda(embedded_on_cuda):
    from draft_block_cases import drafter_plain_and_plugin

    plain, plugged = drafter_plain_and_plugin(embedded_on_cuda[2], [280, 0, 97], context=280, seed=5)
    torch.testing.assert_close(plugged, plain, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("inflight", [False, True], ids=["static", "inflight"])
@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("use_plugin", [False, True])
def test_reference_runtime_lossless_on_cuda(embedded_on_cuda, batch_size, use_plugin, inflight):
    """Embedded pair on CUDA (float32): DFlash, n-gram and dflash-sa greedy == transformers' greedy generate, in
    static batches and in flight (newcomers' rows placed in CUDA arenas)."""
    from trtllm_dflash.runtime.proposers import DFlashProposer, NGramProposer, SuffixDFlashProposer
    from trtllm_dflash.runtime.reference import ReferenceRuntime
    from trtllm_dflash.runtime.sampling import SamplingParams

    hf, target, drafter, target_dir = embedded_on_cuda
    prompts = _heldout_token_prompts(target_dir, 8)
    expected = _greedy_generate(hf, prompts, 48)
    params = SamplingParams(max_tokens=48)
    drafter.use_plugin = use_plugin
    try:
        for proposer in (DFlashProposer(drafter, target), NGramProposer(num_drafts=7),
                         SuffixDFlashProposer(DFlashProposer(drafter, target))):
            runtime = ReferenceRuntime(target, proposer, inflight=inflight)
            results = runtime.generate(prompts, params, batch_size=batch_size)
            assert [r.output_token_ids for r in results] == expected
            assert sum(r.stats.acceptance_length for r in results) / len(results) > 1.0
    finally:
        drafter.use_plugin = False


def test_the_adaptive_policy_reads_cuda_confidences(embedded_on_cuda):
    """The adaptive dflash-sa on CUDA (the policy compiled where the CPU kernels build: it copies the drafter's CUDA
    confidences as `tolist` did) stays equal to greedy `generate`, with drafter steps truncated by it."""
    from trtllm_dflash.runtime.draft_length import adaptive_draft_length
    from trtllm_dflash.runtime.proposers import DFlashProposer, SuffixDFlashProposer
    from trtllm_dflash.runtime.reference import ReferenceRuntime
    from trtllm_dflash.runtime.sampling import SamplingParams

    hf, target, drafter, target_dir = embedded_on_cuda
    prompts = _heldout_token_prompts(target_dir, 4)
    expected = _greedy_generate(hf, prompts, 32)
    cheap = [1.0 + 0.05 * k for k in range(16)]  # drafting nearly free: drafter steps happen
    policy = adaptive_draft_length({"neural": cheap[:8], "suffix": cheap})
    proposer = SuffixDFlashProposer(DFlashProposer(drafter, target), policy=policy, max_suffix_drafts=15)
    results = ReferenceRuntime(target, proposer).generate(prompts, SamplingParams(max_tokens=32), batch_size=2)
    assert [r.output_token_ids for r in results] == expected
    assert any(policy.chosen["neural"])


def test_rejection_sampling_on_cuda_is_seeded(embedded_on_cuda):
    from trtllm_dflash.runtime.proposers import DFlashProposer
    from trtllm_dflash.runtime.reference import ReferenceRuntime
    from trtllm_dflash.runtime.sampling import SamplingParams

    _, target, drafter, target_dir = embedded_on_cuda
    prompts = _heldout_token_prompts(target_dir, 3)
    runtime = ReferenceRuntime(target, DFlashProposer(drafter, target))
    params = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=7)
    first = [r.output_token_ids for r in runtime.generate(prompts, params, batch_size=3)]
    again = [r.output_token_ids for r in runtime.generate(prompts, params, batch_size=3)]
    assert first == again and all(len(o) == 32 for o in first)


# ---- drafter training on CUDA (device placement, bf16 autocast) ------------------------------

def test_drafter_training_on_cuda(tmp_path):
    """The CPU test's 40-step run, on CUDA: the loss falls and the drafter it writes is lossless there."""
    from test_train_drafter import check_drafter_is_lossless, short_training_run

    target_dir, drafter_dir, _ = short_training_run(tmp_path, torch.device(CUDA), resume=False)
    check_drafter_is_lossless(target_dir, drafter_dir, CUDA)


# ---- quantization codecs: CUDA bit-identical to CPU ------------------------------------------

def test_codecs_on_cuda_match_cpu():
    from trtllm_dflash.quant import codecs

    g = torch.Generator().manual_seed(6)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-3, 3, 64)[:, None]
    x[3] = 0.0
    for encode in (lambda t: codecs.fp8_encode(t, scale_dims=1), lambda t: codecs.nvfp4_encode(t, scale_dims=1)):
        for a, b in zip(encode(x), encode(x.to(CUDA))):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                                                      (b.view(torch.uint8) if b.dtype.itemsize == 1 else b).cpu())
    blocks, scales = codecs.mxfp4_encode(x)
    cuda_blocks, cuda_scales = codecs.mxfp4_encode(x.to(CUDA))
    assert torch.equal(blocks, cuda_blocks.cpu()) and torch.equal(scales, cuda_scales.cpu())
    assert torch.equal(codecs.mxfp4_decode(blocks, scales), codecs.mxfp4_decode(cuda_blocks, cuda_scales).cpu())
    for a, b in zip(codecs.mxfp4_to_nvfp4(blocks, scales), codecs.mxfp4_to_nvfp4(cuda_blocks, cuda_scales)):
        assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                           (b.view(torch.uint8) if b.dtype.itemsize == 1 else b).cpu())
