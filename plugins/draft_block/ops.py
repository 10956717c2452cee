"""torch custom ops ``dflash::draft_block_attention`` and ``dflash::dflash_accept``.

Importing this module registers both ops (``torch.ops.dflash.*``): CPU kernels are the reference
implementations, CUDA kernels the Triton ones (imported lazily, at first CUDA call, so importing the
ops never needs triton), and fake kernels give ``torch.compile`` / ``torch.export`` / CUDA-graph
capture the output shapes without running anything. The ops are opaque to the compiler, which is the
point: one kernel launch per layer instead of a decomposed SDPA over a padded arena.

Call them through the typed wrappers at the bottom of this module.
"""

from __future__ import annotations

import torch

from .reference import (
    draft_block_attention_reference,
    greedy_accept_reference,
    rejection_accept_reference,
)


@torch.library.custom_op("dflash::draft_block_attention", mutates_args=(), device_types="cpu")
def _draft_block_attention(
    q: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    return draft_block_attention_reference(q, k_blk, v_blk, ctx_k, ctx_v, ctx_lens, scale, sliding_window)


@_draft_block_attention.register_kernel("cuda")
def _draft_block_attention_cuda(q, k_blk, v_blk, ctx_k, ctx_v, ctx_lens, scale, sliding_window=None):
    from .triton_kernels import draft_block_attention_triton

    return draft_block_attention_triton(q, k_blk, v_blk, ctx_k, ctx_v, ctx_lens, scale, sliding_window)


@_draft_block_attention.register_fake
def _draft_block_attention_fake(q, k_blk, v_blk, ctx_k, ctx_v, ctx_lens, scale, sliding_window=None):
    return torch.empty_like(q)


def _accept_mode(target_tokens, draft_probs, target_probs, uniforms) -> str:
    """'greedy' (target_tokens given) or 'sampling' (the three probability inputs given)."""
    sampling = (draft_probs, target_probs, uniforms)
    if target_tokens is not None and all(t is None for t in sampling):
        return "greedy"
    if target_tokens is None and all(t is not None for t in sampling):
        return "sampling"
    raise ValueError("dflash_accept takes either target_tokens (greedy) or draft_probs, target_probs and uniforms (sampling)")


@torch.library.custom_op("dflash::dflash_accept", mutates_args=(), device_types="cpu")
def _dflash_accept(
    draft_tokens: torch.Tensor,
    lengths: torch.Tensor,
    target_tokens: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    target_probs: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _accept_mode(target_tokens, draft_probs, target_probs, uniforms) == "greedy":
        return greedy_accept_reference(draft_tokens, target_tokens, lengths)
    return rejection_accept_reference(draft_tokens, draft_probs, target_probs, uniforms, lengths)


@_dflash_accept.register_kernel("cuda")
def _dflash_accept_cuda(draft_tokens, lengths, target_tokens=None, draft_probs=None, target_probs=None, uniforms=None):
    # Sampling stays in torch: it is a few vocab-wide (201K) reductions per row that torch's own
    # CUDA kernels already run at bandwidth; the greedy rule is tiny and latency-bound, so it is fused.
    if _accept_mode(target_tokens, draft_probs, target_probs, uniforms) == "greedy":
        from .triton_kernels import greedy_accept_triton

        return greedy_accept_triton(draft_tokens, target_tokens, lengths)
    return rejection_accept_reference(draft_tokens, draft_probs, target_probs, uniforms, lengths)


@_dflash_accept.register_fake
def _dflash_accept_fake(draft_tokens, lengths, target_tokens=None, draft_probs=None, target_probs=None, uniforms=None):
    greedy = _accept_mode(target_tokens, draft_probs, target_probs, uniforms) == "greedy"
    batch = draft_tokens.shape[0]
    num_accepted = draft_tokens.new_empty(batch, dtype=torch.int64)
    bonus = draft_tokens.new_empty(batch, dtype=target_tokens.dtype if greedy else torch.int64)
    return num_accepted, bonus, torch.empty_like(lengths)


def draft_block_attention(
    q: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Block attention through ``dflash::draft_block_attention`` (layout: ``reference`` module docstring)."""
    return torch.ops.dflash.draft_block_attention(q, k_blk, v_blk, ctx_k, ctx_v, ctx_lens, scale, sliding_window)


def greedy_accept_update(
    draft_tokens: torch.Tensor, target_tokens: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy verify in one op -> (num_accepted int64 [b], bonus [b], new_lengths = lengths + a + 1)."""
    return torch.ops.dflash.dflash_accept(draft_tokens, lengths, target_tokens=target_tokens)


def rejection_accept_update(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    lengths: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Speculative-sampling verify in one op -> (num_accepted int64 [b], bonus int64 [b], new_lengths)."""
    return torch.ops.dflash.dflash_accept(
        draft_tokens, lengths, draft_probs=draft_probs, target_probs=target_probs, uniforms=uniforms
    )
