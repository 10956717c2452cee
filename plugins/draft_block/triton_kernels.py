"""Triton kernels for the draft-block op: split-K block attention and the greedy accept op.

Block attention is memory-bound (B = 10 queries per request against thousands of context
positions), so the kernels are shaped around reading each context K/V byte once:

* One program owns one (request, KV head, context split). Its query tile is every block slot of
  the request times every query head of the GQA group, ``[B * G, D]`` (10 x 8 = 80 rows for the
  gpt-oss-120b drafter), so each K/V tile loaded from HBM serves all query heads that read it.
* Long contexts are cut into splits (flash-decoding) so a small batch still fills the GPU; a second
  kernel merges the splits' partial results with log-sum-exp weights. When one split per request
  suffices (large batch, short context) the fused kernel writes the final output directly and no
  partials are written; the TensorRT AOT plugin always uses the fused kernel (one launch, no
  workspace).
* The block's own K/V is one extra tile, attended by split 0, so split 0 always has a finite
  softmax max and the combine can start from it without special cases.
* Launch grids depend only on tensor shapes (S_cap, not the live lengths), so the launch is CUDA
  graph capturable; programs past a request's length do no work.

Kernel argument order is inputs, integer scalars, outputs, constexprs: the order TensorRT's AOT
plugin launcher passes them (``tensorrt_plugin.py``).

Under ``TRITON_INTERPRET=1`` (set before triton is first imported) these kernels run on CPU tensors;
the tests use that. Softmax uses base-2 exponentials with ``scale * log2(e)`` folded into the scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .reference import check_block_shapes

LOG2E = 1.4426950408889634
MIN_SPLIT = 512  # smallest context split: below this the partials' traffic outweighs the occupancy gain
# Aim for this many programs per SM before splitting stops. The H200 split sweep (docs/benchmarks.md)
# put the best split counts at 2-4 programs per SM; 8 per SM was up to 14% slower.
WAVES = 2


@dataclass(frozen=True)
class LaunchConfig:
    """Tile and launch parameters of the block-attention kernels (tuned by benchmarks/bench_draft_block.py)."""

    block_n: int = 64  # context positions per K/V tile
    num_warps: int = 4
    num_stages: int = 3  # best geometric mean of the H200 sweep (docs/benchmarks.md)


DEFAULT_LAUNCH = LaunchConfig()
BLOCK_N = DEFAULT_LAUNCH.block_n


@dataclass(frozen=True)
class BlockAttnMeta:
    """Compile-time shape of one block-attention kernel (its constexprs)."""

    block: int
    group: int
    head_dim: int
    window: int  # 0 = full context
    scale: float
    dot_precision: str
    block_n: int = BLOCK_N

    @property
    def block_m(self) -> int:
        return max(16, triton.next_power_of_2(self.block * self.group))

    @property
    def block_b(self) -> int:
        return max(16, triton.next_power_of_2(self.block))

    def constexprs(self) -> dict:
        return dict(
            BLOCK=self.block, GROUP=self.group, D=self.head_dim, WINDOW=self.window,
            QK_SCALE=self.scale * LOG2E, DOT_PRECISION=self.dot_precision,
            BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_B=self.block_b,
        )


def context_span(s_cap: int, sliding_window: int | None) -> int:
    """Most context positions any request can see: the window covers at most W - 1 of them."""
    return s_cap if sliding_window is None else min(s_cap, sliding_window - 1)


def plan_split_size(batch: int, kv_heads: int, span: int, sm_count: int, block_n: int = BLOCK_N) -> int:
    """Context positions per split: enough splits to give every SM ~WAVES programs, none < MIN_SPLIT.

    Returns ``span`` rounded up to a tile (one split: the fused kernel) when the batch alone fills
    the GPU.
    """
    span_tiles = max(1, triton.cdiv(span, block_n))
    wanted = triton.cdiv(WAVES * sm_count, batch * kv_heads)
    splits = max(1, min(wanted, span // MIN_SPLIT))
    return triton.cdiv(span_tiles, splits) * block_n


@triton.jit
def _window_start(ctx_len, WINDOW: tl.constexpr):
    """First context position block slot 0 may see (the union over all slots)."""
    if WINDOW > 0:
        return tl.maximum(ctx_len - WINDOW + 1, 0)
    return ctx_len * 0


@triton.jit
def _load_query_tile(q_ptr, req, kv_head, stride_qt, stride_qh,
                     BLOCK: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows r = slot * GROUP + g: block slot ``slot`` of query head ``kv_head * GROUP + g``."""
    rows = tl.arange(0, BLOCK_M)
    slot = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = rows < BLOCK * GROUP
    token = req.to(tl.int64) * BLOCK + slot
    ptrs = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + tl.arange(0, D)[None, :]
    return tl.load(ptrs, mask=row_ok[:, None], other=0.0), slot, head, row_ok


