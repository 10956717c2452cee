"""torch custom ops dflash::draft_block_attention / dflash::dflash_accept: opcheck, torch.compile, parity."""

from __future__ import annotations

import pytest
import torch

from trtllm_dflash.plugins.draft_block import draft_block_attention, greedy_accept_update, rejection_accept_update
from trtllm_dflash.plugins.draft_block.reference import (
    draft_block_attention_reference,
    greedy_accept_reference,
    rejection_accept_reference,
)


def attention_args(seed=0, batch=2, block=3, q_heads=4, kv_heads=2, dim=16, s_cap=20, lens=(0, 13)):
    g = torch.Generator().manual_seed(seed)
    rows = batch * block
    return (
        torch.randn(rows, q_heads, dim, generator=g), torch.randn(rows, kv_heads, dim, generator=g),
        torch.randn(rows, kv_heads, dim, generator=g), torch.randn(batch, kv_heads, s_cap, dim, generator=g),
        torch.randn(batch, kv_heads, s_cap, dim, generator=g), torch.tensor(lens, dtype=torch.int32),
    )


def greedy_args(seed=0):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 3, (5, 4), generator=g)
    drafts = torch.where(torch.rand(5, 3, generator=g) < 0.7, target[:, :-1], 3)
    return drafts, target, torch.tensor([3, 0, 7, 1, 2], dtype=torch.int32)


def sampling_args(seed=0, vocab=6):
    g = torch.Generator().manual_seed(seed)
    drafts = torch.randint(0, vocab, (5, 3), generator=g)
    return (drafts, torch.rand(5, 3, vocab, generator=g).softmax(-1), torch.rand(5, 4, vocab, generator=g).softmax(-1),
            torch.rand(5, 4, generator=g), torch.arange(5))


@pytest.mark.parametrize("window", [None, 4])
def test_opcheck_attention(window):
    torch.library.opcheck(torch.ops.dflash.draft_block_attention.default, (*attention_args(), 0.25, window))


def test_opcheck_accept():
    drafts, target, lengths = greedy_args()
    torch.library.opcheck(torch.ops.dflash.dflash_accept.default, (drafts, lengths), {"target_tokens": target})
    drafts, dp, tp, u, lengths = sampling_args()
    torch.library.opcheck(torch.ops.dflash.dflash_accept.default, (drafts, lengths),
                          {"draft_probs": dp, "target_probs": tp, "uniforms": u})


def test_ops_equal_reference():
    args = attention_args(1)
    assert torch.equal(draft_block_attention(*args, 0.3, 5), draft_block_attention_reference(*args, 0.3, 5))
    for got, want in zip(greedy_accept_update(*greedy_args(1)), greedy_accept_reference(*greedy_args(1))):
        assert got.dtype == want.dtype and torch.equal(got, want)
    for got, want in zip(rejection_accept_update(*sampling_args(1)), rejection_accept_reference(*sampling_args(1))):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_accept_rejects_mixed_modes():
    drafts, target, lengths = greedy_args()
    with pytest.raises(ValueError, match="either"):
        torch.ops.dflash.dflash_accept(drafts, lengths, target_tokens=target, uniforms=torch.rand(5, 4))


def test_torch_compile_fullgraph_uses_fake_kernels():
    """aot_eager traces through the fake kernels (fullgraph: no graph break) and runs the real ones."""

    def layer_step(q, k_blk, v_blk, ctx_k, ctx_v, ctx_lens, drafts, target):
        out = draft_block_attention(q * 2, k_blk, v_blk, ctx_k, ctx_v, ctx_lens, 0.25, 6)
        accepted, bonus, new_lens = greedy_accept_update(drafts, target, ctx_lens)
        return out.sum(-1), accepted, bonus, new_lens

    compiled = torch.compile(layer_step, backend="aot_eager", fullgraph=True)
    drafts, target = torch.tensor([[1, 2, 0], [1, 1, 1]]), torch.tensor([[1, 2, 2, 5], [1, 0, 1, 1]])
    args = (*attention_args(2, lens=(4, 9)), drafts, target)
    for got, want in zip(compiled(*args), layer_step(*args)):
        assert torch.equal(got, want)
