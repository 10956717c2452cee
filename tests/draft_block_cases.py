"""Problems and the float64 check shared by the draft-block kernel tests (interpreter and CUDA)."""

from __future__ import annotations

import torch

from trtllm_dflash.plugins.draft_block.reference import draft_block_attention_reference


def problem(batch, block, q_heads, kv_heads, dim, s_cap, lens, seed, device="cpu", dtype=torch.float32):
    """Random inputs; arena tails filled with NaN/inf garbage the kernel must never read."""
    g = torch.Generator().manual_seed(seed)
    rows = batch * block
    q = torch.randn(rows, q_heads, dim, generator=g)
    k_blk, v_blk = torch.randn(2, rows, kv_heads, dim, generator=g)
    ctx_k, ctx_v = torch.randn(2, batch, kv_heads, s_cap, dim, generator=g)
    for i, n in enumerate(lens):
        ctx_k[i, :, n:] = float("nan")
        ctx_v[i, :, n:] = float("inf")
    tensors = [t.to(device, dtype) for t in (q, k_blk, v_blk, ctx_k, ctx_v)]
    return (*tensors, torch.tensor(lens, dtype=torch.int32, device=device))


def check_against_float64(args, scale, window, split_size, tol=2e-5, launch=None):
    """The Triton op on ``args`` (any device) against the reference in float64 on the CPU."""
    from trtllm_dflash.plugins.draft_block import triton_kernels as kernels

    extra = {} if launch is None else {"launch": launch}
    got = kernels.draft_block_attention_triton(*args, scale, window, split_size=split_size, **extra)
    cpu_args = [t.cpu() for t in args]
    expected = draft_block_attention_reference(*cpu_args, scale, window, compute_dtype=torch.float64)
    assert got.dtype == args[0].dtype and got.device == args[0].device and torch.isfinite(got).all()
    torch.testing.assert_close(got.cpu().double(), expected.double(), rtol=tol, atol=tol)


def drafter_plain_and_plugin(drafter, context_lens, context: int, seed: int = 0):
    """One drafted block on the drafter's device, with the plain attention path and with the plugin op.

    Every request's context holds ``context`` positions of random target features; request i sees
    the first ``context_lens[i]`` of them. Returns (plain, plugin) final hidden states.
    """
    cfg = drafter.config
    device = drafter.fc.weight.device
    b, width = len(context_lens), cfg.block_size
    g = torch.Generator().manual_seed(seed)
    cache = drafter.new_cache(b, context + width)
    features = torch.randn(b, context, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g).to(device)
    drafter.write_context(features, torch.arange(context, device=device).expand(b, -1), cache)
    lens = torch.tensor(context_lens, device=device)
    block = torch.randn(b, width, cfg.hidden_size, generator=g).to(device)
    positions = lens[:, None] + torch.arange(width, device=device)
    plain = drafter(block, positions, cache, lens)
    drafter.use_plugin = True
    try:
        return plain, drafter(block, positions, cache, lens)
    finally:
        drafter.use_plugin = False