@triton.jit
def _online_softmax_step(q, k, v, visible, m, l, acc, QK_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold one K/V tile into the running (max, sum, unnormalised output), base-2 domain.

    Rows that see nothing yet keep m = -inf; the ``m_safe`` shift keeps them at exactly zero
    instead of exp(-inf - -inf) = NaN.
    """
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * QK_SCALE
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l, acc


@triton.jit
def _attend_block_tile(q, m, l, acc, k_blk_ptr, v_blk_ptr, req, kv_head, stride_bt, stride_bh,
                       BLOCK: tl.constexpr, D: tl.constexpr, BLOCK_B: tl.constexpr,
                       QK_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The request's own B block keys: always visible to every slot (bidirectional block)."""
    t = tl.arange(0, BLOCK_B)
    ok = t < BLOCK
    offs = (req.to(tl.int64) * BLOCK + t)[:, None] * stride_bt + kv_head * stride_bh + tl.arange(0, D)[None, :]
    k = tl.load(k_blk_ptr + offs, mask=ok[:, None], other=0.0)
    v = tl.load(v_blk_ptr + offs, mask=ok[:, None], other=0.0)
    return _online_softmax_step(q, k, v, ok[None, :], m, l, acc, QK_SCALE, DOT_PRECISION)


@triton.jit
def _attend_context(q, m, l, acc, ctx_k_ptr, ctx_v_ptr, base, stride_cs, start, stop, ctx_len, slot,
                    D: tl.constexpr, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr,
                    QK_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Context positions [start, stop) of one (request, KV head) row of the arena.

    Loads past ``stop`` are masked to zero, so arena garbage (even NaN) never enters the sums.
    """
    cols = tl.arange(0, D)
    for n0 in range(start, stop, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        in_range = pos < stop
        offs = base + pos.to(tl.int64)[:, None] * stride_cs + cols[None, :]
        k = tl.load(ctx_k_ptr + offs, mask=in_range[:, None], other=0.0)
        v = tl.load(ctx_v_ptr + offs, mask=in_range[:, None], other=0.0)
        visible = in_range[None, :]
        if WINDOW > 0:
            visible = visible & (pos[None, :] > ctx_len + slot[:, None] - WINDOW)
        m, l, acc = _online_softmax_step(q, k, v, visible, m, l, acc, QK_SCALE, DOT_PRECISION)
    return m, l, acc


@triton.jit
def _init_state(BLOCK_M: tl.constexpr, D: tl.constexpr):
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    return m, tl.zeros((BLOCK_M,), tl.float32), tl.zeros((BLOCK_M, D), tl.float32)


@triton.jit
def draft_block_attn_fused_kernel(
    q_ptr, k_blk_ptr, v_blk_ptr, ctx_k_ptr, ctx_v_ptr, ctx_lens_ptr,
    s_cap, stride_qt, stride_qh, stride_bt, stride_bh, stride_cb, stride_ch, stride_cs, stride_ot, stride_oh,
    out_ptr,
    BLOCK: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, WINDOW: tl.constexpr,
    QK_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """Grid (b, Hkv): one program reads a request's whole visible context for one KV head."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx_len = tl.minimum(tl.load(ctx_lens_ptr + req).to(tl.int32), s_cap)
    q, slot, head, row_ok = _load_query_tile(q_ptr, req, kv_head, stride_qt, stride_qh, BLOCK, GROUP, D, BLOCK_M)
    m, l, acc = _init_state(BLOCK_M, D)
    m, l, acc = _attend_block_tile(q, m, l, acc, k_blk_ptr, v_blk_ptr, req, kv_head, stride_bt, stride_bh,
                                   BLOCK, D, BLOCK_B, QK_SCALE, DOT_PRECISION)
    base = req.to(tl.int64) * stride_cb + kv_head * stride_ch
    m, l, acc = _attend_context(q, m, l, acc, ctx_k_ptr, ctx_v_ptr, base, stride_cs,
                                _window_start(ctx_len, WINDOW), ctx_len, ctx_len, slot,
                                D, WINDOW, BLOCK_N, QK_SCALE, DOT_PRECISION)
    token = req.to(tl.int64) * BLOCK + slot
    out_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + tl.arange(0, D)[None, :]
    tl.store(out_ptrs, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def draft_block_attn_split_kernel(
    q_ptr, k_blk_ptr, v_blk_ptr, ctx_k_ptr, ctx_v_ptr, ctx_lens_ptr,
    s_cap, split_size, stride_qt, stride_qh, stride_bt, stride_bh, stride_cb, stride_ch, stride_cs,
    part_acc_ptr, part_ml_ptr,
    BLOCK: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, WINDOW: tl.constexpr,
    QK_SCALE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """Grid (b, Hkv, splits): partial (max, sum, acc) of one context split; split 0 adds the block.

    Partials are [b, Hkv, splits, BLOCK_M, D] (acc) and [b, Hkv, splits, 2, BLOCK_M] (max, sum).
    Splits that start past the request's context do nothing; the combine never reads them.
    """
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx_len = tl.minimum(tl.load(ctx_lens_ptr + req).to(tl.int32), s_cap)
    start = _window_start(ctx_len, WINDOW) + split * split_size
    if (split == 0) | (start < ctx_len):
        q, slot, head, row_ok = _load_query_tile(q_ptr, req, kv_head, stride_qt, stride_qh, BLOCK, GROUP, D, BLOCK_M)
        m, l, acc = _init_state(BLOCK_M, D)
        if split == 0:
            m, l, acc = _attend_block_tile(q, m, l, acc, k_blk_ptr, v_blk_ptr, req, kv_head, stride_bt, stride_bh,
                                           BLOCK, D, BLOCK_B, QK_SCALE, DOT_PRECISION)
        base = req.to(tl.int64) * stride_cb + kv_head * stride_ch
        m, l, acc = _attend_context(q, m, l, acc, ctx_k_ptr, ctx_v_ptr, base, stride_cs,
                                    start, tl.minimum(start + split_size, ctx_len), ctx_len, slot,
                                    D, WINDOW, BLOCK_N, QK_SCALE, DOT_PRECISION)
        part = (req.to(tl.int64) * tl.num_programs(1) + kv_head) * tl.num_programs(2) + split
        rows = tl.arange(0, BLOCK_M)
        tl.store(part_acc_ptr + part * BLOCK_M * D + rows[:, None] * D + tl.arange(0, D)[None, :], acc)
        tl.store(part_ml_ptr + part * 2 * BLOCK_M + rows, m)
        tl.store(part_ml_ptr + part * 2 * BLOCK_M + BLOCK_M + rows, l)


@triton.jit
def draft_block_attn_combine_kernel(
    ctx_lens_ptr, part_acc_ptr, part_ml_ptr,
    s_cap, split_size, num_splits, stride_ot, stride_oh,
    out_ptr,
    BLOCK: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Grid (b, Hkv): merge the request's used splits with log-sum-exp weights and normalise.

    Starts from split 0, whose max is finite (it holds the block keys), so exp2(m_s - m) is 0 for
    rows a later split could not see (m_s = -inf) and never NaN.
    """
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx_len = tl.minimum(tl.load(ctx_lens_ptr + req).to(tl.int32), s_cap)
    used = tl.maximum(tl.cdiv(ctx_len - _window_start(ctx_len, WINDOW), split_size), 1)
    rows = tl.arange(0, BLOCK_M)
    acc_offs = rows[:, None] * D + tl.arange(0, D)[None, :]
    part = (req.to(tl.int64) * tl.num_programs(1) + kv_head) * num_splits
    m = tl.load(part_ml_ptr + part * 2 * BLOCK_M + rows)
    l = tl.load(part_ml_ptr + part * 2 * BLOCK_M + BLOCK_M + rows)
    acc = tl.load(part_acc_ptr + part * BLOCK_M * D + acc_offs)
    for s in range(1, used):
        m_s = tl.load(part_ml_ptr + (part + s) * 2 * BLOCK_M + rows)
        l_s = tl.load(part_ml_ptr + (part + s) * 2 * BLOCK_M + BLOCK_M + rows)
        acc_s = tl.load(part_acc_ptr + (part + s) * BLOCK_M * D + acc_offs)
        m_new = tl.maximum(m, m_s)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(m_s - m_new)
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        l = l * alpha + l_s * beta
        m = m_new
    slot = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    token = req.to(tl.int64) * BLOCK + slot
    out_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + tl.arange(0, D)[None, :]
    tl.store(out_ptrs, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=(rows < BLOCK * GROUP)[:, None])


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Kernels index the last dim with unit stride; any other strides are passed through."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def block_attn_meta(q: torch.Tensor, ctx_k: torch.Tensor, block: int, scale: float,
                    sliding_window: int | None, block_n: int = BLOCK_N) -> BlockAttnMeta:
    """Constexprs for the given shapes; fp32 inputs use exact (not TF32) dots."""
    head_dim = ctx_k.shape[3]
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    return BlockAttnMeta(
        block=block, group=q.shape[1] // ctx_k.shape[1], head_dim=head_dim, window=sliding_window or 0,
        scale=float(scale), dot_precision="ieee" if q.dtype in (torch.float32, torch.float64) else "tf32",
        block_n=block_n,
    )


def draft_block_attention_triton(
    q: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    split_size: int | None = None,
    launch: LaunchConfig = DEFAULT_LAUNCH,
) -> torch.Tensor:
    """Block attention with the Triton kernels; same contract as ``draft_block_attention_reference``.

    ``split_size`` (context positions per split, a multiple of ``launch.block_n``) overrides the
    occupancy plan; a split as large as the visible span selects the fused single-pass kernel.
    """
    batch, block = check_block_shapes(q, k_blk, v_blk, ctx_k, ctx_v, ctx_lens)
    q, k_blk, v_blk, ctx_k, ctx_v = map(_rows_contiguous, (q, k_blk, v_blk, ctx_k, ctx_v))
    meta = block_attn_meta(q, ctx_k, block, scale, sliding_window, launch.block_n)
    kv_heads, s_cap = ctx_k.shape[1], ctx_k.shape[2]
    span = context_span(s_cap, sliding_window)
    if split_size is None:
        split_size = plan_split_size(batch, kv_heads, span, _sm_count(q.device), launch.block_n)
    if split_size % launch.block_n:
        raise ValueError(f"split_size must be a multiple of {launch.block_n}, got {split_size}")
    num_splits = max(1, triton.cdiv(span, split_size))
    out = torch.empty_like(q)
    inputs = (q, k_blk, v_blk, ctx_k, ctx_v, ctx_lens)
    tuning = dict(num_warps=launch.num_warps, num_stages=launch.num_stages)
    if num_splits == 1:
        draft_block_attn_fused_kernel[(batch, kv_heads)](
            *inputs, s_cap, q.stride(0), q.stride(1), k_blk.stride(0), k_blk.stride(1),
            ctx_k.stride(0), ctx_k.stride(1), ctx_k.stride(2), out.stride(0), out.stride(1),
            out, **meta.constexprs(), **tuning,
        )
        return out
    part_acc = torch.empty(batch, kv_heads, num_splits, meta.block_m, meta.head_dim, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(batch, kv_heads, num_splits, 2, meta.block_m, dtype=torch.float32, device=q.device)
    draft_block_attn_split_kernel[(batch, kv_heads, num_splits)](
        *inputs, s_cap, split_size, q.stride(0), q.stride(1), k_blk.stride(0), k_blk.stride(1),
        ctx_k.stride(0), ctx_k.stride(1), ctx_k.stride(2),
        part_acc, part_ml, **meta.constexprs(), **tuning,
    )
    draft_block_attn_combine_kernel[(batch, kv_heads)](
        ctx_lens, part_acc, part_ml, s_cap, split_size, num_splits, out.stride(0), out.stride(1),
        out, BLOCK=block, GROUP=meta.group, D=meta.head_dim, WINDOW=meta.window, BLOCK_M=meta.block_m,
    )
    return out


@triton.jit
def greedy_accept_kernel(
    draft_ptr, target_ptr, lengths_ptr,
    num_drafts, stride_d, stride_t,
    num_accepted_ptr, bonus_ptr, new_lengths_ptr,
    BLOCK_K: tl.constexpr,
):
    """Grid (b,): accepted = index of the first draft that differs from the target's token."""
    req = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    ok = k < num_drafts
    draft = tl.load(draft_ptr + req * stride_d + k, mask=ok, other=0)
    target = tl.load(target_ptr + req * stride_t + k, mask=ok, other=0)
    accepted = tl.min(tl.where(ok & (draft != target), k, num_drafts), axis=0)
    bonus = tl.load(target_ptr + req * stride_t + accepted)
    length = tl.load(lengths_ptr + req)
    tl.store(num_accepted_ptr + req, accepted.to(tl.int64))
    tl.store(bonus_ptr + req, bonus)
    tl.store(new_lengths_ptr + req, (length + accepted + 1).to(new_lengths_ptr.dtype.element_ty))


def greedy_accept_triton(
    draft_tokens: torch.Tensor, target_tokens: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy accept + length update in one launch; same contract as ``greedy_accept_reference``."""
    batch, num_drafts = draft_tokens.shape
    draft_tokens, target_tokens = _rows_contiguous(draft_tokens), _rows_contiguous(target_tokens)
    num_accepted = torch.empty(batch, dtype=torch.int64, device=draft_tokens.device)
    bonus = torch.empty(batch, dtype=target_tokens.dtype, device=draft_tokens.device)
    new_lengths = torch.empty_like(lengths)
    greedy_accept_kernel[(batch,)](
        draft_tokens, target_tokens, lengths, num_drafts, draft_tokens.stride(0), target_tokens.stride(0),
        num_accepted, bonus, new_lengths, BLOCK_K=triton.next_power_of_2(max(num_drafts, 1)),
    )
    return num_accepted, bonus, new_lengths
