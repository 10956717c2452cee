"""Reference semantics of the draft-block plugin, in plain torch.

The drafter's hot path is *block attention*: each request's block of B queries (anchor + B-1 mask
slots) attends, bidirectionally, to that request's cached context K/V and to the block's own K/V.
Everything else in this package (Triton kernels, torch custom ops, ONNX node, TensorRT plugin) is
tested against the functions here.

Layout (fixed interface with the runtime)
-----------------------------------------
* Context cache: a **contiguous per-request arena** ``ctx_k, ctx_v: [b, Hkv, S_cap, D]``; request
  ``i`` owns row ``i`` and its valid positions are ``[0, ctx_lens[i])``; the tail is garbage (never
  read into a result, even if it holds NaN).
  Why an arena: the PyTorch runtime keeps exactly one growing cache row per request (the draft cache
  only ever holds committed context, DFlash §3.2), so a dense row is the simplest layout that is
  still graph-capturable (static shapes, lengths in a tensor) and lets a kernel stream each head's
  context as one contiguous run. A paged layout (block tables, as TRT-LLM's KV manager uses) is
  future work for TRT-LLM-style serving; it changes only how a kernel finds a context tile.
* Block tensors are packed: ``q: [b*B, Hq, D]``, ``k_blk, v_blk: [b*B, Hkv, D]``; request ``i`` owns
  rows ``i*B .. i*B+B-1``. Output is ``[b*B, Hq, D]``.
* GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``.
* Positions: the anchor sits at absolute position ``ctx_lens[i]`` (the draft cache holds ``[0, s)``
  with ``s`` the anchor position), so block slot ``j`` is at ``ctx_lens[i] + j``.
* Sliding window ``W`` (optional, over the context only): slot ``j`` sees context position ``p`` iff
  ``p > ctx_lens[i] + j - W``, i.e. a query sees itself and the ``W - 1`` positions before it (the
  Hugging Face / Mistral convention). Block keys are always visible, so no query is ever left with an
  empty softmax, and ``ctx_lens[i] == 0`` simply attends to the block.

Accept op: the runtime's verification rules (``trtllm_dflash.runtime.accept``) plus the length
update ``new_len = old_len + num_accepted + 1`` (accepted drafts and the bonus token).
"""

from __future__ import annotations

import torch

from trtllm_dflash.runtime.accept import greedy_accept, rejection_accept


def check_block_shapes(
    q: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    ctx_lens: torch.Tensor,
) -> tuple[int, int]:
    """Validate the packed layout; return (batch, block_size). Shared by every implementation."""
    if q.dim() != 3 or k_blk.dim() != 3 or ctx_k.dim() != 4:
        raise ValueError(
            f"expected q [b*B, Hq, D], k_blk [b*B, Hkv, D], ctx_k [b, Hkv, S_cap, D]; "
            f"got {tuple(q.shape)}, {tuple(k_blk.shape)}, {tuple(ctx_k.shape)}"
        )
    if k_blk.shape != v_blk.shape or ctx_k.shape != ctx_v.shape:
        raise ValueError("k_blk/v_blk and ctx_k/ctx_v must have equal shapes")
    batch, kv_heads, _, head_dim = ctx_k.shape
    rows, q_heads, q_dim = q.shape
    if batch == 0 or rows % batch:
        raise ValueError(f"q has {rows} rows, not a multiple of the batch {batch}")
    if k_blk.shape != (rows, kv_heads, head_dim) or q_dim != head_dim:
        raise ValueError(f"k_blk {tuple(k_blk.shape)} does not match q {tuple(q.shape)} / ctx {tuple(ctx_k.shape)}")
    if q_heads % kv_heads:
        raise ValueError(f"query heads {q_heads} not a multiple of KV heads {kv_heads}")
    if ctx_lens.shape != (batch,) or ctx_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ctx_lens must be int32/int64 of shape [{batch}], got {ctx_lens.dtype} {tuple(ctx_lens.shape)}")
    return batch, rows // batch


def draft_block_attention_reference(
    q: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Block attention over [context arena | block], computed in ``compute_dtype`` (default: q's dtype).

    Vectorised over the whole arena with masks (no per-request loop), so ragged lengths and empty
    contexts need no special case. Returns ``[b*B, Hq, D]`` in q's dtype.
    """
    batch, block = check_block_shapes(q, k_blk, v_blk, ctx_k, ctx_v, ctx_lens)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    s_cap = ctx_k.shape[2]
    if bool((ctx_lens < 0).any()) or bool((ctx_lens > s_cap).any()):
        raise ValueError(f"ctx_lens must lie in [0, {s_cap}], got {ctx_lens.tolist()}")
    dtype = compute_dtype or q.dtype
    kv_heads, head_dim = ctx_k.shape[1], ctx_k.shape[3]
    group = q.shape[1] // kv_heads

    # [b, Hkv, G, B, D] queries; keys/values [b, Hkv, S_cap + B, D].
    qg = q.to(dtype).view(batch, block, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    blk_k = k_blk.to(dtype).view(batch, block, kv_heads, head_dim).transpose(1, 2)
    blk_v = v_blk.to(dtype).view(batch, block, kv_heads, head_dim).transpose(1, 2)
    keys = torch.cat([ctx_k.to(dtype), blk_k], dim=2)
    visible = context_visibility(ctx_lens, block, s_cap, sliding_window)  # [b, B, S_cap]
    visible = torch.cat([visible, visible.new_ones(batch, block, block)], dim=2)  # [b, B, S_cap+B]
    # Garbage positions may hold NaN/inf: zero them so 0-weight * garbage cannot poison the sum.
    any_visible = visible.any(dim=1)[:, None, :, None]  # [b, 1, S_cap+B, 1]
    values = torch.cat([ctx_v.to(dtype), blk_v], dim=2).masked_fill(~any_visible, 0)

    scores = torch.einsum("bhgqd,bhkd->bhgqk", qg, keys) * scale
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    out = torch.einsum("bhgqk,bhkd->bhgqd", scores.softmax(dim=-1), values)
    return out.permute(0, 3, 1, 2, 4).reshape(q.shape).to(q.dtype)


def context_visibility(
    ctx_lens: torch.Tensor, block: int, s_cap: int, sliding_window: int | None
) -> torch.Tensor:
    """[b, B, S_cap] bool: may block slot j of request i read context position p?"""
    lens = ctx_lens.to(torch.int64)[:, None, None]
    pos = torch.arange(s_cap, device=ctx_lens.device)[None, None, :]
    visible = pos < lens
    if sliding_window is not None:
        slot = torch.arange(block, device=ctx_lens.device)[None, :, None]
        visible = visible & (pos > lens + slot - sliding_window)
    return visible.expand(-1, block, -1)


def advance_lengths(lengths: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """New committed lengths: the accepted drafts plus the bonus token, in the lengths' dtype."""
    return lengths + (num_accepted + 1).to(lengths.dtype)


def greedy_accept_reference(
    draft_tokens: torch.Tensor, target_tokens: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runtime greedy rule + length update -> (num_accepted int64 [b], bonus [b], new_lengths [b])."""
    num_accepted, bonus = greedy_accept(draft_tokens, target_tokens)
    return num_accepted, bonus, advance_lengths(lengths, num_accepted)


def rejection_accept_reference(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    lengths: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runtime rejection-sampling rule + length update -> (num_accepted, bonus, new_lengths)."""
    num_accepted, bonus = rejection_accept(draft_tokens, draft_probs, target_probs, uniforms)
    return num_accepted, bonus, advance_lengths(lengths, num_accepted)
