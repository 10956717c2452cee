"""The gpt-oss target as the draft-verify loop needs it.

The weights live in transformers' `GptOssForCausalLM` (the reference implementation; it also
dequantizes the MXFP4 experts on CPU). This adapter runs its own lean forward over those very
modules, gpt-fast style, because the loop needs three things transformers' generate path lacks:

* a static K/V arena with per-request lengths that rolls back for free (see `kv_cache.py`);
* ragged batches: every request has its own absolute positions;
* the residual stream after selected decoder layers (the DFlash features).

Feature convention: target layer id `i` means the OUTPUT of decoder layer `i` (0-based), i.e.
transformers' `hidden_states[i + 1]` -- the z-lab convention (dflash-algorithm.md §2.4) -- except for
the last layer, whose HF entry is after the final norm while this (like TensorRT-LLM) is before it.
The forward is tested token-identical to `GptOssForCausalLM.generate` on the same weights.
"""

from __future__ import annotations

import torch
from torch import nn

from .kv_cache import KVArena
from .rope import Rotary, apply_rotary


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   sinks: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Grouped-query attention with an optional learned sink logit per query head.

    q [b, Hq, t, D]; k/v [b, Hkv, S, D]; mask [b, t, S] bool (True = visible); sinks [Hq] or None.
    The sink acts as one extra logit column with no value vector (gpt-oss). Returns [b, t, Hq*D].
    """
    b, hq, t, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    rows = hq // hkv * t
    # A KV head's query heads go side by side as extra rows, so K/V are read where they lie (a cache
    # slice) instead of being broadcast over the group, which copied the whole context every step.
    scores = (q.reshape(b, hkv, rows, d) @ k.transpose(-1, -2)).float() * scale  # [b, Hkv, G*t, S]
    scores = scores.view(b, hkv, hq // hkv, t, length).masked_fill(~mask[:, None, None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, hkv, hq // hkv, 1, 1).expand(b, -1, -1, t, 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    out = probs.to(v.dtype).reshape(b, hkv, rows, length) @ v  # [b, Hkv, G*t, D]
    return out.reshape(b, hq, t, d).transpose(1, 2).reshape(b, t, hq * d)


def causal_mask(positions: torch.Tensor, kv_len: int, window: int | None) -> torch.Tensor:
    """positions [b, t] -> [b, t, kv_len]: key p visible iff p <= query (and p > query - window)."""
    keys = torch.arange(kv_len, device=positions.device)
    query = positions[:, :, None]
    mask = keys <= query
    if window is not None:
        mask &= keys > query - window
    return mask


class GptOssTarget(nn.Module):
    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model.eval().requires_grad_(False)
        cfg = hf_model.config
        self.config = cfg
        self.rotary = Rotary(cfg).to(hf_model.lm_head.weight.device)  # built after the model was placed
        self.windows = [cfg.sliding_window if kind == "sliding_attention" else None for kind in cfg.layer_types]
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim ** -0.5

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.hf.lm_head.weight.device

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    def new_cache(self, batch: int, capacity: int) -> KVArena:
        cfg = self.config
        return KVArena(cfg.num_hidden_layers, batch, cfg.num_key_value_heads, capacity, self.head_dim,
                       self.dtype, self.device)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.hf.model.embed_tokens(tokens)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from a hidden state that is already final-normed (the drafter's output is)."""
        return self.hf.lm_head(hidden).float()

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVArena,
                feature_layers: list[int], logit_index: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run tokens [b, t] at absolute positions [b, t], writing their K/V into the cache.

        Returns logits [b, t, V] (or [b, V] at `logit_index` [b]) and the concatenated outputs of
        `feature_layers` [b, t, len * hidden] (None when no layer is asked for).
        """
        x = self.embed(tokens)
        cos, sin = self.rotary(positions, x.dtype)
        kv_len = int(positions.max()) + 1
        masks = {w: causal_mask(positions, kv_len, w) for w in set(self.windows)}
        captured = {}
        b, t, _ = x.shape
        for i, layer in enumerate(self.hf.model.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(b, t, -1, self.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(b, t, -1, self.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(b, t, -1, self.head_dim).transpose(1, 2)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            cache.write(i, positions, k, v)
            keys, values = cache.read(i, kv_len)
            x = x + attn.o_proj(sink_attention(q, keys, values, masks[self.windows[i]], attn.sinks, self.scale))
            x = x + layer.mlp(layer.post_attention_layernorm(x))[0]
            if i in feature_layers:
                captured[i] = x
        features = torch.cat([captured[i] for i in feature_layers], dim=-1) if feature_layers else None
        if logit_index is not None:
            x = x[torch.arange(b, device=x.device), logit_index]
        return self.hf.lm_head(self.hf.model.norm(x)).float(), features
