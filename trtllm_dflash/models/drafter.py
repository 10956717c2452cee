"""The DFlash block-diffusion drafter (z-lab `DFlashDraftModel` layout), written for the loop.

A stack of Qwen3-style decoder layers without embeddings or LM head (it borrows the target's).
Target features of committed tokens are fused (`fc` -> `hidden_norm`) and injected as extra K/V in
every layer; a block [anchor, MASK x (B-1)] attends bidirectionally to that context and to itself,
and slots 1..B-1 predict the tokens at their own positions (dflash-algorithm.md §2).

Context K/V is computed once per committed token (`write_context`) and cached in a per-request
arena. The inference path (`write_context`, `forward`) is lean because a drafter step on a small model
is bound by per-op overhead: the context K/V of all layers comes from one GEMM over stacked weights
(in a drafting step, the first layer's q/k/v GEMM: `forward(context=...)`), q/k/v and gate/up are fused
(copies rebuilt whenever a parameter changes, see `InferenceWeights`; while a forward hook watches a
fused projection, as calibration does, the modules run instead),
and the block's own K/V is written to the arena slots just past each request's context, where the
visibility mask admits it for this forward only and the next commit overwrites it (so rejected
drafts never become context). On a float32 CPU drafter the compiled draft-step kernels of
plugins/draft_block/cpu.py take over everything between the GEMMs where they load (`compiled_layers`):
per layer one call for QK-norm + RoPE + block attention on the raw q/k/v projection (the block's K/V then
never enter the arena), one for each residual add + RMSNorm, one for SiLU-and-multiply.
`run_layers` / `forward_train` keep the per-module formulation that training, the ONNX export and the
tests' reference formulas use.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from ..checkpoints.hf import load_state_dict
from ..errors import InputError
from ..plugins.draft_block.cpu import (WholeDraftStep, add_rms_norm_cpu, cpu_kernel, draft_block_attention_cpu,
                                      rms_norm_cpu, serves, silu_mul_cpu, write_context_kv_cpu)
from ..plugins.draft_block.reference import context_visibility
from .drafter_config import DFlashConfig
from .kv_cache import KVArena
from .drafter_weights import InferenceWeights
from .layers import attention_bias, fused_attention, hooked, lean_rms_norm, normalized, sink_attention
from .linear import CastLinear, cast
from .rope import Rotary, apply_rotary, rotate


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in float32, cast back, then scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 == self.weight.dtype:  # the same numbers, one op less
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * normalized(x, self.eps)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.head_dim = d

    def heads(self, x: torch.Tensor, norm: RMSNorm | None = None) -> torch.Tensor:
        """[b, t, H*D] -> [b, H, t, D], with the per-head RMSNorm (QK-norm) when given."""
        x = x.view(*x.shape[:2], -1, self.head_dim)
        return (x if norm is None else norm(x)).transpose(1, 2)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(self.heads(self.k_proj(x), self.k_norm), cos, sin), self.heads(self.v_proj(x))

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary(self.heads(self.q_proj(x), self.q_norm), cos, sin)


class DraftMLP(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)


def normed_rotated(heads: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """QK-norm then RoPE on heads [..., D]: each head's RMSNorm times `weight` (broadcast to the heads),
    then the rotation by cos/sin (broadcast likewise)."""
    return rotate(lean_rms_norm(heads, None, eps) * weight, cos, sin)


def block_visibility(context_lens: torch.Tensor, width: int, length: int, window: int | None) -> torch.Tensor:
    """[b, width, length] bool: the arena slots each block slot sees -- its context (all of
    [0, context_len), or the last `window` positions before the slot, as the plugin reference defines
    it) and the block itself, written at [context_len, context_len + width) for the current forward."""
    slots = torch.arange(length, device=context_lens.device)
    block = (slots >= context_lens[:, None]) & (slots < context_lens[:, None] + width)
    return context_visibility(context_lens, width, length, window) | block[:, None]


class BlockLayout(NamedTuple):
    """Where a step's block goes in the draft arena and what its attention reads: the block's K/V go to
    `slots` (`KVArena.write` positions: [b, B], or for a lone request the int first slot), attention
    reads arena slots [0, length), of which `mask` says who sees what (`block_visibility`, or on CPU its
    additive form); None when every slot sees all of them."""

    length: int
    mask: torch.Tensor | None
    slots: torch.Tensor | int


class StepPlan(NamedTuple):
    """How the drafter's inference calls run (`DFlashDrafter.plan`), decided once for a stretch in which its
    parameters, hooks and switches stay as they are (a proposer decides it per generate call: checking them
    took ~50 us of a drafter step in the loop, where the verify leaves this Python code cold)."""

    weights: InferenceWeights | None  # the lean path's fused weights; None: a hook watches a bypassed module
    compiled: bool  # whether the lean path runs through the compiled CPU kernels


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.rope_config())
        self.scale = cfg.head_dim ** -0.5
        self.use_plugin = False  # True: block attention through the draft-block plugin's custom op
        self.use_cpu_kernel = True  # False: the lean path in torch even where the compiled CPU kernels load
        self._fused: tuple[list, list, dict] | None = None  # (parameters, their key, weights per GEMM dtype)
        self._linears: tuple[nn.Linear, ...] | None = None  # the projections the fused path bypasses

    def inference_weights(self, matmul_dtype: torch.dtype | None = None) -> InferenceWeights:
        """The fused weights with GEMMs in `matmul_dtype` (None: the parameters' dtype), rebuilt when a
        parameter's data was replaced (`.to()`) or updated in place (an optimizer step,
        `load_state_dict`): each parameter's storage and version counter are compared with those the
        copies were made from. (Assigning new Parameter objects is not seen.)"""
        params = list(self.parameters()) if self._fused is None else self._fused[0]
        key = [(p.data_ptr(), p._version) for p in params]
        if self._fused is None or self._fused[1] != key:
            self._fused = (params, key, {})
        dtype = matmul_dtype or self.dtype
        if dtype not in self._fused[2]:
            self._fused[2][dtype] = InferenceWeights.build(self, dtype)
        return self._fused[2][dtype]

    def plugin_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_k: torch.Tensor,
                         ctx_v: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        """The draft-block plugin's fused op on q [b, Hq, B, D], k/v [b, Hkv, B, D] -> [b, B, Hq*D]."""
        from trtllm_dflash.plugins.draft_block import draft_block_attention

        b, hq, width, d = q.shape

        def packed(x):
            return x.transpose(1, 2).reshape(b * width, x.shape[1], d)

        out = draft_block_attention(packed(q), packed(k), packed(v), ctx_k, ctx_v, context_lens, self.scale,
                                    self.config.sliding_window)
        return out.reshape(b, width, hq * d)

    def block_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVArena,
                        context_lens: torch.Tensor, block: BlockLayout) -> torch.Tensor:
        """Block queries q [b, Hq, B, D] over the request's context and the block's own k/v [b, B, Hkv, D]
        -> [b, B, Hq*D]. The plain path writes k/v to the arena slots just past the context and reads
        both from there (`block_layout`); the plugin gets them apart."""
        if self.use_plugin:
            return self.plugin_attention(q, k.transpose(1, 2), v.transpose(1, 2), cache.k[layer], cache.v[layer],
                                         context_lens)
        cache.write(layer, block.slots, k, v)
        keys, values = cache.read(layer, block.length)
        if q.device.type == "cpu":
            return fused_attention(q, keys, values, block.mask, None, self.scale)
        return sink_attention(q, keys, values, block.mask, None, self.scale)

    def block_layout(self, context_lens: torch.Tensor, width: int, dtype: torch.dtype,
                     length: int | None = None) -> BlockLayout:
        """`block_attention`'s layout for a block of `width` slots, built once per step for all layers:
        the bool mask, or on CPU the additive bias the fused kernel takes. A lone request writes its
        block as one span and, while the window does not cut its context, sees every slot it reads, so
        it needs no mask (a dozen ops less). `length`: max(context_lens) + width where the caller knows it."""
        cfg = self.config
        length = int(context_lens.max()) + width if length is None else length
        if len(context_lens) == 1:
            slots = length - width
            if cfg.sliding_window is None or length <= cfg.sliding_window:
                return BlockLayout(length, None, slots)
        else:
            slots = context_lens[:, None] + torch.arange(width, device=context_lens.device)
        visible = block_visibility(context_lens, width, length, cfg.sliding_window)
        if context_lens.device.type == "cpu":
            groups = cfg.num_attention_heads // cfg.num_key_value_heads
            return BlockLayout(length, attention_bias(visible, groups, dtype), slots)
        return BlockLayout(length, visible, slots)

    def uses_cpu_kernels(self) -> bool:
        """Whether the lean path runs through the compiled CPU kernels (`compiled_layers`): `use_cpu_kernel`, no
        plugin, a float32 drafter on the CPU (its arena too), a head_dim of whole 16-float vectors, the kernels built."""
        return (self.use_cpu_kernel and not self.use_plugin and self.config.head_dim % 16 == 0
                and serves(self.fc.weight))

    def plan(self, matmul_dtype: torch.dtype | None = None) -> StepPlan:
        """The `StepPlan` for calls with GEMMs in `matmul_dtype` as things stand now."""
        if self.bypassed_modules_hooked():
            return StepPlan(None, False)
        return StepPlan(self.inference_weights(matmul_dtype), self.uses_cpu_kernels())

    def whole_step(self, plan: StepPlan, head: CastLinear, embedding: torch.Tensor,
                   capacity: int) -> WholeDraftStep | None:
        """A drafter step in one compiled call (`WholeDraftStep`: `forward`, then the logits of slots 1..B-1 through
        `head` and the greedy drafts) for arenas of `capacity` positions, where the plan runs the compiled CPU kernels
        and every GEMM, `head`'s too, is the compiled bf16 or int8 one (`CastLinear.dot`); else None. On a lone request's
        step it saves the ~25 calls from Python the per-call path makes (round 19)."""
        w, cfg = plan.weights, self.config
        if not plan.compiled or w is None or embedding.dtype != torch.float32:
            return None
        gemms = [w.fc, w.first_qkv_context, *w.qkv, *w.o_proj, *w.gate_up, *w.down_proj, head]
        if not all(g.dot for g in gemms):
            return None

        def packed(linears):
            return [(g.weight, g.bias, g.scales) for g in linears]

        step = cpu_kernel().DraftStep(
            *packed([w.fc, w.first_qkv_context]), packed(w.qkv), packed(w.o_proj), packed(w.gate_up), packed(w.down_proj),
            *packed([head]), w.hidden_norm, w.context_k_norm, w.input_norm, w.post_attention_norm, w.q_norm, w.k_norm,
            w.final_norm, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps, self.scale,
            cfg.sliding_window or -1)
        return WholeDraftStep(step, embedding.detach(), self.rotary.table(capacity, torch.float32, embedding.device))

    def bypassed_modules_hooked(self) -> bool:
        """A forward hook on a projection the fused weights bypass (calibration records their inputs)."""
        if self._linears is None:  # walking the module tree each step cost ~50 us
            self._linears = (self.fc, *(m for layer in self.layers for m in layer.modules() if isinstance(m, nn.Linear)))
        return hooked(*self._linears)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def new_cache(self, batch: int, capacity: int) -> KVArena:
        cfg = self.config
        return KVArena(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, capacity, cfg.head_dim,
                       self.dtype, self.fc.weight.device)

    @torch.inference_mode()
    def write_context(self, features: torch.Tensor, positions: torch.Tensor | int, cache: KVArena,
                      matmul_dtype: torch.dtype | None = None, plan: StepPlan | None = None) -> None:
        """Project target features [b, n, F] of committed tokens at `positions` [b, n] (or, for a lone
        request, the int first position of n consecutive ones) into every layer's context K/V. Done once
        per committed token; never recomputed. All layers at once: fc -> hidden_norm -> one GEMM over
        the stacked k/v weights -> each layer's k_norm -> RoPE.
        `matmul_dtype`: the GEMMs' dtype (`CastLinear`; None: the parameters'); `plan`: `plan(matmul_dtype)`
        where the caller holds it."""
        cfg = self.config
        features = cast(features, self.dtype)
        if isinstance(positions, int):
            cos, sin = self.rotary.span(positions, features.shape[1], self.dtype, features.device)
        else:  # positions index the arena, so they lie below its capacity: no reduction to bound the table
            cos, sin = self.rotary(positions, self.dtype, cache.capacity)
        w, compiled = plan or self.plan(matmul_dtype)
        if w is None:
            fused = self.hidden_norm(self.fc(features))
            for i, layer in enumerate(self.layers):
                k, v = layer.self_attn.keys_values(fused, cos, sin)
                cache.write(i, positions, k.transpose(1, 2), v.transpose(1, 2))
            return
        fused = self.fused_features(w, features, compiled)
        b, n, _ = fused.shape
        kv = w.context_kv(fused).view(b, n, 2, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
        if compiled:
            write_context_kv_cpu(kv[:, :, 0].flatten(2, 3), kv[:, :, 1].flatten(2, 3), w.context_k_norm, cos, sin,
                                 cache.keys, cache.values, positions, cfg.rms_norm_eps)
            return
        k = normed_rotated(kv[:, :, 0], w.context_k_norm, cos[:, :, None, None], sin[:, :, None, None],
                           cfg.rms_norm_eps)
        cache.write_all(positions, k, kv[:, :, 1])

    def fused_features(self, w: InferenceWeights, features: torch.Tensor, compiled: bool = False) -> torch.Tensor:
        """The lean path's fc -> hidden_norm of target features [b, n, F]: every layer's context K/V input
        (`compiled`: the norm through the compiled CPU kernel)."""
        projected = w.fc(cast(features, self.dtype))
        if compiled:
            return rms_norm_cpu(projected, w.hidden_norm, self.config.rms_norm_eps)
        return lean_rms_norm(projected, w.hidden_norm, self.config.rms_norm_eps)

    def run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
        """The layer stack; `attend(layer, q, k, v)` supplies the context part of attention."""
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            k, v = attn.keys_values(h, cos, sin)
            x = x + attn.o_proj(attend(i, attn.query(h, cos, sin), k, v))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

    @torch.inference_mode()
    def forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor | int, cache: KVArena,
                context_lens: torch.Tensor, matmul_dtype: torch.dtype | None = None,
                context: tuple[torch.Tensor, torch.Tensor | int] | None = None,
                plan: StepPlan | None = None) -> torch.Tensor:
        """Draft one block per request: embeds [b, B, H] at positions [b, B] (or, for a lone request, the
        int position of its anchor, which is its context length); request i sees its context positions
        [0, context_lens[i]). Returns the final-normed hidden states [b, B, H].
        `matmul_dtype`: the GEMMs' dtype (`CastLinear`; None: the parameters').
        `context`: (features, positions) of committed tokens whose context K/V to write first, as
        `write_context` takes them (`context_lens` already counts them; for a lone request the int
        positions must be too). The lean path computes them in the first layer's q/k/v GEMM, stacked
        under the block's rows: one GEMM, norm and rotation less a step (5% of a drafter step, round 12).
        `plan`: `plan(matmul_dtype)` where the caller holds it.

        The block's K/V go to arena slots [context_lens[i], context_lens[i] + B) (the cache must have
        room for them), which hold no context: the next `write_context` overwrites them."""
        cfg = self.config
        x = cast(block_embeds, self.dtype)
        b, width, _ = x.shape
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if context is not None and context[0].shape[1] == 0:
            context = None
        plan = plan or self.plan(matmul_dtype)
        w, compiled = plan  # the compiled attention needs no mask or block slots
        lean = w is not None
        if context is not None and not lean:
            self.write_context(*context, cache, matmul_dtype, plan)
            context = None
        n = 0 if context is None else context[0].shape[1]
        if isinstance(block_positions, int):  # no reductions over tensors: a lone request's step is op-bound
            cos, sin = self.rotary.span(block_positions - n, n + width, x.dtype, x.device)
            block = None if compiled else self.block_layout(context_lens, width, x.dtype, block_positions + width)
        else:
            positions = block_positions if context is None else torch.cat([context[1], block_positions], dim=1)
            cos, sin = self.rotary(positions, x.dtype)
            block = None if compiled else self.block_layout(context_lens, width, x.dtype)
        if not lean:
            return self.run_layers(x, cos, sin, lambda i, q, k, v: self.block_attention(
                i, q, k.transpose(1, 2), v.transpose(1, 2), cache, context_lens, block))
        if compiled:
            return self.compiled_layers(w, x, context, cache, context_lens, cos, sin)
        cos, sin = cos[:, :, None], sin[:, :, None]
        block_cos, block_sin = (cos, sin) if n == 0 else (cos[:, n:], sin[:, n:])
        eps = cfg.rms_norm_eps
        for i in range(cfg.num_hidden_layers):
            h = lean_rms_norm(x, w.input_norm[i], eps)
            if i == 0 and context is not None:
                q, k, v = self.first_layer_with_context(w, h, context, cache, cos, sin)
            else:
                qkv = w.qkv[i](h).view(b, width, -1, d)
                qk = normed_rotated(qkv[:, :, : hq + hkv], w.qk_norm[i], block_cos, block_sin, eps)
                q, k, v = qk[:, :, :hq], qk[:, :, hq:], qkv[:, :, hq + hkv:]
            attended = self.block_attention(i, q.transpose(1, 2), k, v, cache, context_lens, block)
            # o_proj's and down_proj's outputs stay in the GEMM dtype (the residual add promotes them), and
            # so does the SiLU gate between gate/up and down: four casts a layer less
            x = x + w.o_proj[i].native(attended)
            gate, up = w.gate_up[i].native(lean_rms_norm(x, w.post_attention_norm[i], eps)).chunk(2, dim=-1)
            x = x + w.down_proj[i].native(F.silu(gate) * up)
        return lean_rms_norm(x, w.final_norm, eps)

    def compiled_layers(self, w: InferenceWeights, x: torch.Tensor,
                        context: tuple[torch.Tensor, torch.Tensor | int] | None, cache: KVArena,
                        context_lens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`forward`'s lean layers through the compiled CPU kernels (plugins/draft_block/cpu.py): per layer the
        q/k/v GEMM, one call for QK-norm + RoPE + block attention on its raw output, o_proj, one call for the
        residual add + RMSNorm, gate/up, one for SiLU-and-multiply, down, one more add + norm. cos/sin [b, n + B, D]
        cover the context rows `context` adds (n), then the block's. The block's K/V never enter the arena."""
        cfg = self.config
        b, width, _ = x.shape
        hq, hkv, d, eps, layers = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps,
                                   cfg.num_hidden_layers)
        n = 0 if context is None else context[0].shape[1]
        rows = b * width
        block_cos, block_sin = cos[:, n:].reshape(rows, d), sin[:, n:].reshape(rows, d)
        h = rms_norm_cpu(x, w.input_norm[0], eps)
        for i in range(layers):
            if i == 0 and context is not None:
                q, k, v = self.first_layer_with_context(w, h, context, cache, cos[:, :, None], sin[:, :, None],
                                                        compiled=True)
            else:
                qkv = w.qkv[i](h).view(b, width, -1, d)
                q, k, v = qkv[:, :, :hq], qkv[:, :, hq: hq + hkv], qkv[:, :, hq + hkv:]
            attended = draft_block_attention_cpu(q.reshape(rows, hq, d), k.reshape(rows, hkv, d), v.reshape(rows, hkv, d),
                                                 cache.k[i], cache.v[i], context_lens, self.scale, cfg.sliding_window,
                                                 (w.q_norm[i], w.k_norm[i], block_cos, block_sin), eps)
            x, h = add_rms_norm_cpu(x, w.o_proj[i].native(attended.view(b, width, hq * d)), w.post_attention_norm[i], eps)
            after = w.input_norm[i + 1] if i + 1 < layers else w.final_norm
            x, h = add_rms_norm_cpu(x, w.down_proj[i].native(silu_mul_cpu(w.gate_up[i].native(h))), after, eps)
        return h

    def first_layer_with_context(self, w: InferenceWeights, h: torch.Tensor,
                                 context: tuple[torch.Tensor, torch.Tensor | int], cache: KVArena,
                                 cos: torch.Tensor, sin: torch.Tensor, compiled: bool = False
                                 ) -> tuple[torch.Tensor, ...]:
        """The first layer's block q, k, v [b, B, heads, D] and, from the same GEMM, every layer's context K/V
        of the committed tokens `context` (written to the arena here): the context rows (fc -> hidden_norm)
        and the block's (`h`, after input_layernorm) go through [q0; every k; every v] together, and the
        context rows' q0 is dropped. cos/sin [b, n + B, 1, D] cover the context rows, then the block's.
        `compiled`: through the compiled CPU kernels, which norm and rotate the context's keys here and leave
        the block's q and k raw (its attention call norms and rotates them)."""
        cfg = self.config
        hq, hkv, d, layers, eps = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                   cfg.num_hidden_layers, cfg.rms_norm_eps)
        features, positions = context
        n = features.shape[1]
        rows = torch.cat([self.fused_features(w, features, compiled), h], dim=1)
        out = w.first_qkv_context(rows).view(*rows.shape[:2], -1, d)  # heads: q0, then each layer's k, then v
        keys = hq + layers * hkv
        if compiled:
            write_context_kv_cpu(out[:, :n, hq:keys], out[:, :n, keys:], w.context_k_norm, cos[:, :n, 0], sin[:, :n, 0],
                                 cache.keys, cache.values, positions, eps)
            return out[:, n:, :hq], out[:, n:, hq: hq + hkv], out[:, n:, keys: keys + hkv]
        qk = normed_rotated(out[:, :, :keys], w.first_qk_context_norm, cos, sin, eps)
        cache.write_all(positions, qk[:, :n, hq:].unflatten(2, (layers, hkv)),
                        out[:, :n, keys:].unflatten(2, (layers, hkv)))
        return qk[:, n:, :hq], qk[:, n:, hq: hq + hkv], out[:, n:, keys: keys + hkv]

    def forward_train(self, features: torch.Tensor, context_positions: torch.Tensor, block_embeds: torch.Tensor,
                      block_positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Differentiable forward over many blocks at once: context = all positions' target
        features [n, L, F]; queries = the blocks [n, T, H]; `mask` [n, T, L + T] says who sees what."""
        fused = self.hidden_norm(self.fc(features.to(self.dtype)))
        ctx_cos, ctx_sin = self.rotary(context_positions, fused.dtype)
        cos, sin = self.rotary(block_positions, fused.dtype)

        def attend(i, q, k, v):
            ctx_k, ctx_v = self.layers[i].self_attn.keys_values(fused, ctx_cos, ctx_sin)
            return sink_attention(q, torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2), mask, None,
                                  self.scale)

        return self.run_layers(block_embeds.to(self.dtype), cos, sin, attend)


def normalize_drafter_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Accept z-lab names with or without a `model.` prefix."""
    return {k.removeprefix("model."): v for k, v in state.items()}


def load_drafter(directory: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    directory = Path(directory)
    config_path = directory / "config.json"
    cfg = DFlashConfig.from_json(config_path)
    if (directory / "hf_quant_config.json").is_file():  # FP8 / NVFP4 drafter: dequantize exactly
        from ..quant.convert import load_dequantized_state_dict

        state = normalize_drafter_keys(load_dequantized_state_dict(directory))
    else:
        state = normalize_drafter_keys(load_state_dict(directory))
    model = DFlashDrafter(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    weights_file = directory / "model.safetensors"
    missing = sorted(set(expected) - set(state))
    if missing:
        raise InputError(f"missing {len(missing)} tensor(s), e.g. {missing[:3]}; the drafter config "
                         f"({config_path.name}) expects them.", path=weights_file)
    for name, shape in expected.items():
        if tuple(state[name].shape) != tuple(shape):
            raise InputError(f"shape {tuple(state[name].shape)} does not match {tuple(shape)} implied by "
                             f"{config_path.name}.", path=weights_file, field=name)
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise InputError(f"{len(unexpected)} unexpected tensor(s), e.g. {unexpected[:3]} (a DFlash drafter has "
                         "no embeddings or LM head of its own).", path=weights_file)
    model.load_state_dict({k: state[k] for k in expected})
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def save_drafter(model: DFlashDrafter, directory: str | Path) -> Path:
    """Write the z-lab layout: config.json + model.safetensors (no `model.` prefix)."""
    import json

    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "model.safetensors").chmod(0o644)  # save_file creates 0600
    return directory


class DrafterStep(nn.Module):
    """One drafter step as a graph for ONNX / TensorRT: block embeddings [b, B, H], context lengths
    [b] (the anchor sits at position ctx_lens[i]) and each layer's context arena (k, v) [b, Hkv, S, D]
    in; logits of slots 1..B-1 [b, B-1, V] out. Block attention is the draft-block plugin's op, so
    the exported graph carries one plugin node per layer."""

    def __init__(self, drafter: DFlashDrafter, lm_head_weight: torch.Tensor):
        super().__init__()
        self.drafter = drafter
        self.lm_head = nn.Linear(lm_head_weight.shape[1], lm_head_weight.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(lm_head_weight.detach().clone(), requires_grad=False)

    def forward(self, block_embeds: torch.Tensor, ctx_lens: torch.Tensor, *ctx_kv: torch.Tensor) -> torch.Tensor:
        width = block_embeds.shape[1]
        positions = ctx_lens[:, None].long() + torch.arange(width, device=block_embeds.device)
        cos, sin = self.drafter.rotary.cos_sin(positions, block_embeds.dtype)  # no table lookup: a static graph

        def attend(i, q, k, v):
            return self.drafter.plugin_attention(q, k, v, ctx_kv[2 * i], ctx_kv[2 * i + 1], ctx_lens)

        hidden = self.drafter.run_layers(block_embeds, cos, sin, attend)
        return self.lm_head(hidden[:, 1:])
