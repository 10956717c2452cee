"""Reference semantics of the draft-block op against a per-request loop written from the spec."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_dflash.plugins.draft_block.reference import (
    draft_block_attention_reference,
    greedy_accept_reference,
    rejection_accept_reference,
)
from trtllm_dflash.runtime.accept import greedy_accept, rejection_accept


def naive_block_attention(q, k_blk, v_blk, ctx_k, ctx_v, ctx_lens, scale, window=None):
    """Request by request, query by query, straight from the spec (float64)."""
    batch, kv_heads = ctx_k.shape[:2]
    block = q.shape[0] // batch
    group = q.shape[1] // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(batch):
        n = int(ctx_lens[i])
        for j in range(block):
            lo = 0 if window is None else max(0, n + j - window + 1)
            for h in range(q.shape[1]):
                g = h // group
                keys = torch.cat([ctx_k[i, g, lo:n], k_blk[i * block : (i + 1) * block, g]]).double()
                vals = torch.cat([ctx_v[i, g, lo:n], v_blk[i * block : (i + 1) * block, g]]).double()
                weights = torch.softmax(keys @ q[i * block + j, h].double() * scale, dim=0)
                out[i * block + j, h] = weights @ vals
    return out


def random_problem(batch, block, q_heads, kv_heads, dim, s_cap, lens, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    rows = batch * block
    tensors = [
        torch.randn(rows, q_heads, dim, generator=g, dtype=dtype),
        torch.randn(rows, kv_heads, dim, generator=g, dtype=dtype),
        torch.randn(rows, kv_heads, dim, generator=g, dtype=dtype),
        torch.randn(batch, kv_heads, s_cap, dim, generator=g, dtype=dtype),
        torch.randn(batch, kv_heads, s_cap, dim, generator=g, dtype=dtype),
    ]
    ctx_lens = torch.tensor(lens, dtype=torch.int32)
    for i, n in enumerate(lens):  # arena tails are garbage, NaN included
        tensors[3][i, :, n:] = float("nan")
        tensors[4][i, :, n:] = float("inf")
    return (*tensors, ctx_lens)


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 3), block=st.integers(1, 5), kv_heads=st.integers(1, 2), group=st.integers(1, 3),
    s_cap=st.integers(0, 12), window=st.one_of(st.none(), st.integers(1, 8)), data=st.data(),
)
def test_reference_matches_naive(batch, block, kv_heads, group, s_cap, window, data):
    lens = data.draw(st.lists(st.integers(0, s_cap), min_size=batch, max_size=batch))
    args = random_problem(batch, block, kv_heads * group, kv_heads, 4, s_cap, lens, seed=len(lens))
    expected = naive_block_attention(*args, 0.5, window)
    got = draft_block_attention_reference(*args, 0.5, window)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_empty_context_attends_to_block_only():
    args = random_problem(2, 3, 4, 2, 8, 5, [0, 0], seed=0)
    got = draft_block_attention_reference(*args, 0.3)
    torch.testing.assert_close(got, naive_block_attention(*args, 0.3))
    assert torch.isfinite(got).all()


def test_window_one_hides_the_whole_context():
    args = random_problem(1, 4, 2, 1, 8, 6, [6], seed=1)
    no_ctx = random_problem(1, 4, 2, 1, 8, 6, [0], seed=1)
    torch.testing.assert_close(draft_block_attention_reference(*args, 0.3, 1), draft_block_attention_reference(*no_ctx, 0.3))


def test_compute_dtype_float64_for_half_inputs():
    args = random_problem(2, 3, 4, 2, 8, 7, [3, 7], seed=2, dtype=torch.float32)
    half = [t.half() if t.is_floating_point() else t for t in args]
    got = draft_block_attention_reference(*half, 0.3, compute_dtype=torch.float64)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.double(), naive_block_attention(*half, 0.3), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("lens", [[-1, 2], [3, 8]])
def test_lengths_outside_the_arena_are_rejected(lens):
    args = random_problem(2, 2, 2, 1, 4, 7, [0, 0], seed=3)
    with pytest.raises(ValueError, match="ctx_lens"):
        draft_block_attention_reference(*args[:5], torch.tensor(lens), 0.5)


def test_accept_wrappers_add_lengths():
    g = torch.Generator().manual_seed(4)
    drafts = torch.randint(0, 3, (16, 5), generator=g)
    targets = torch.randint(0, 3, (16, 6), generator=g)
    lengths = torch.randint(0, 100, (16,), generator=g, dtype=torch.int32)
    n, bonus, new = greedy_accept_reference(drafts, targets, lengths)
    n_rt, bonus_rt = greedy_accept(drafts, targets)
    assert torch.equal(n, n_rt) and torch.equal(bonus, bonus_rt)
    assert new.dtype == torch.int32 and torch.equal(new, lengths + n_rt.int() + 1)

    vocab = 7
    draft_probs = torch.rand(16, 5, vocab, generator=g).softmax(-1)
    target_probs = torch.rand(16, 6, vocab, generator=g).softmax(-1)
    uniforms = torch.rand(16, 6, generator=g)
    n, bonus, new = rejection_accept_reference(drafts, draft_probs, target_probs, uniforms, lengths.long())
    n_rt, bonus_rt = rejection_accept(drafts, draft_probs, target_probs, uniforms)
    assert torch.equal(n, n_rt) and torch.equal(bonus, bonus_rt) and torch.equal(new, lengths.long() + n_rt + 1)
