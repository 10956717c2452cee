"""The copies of a DFlash drafter's weights that its inference path multiplies (`InferenceWeights`): every
GEMM's weights fused where one input feeds several projections and laid out for the GEMM dtype
(`CastLinear`), and the norm weights in the forms the lean path applies them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from .layers import doubled_weight
from .linear import CastLinear, gemm_dtype

if TYPE_CHECKING:
    from .drafter import DFlashDrafter


def cat_or_none(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if tensors[0] is None else torch.cat([t.detach() for t in tensors])


def linear_of(modules: list[nn.Linear], dtype: torch.dtype) -> CastLinear:
    """One GEMM for these projections of the same input, stacked along the output, in `dtype` where
    `gemm_dtype` admits it."""
    weight = cat_or_none([m.weight for m in modules])
    return CastLinear(weight, cat_or_none([m.bias for m in modules]), gemm_dtype(weight, dtype))


@dataclass
class InferenceWeights:
    """What the inference path multiplies: every GEMM in `dtype` where `gemm_dtype` admits it (`CastLinear`),
    fused from the modules' parameters (copies), and the norm weights the fused path applies itself
    (the hidden-size ones doubled, [w, w], for `lean_rms_norm`)."""

    fc: CastLinear
    hidden_norm: torch.Tensor  # [2 H]
    context_kv: CastLinear  # every layer's k projection, then every layer's v: [2 * layers * Hkv * D] outputs
    context_k_norm: torch.Tensor  # [layers, 1, D]: each layer's k_norm weight
    first_qkv_context: CastLinear  # the first layer's q projection, then `context_kv`'s: a drafting step's rows
    first_qk_context_norm: torch.Tensor  # [Hq + layers * Hkv, D]: first layer's q_norm per query head, k_norms
    qkv: list[CastLinear]  # per layer [(Hq + 2 Hkv) * D] outputs
    qk_norm: list[torch.Tensor]  # per layer [Hq + Hkv, D]: q_norm per query head, then k_norm per KV head
    q_norm: list[torch.Tensor]  # per layer [D], for the compiled kernel's prologue
    k_norm: list[torch.Tensor]  # per layer [D]
    o_proj: list[CastLinear]
    gate_up: list[CastLinear]  # per layer [2 I] outputs
    down_proj: list[CastLinear]
    input_norm: list[torch.Tensor]  # per layer [2 H]
    post_attention_norm: list[torch.Tensor]  # per layer [2 H]
    final_norm: torch.Tensor  # [2 H]

    @classmethod
    def build(cls, drafter: "DFlashDrafter", dtype: torch.dtype | None = None) -> "InferenceWeights":
        cfg, dtype = drafter.config, dtype or drafter.dtype
        attns = [layer.self_attn for layer in drafter.layers]
        mlps = [layer.mlp for layer in drafter.layers]

        context = [a.k_proj for a in attns] + [a.v_proj for a in attns]
        q_norms = [a.q_norm.weight.detach().expand(cfg.num_attention_heads, -1) for a in attns]  # per query head
        k_norms = [a.k_norm.weight.detach().expand(cfg.num_key_value_heads, -1) for a in attns]  # per KV head
        return cls(
            fc=linear_of([drafter.fc], dtype),
            hidden_norm=doubled_weight(drafter.hidden_norm),
            context_kv=linear_of(context, dtype),
            context_k_norm=torch.stack([a.k_norm.weight.detach() for a in attns])[:, None],
            first_qkv_context=linear_of([attns[0].q_proj, *context], dtype),
            first_qk_context_norm=torch.cat([q_norms[0], *k_norms]),
            qkv=[linear_of([a.q_proj, a.k_proj, a.v_proj], dtype) for a in attns],
            qk_norm=[torch.cat([q, k]) for q, k in zip(q_norms, k_norms)],
            q_norm=[a.q_norm.weight.detach().clone() for a in attns],
            k_norm=[a.k_norm.weight.detach().clone() for a in attns],
            o_proj=[linear_of([a.o_proj], dtype) for a in attns],
            gate_up=[linear_of([m.gate_proj, m.up_proj], dtype) for m in mlps],
            down_proj=[linear_of([m.down_proj], dtype) for m in mlps],
            input_norm=[doubled_weight(layer.input_layernorm) for layer in drafter.layers],
            post_attention_norm=[doubled_weight(layer.post_attention_layernorm) for layer in drafter.layers],
            final_norm=doubled_weight(drafter.norm),
        )
