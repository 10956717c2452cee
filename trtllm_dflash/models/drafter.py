"""The DFlash block-diffusion drafter (z-lab `DFlashDraftModel` layout), written for the loop.

A stack of Qwen3-style decoder layers without embeddings or LM head (it borrows the target's).
Target features of committed tokens are fused (`fc` -> `hidden_norm`) and injected as extra K/V in
every layer; a block [anchor, MASK x (B-1)] attends bidirectionally to that context and to itself,
and slots 1..B-1 predict the tokens at their own positions (dflash-algorithm.md §2).

Context K/V is computed once per committed token (`write_context`) and cached in a per-request
arena. The inference path (`write_context`, `forward`) is lean because a drafter step on a small model
is bound by per-op overhead: the context K/V of all layers comes from one GEMM over stacked weights,
q/k/v and gate/up are fused (copies rebuilt whenever a parameter changes, see `InferenceWeights`;
while a forward hook watches a fused projection, as calibration does, the modules run instead),
and the block's own K/V is written to the arena slots just past each request's context, where the
visibility mask admits it for this forward only and the next commit overwrites it (so rejected
drafts never become context). `run_layers` / `forward_train` keep the per-module formulation that
training, the ONNX export and the tests' reference formulas use.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers import Qwen3Config

from ..checkpoints.hf import load_state_dict, read_json, require
from ..errors import InputError
from ..plugins.draft_block.reference import context_visibility
from ..quant.recipes import is_gpt_oss
from .kv_cache import KVArena
from .linear import CastLinear
from .rope import Rotary, apply_rotary, rotate
from .target import attention_bias, fused_attention, hooked, sink_attention


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """z-lab's fallback when a config has no `target_layer_ids`: spread over [1, L-3]."""
    if num_features == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_features - 1)) for i in range(num_features)]


# Where drafters carry their context window. z-lab (dflash/model.py @ 10129599) reads Qwen3's
# `sliding_window` on layers whose `layer_types` entry is "sliding_attention", causal inside the block
# unless `is_causal` is false; TensorRT-LLM (_torch/models/modeling_dflash.py @ 009d8fa4) reads
# `dflash_config.use_swa` / `swa_window_size`. Both: a query at position q sees keys k with q - k < W.
WINDOW_FIELDS = ("sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "is_causal")


def read_sliding_window(raw: dict[str, Any], dflash: dict[str, Any], num_layers: int, path: Path) -> int | None:
    """The drafter's context window from either spelling; one window for all layers."""
    layer_types = raw.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list) or len(layer_types) != num_layers
                                    or not set(layer_types) <= {"sliding_attention", "full_attention"}):
        raise InputError(f"expected {num_layers} entries of 'sliding_attention' / 'full_attention', got "
                         f"{layer_types!r}.", path=path, field="layer_types")
    zlab = raw.get("sliding_window") if layer_types and "sliding_attention" in layer_types else None
    trtllm = dflash.get("swa_window_size") if dflash.get("use_swa") else None
    if layer_types and len(set(layer_types)) > 1 and (zlab is not None or trtllm is not None):
        raise InputError("a window on only some drafter layers is not supported (one window for all layers).",
                         path=path, field="layer_types")
    if zlab is not None and raw.get("is_causal", True):
        raise InputError("sliding-window layers without 'is_causal': false are causal inside the block in "
                         "z-lab's code; this runtime drafts bidirectionally.", path=path, field="is_causal")
    windows = {w for w in (zlab, trtllm) if w is not None}
    if len(windows) > 1:
        raise InputError(f"sliding_window {zlab} and dflash_config.swa_window_size {trtllm} disagree.",
                         path=path, field="dflash_config.swa_window_size")
    window = windows.pop() if windows else None
    if window is not None and not (type(window) is int and window >= 1):
        raise InputError(f"expected a positive int, got {window!r}.", path=path, field="sliding_window")
    return window


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    max_position_embeddings: int = 131072
    vocab_size: int | None = None
    hidden_act: str = "silu"
    sliding_window: int | None = None  # context window W of every drafter layer (None: all context)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_json(cls, path: Path) -> "DFlashConfig":
        return cls.from_dict(read_json(path), path)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], path: Path | str = "config.json") -> "DFlashConfig":
        path = Path(path)
        if is_gpt_oss(raw):
            raise InputError("this is a target checkpoint (gpt-oss), not a DFlash drafter: pass it as --target, and as "
                             "--drafter a directory whose config.json has block_size and dflash_config.", path=path,
                             field="model_type")
        ints = {k: require(raw, k, int, path) for k in
                ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "block_size", "num_target_layers")}
        head_dim = raw.get("head_dim") or ints["hidden_size"] // ints["num_attention_heads"]
        dflash = raw.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise InputError("expected an object.", path=path, field="dflash_config")
        if "mask_token_id" in dflash:
            mask_token_id = require(dflash, "mask_token_id", int, path)
        elif "mask_token_id" in raw:  # configs from before z-lab moved it into dflash_config
            mask_token_id = require(raw, "mask_token_id", int, path)
        else:
            raise InputError("missing; the drafter needs the id of its mask token.", path=path,
                             field="dflash_config.mask_token_id")
        if "target_layer_ids" in dflash:
            layer_ids = dflash["target_layer_ids"]
            if not (isinstance(layer_ids, list) and layer_ids and all(type(i) is int for i in layer_ids)):
                raise InputError(f"expected a non-empty list of ints, got {layer_ids!r}.", path=path,
                                 field="dflash_config.target_layer_ids")
        else:
            layer_ids = default_target_layer_ids(ints["num_target_layers"], ints["num_hidden_layers"])
        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise InputError(f"only 'silu' is supported, got {hidden_act!r}.", path=path, field="hidden_act")
        rope_scaling = raw.get("rope_scaling")
        if rope_scaling is not None and not isinstance(rope_scaling, dict):
            raise InputError("expected an object or null.", path=path, field="rope_scaling")
        known = set(cls.__dataclass_fields__) | {"dflash_config", *WINDOW_FIELDS}
        config = cls(
            **ints, head_dim=int(head_dim), mask_token_id=mask_token_id, target_layer_ids=list(layer_ids),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=float(raw.get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling, attention_bias=bool(raw.get("attention_bias", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 131072)),
            vocab_size=raw.get("vocab_size"), hidden_act=hidden_act,
            sliding_window=read_sliding_window(raw, dflash, ints["num_hidden_layers"], path),
            extra={k: v for k, v in raw.items() if k not in known},
        )
        config.check(path)
        return config

    def check(self, path: Path | str) -> None:
        """Internal consistency; fit with a particular target is checked in `checkpoints.validate`."""
        if self.block_size < 2:
            raise InputError(f"must be at least 2 (anchor + one draft), got {self.block_size}.",
                             path=path, field="block_size")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InputError(f"{self.num_attention_heads} query heads are not a multiple of "
                             f"{self.num_key_value_heads} KV heads.", path=path, field="num_key_value_heads")
        if self.head_dim % 2:
            raise InputError(f"RoPE needs an even head_dim, got {self.head_dim}.", path=path, field="head_dim")

    def to_dict(self) -> dict[str, Any]:
        """The z-lab config.json form (what TensorRT-LLM's DFlash loader and ours read)."""
        out = dict(self.extra)
        out.update({k: v for k, v in asdict(self).items()
                    if k not in ("mask_token_id", "target_layer_ids", "extra") and v is not None})
        out["dflash_config"] = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        if self.sliding_window is not None:  # both upstream spellings (see `read_sliding_window`)
            out.update(use_sliding_window=True, max_window_layers=0, is_causal=False,
                       layer_types=["sliding_attention"] * self.num_hidden_layers)
            out["dflash_config"].update(use_swa=True, swa_window_size=self.sliding_window)
        out.setdefault("architectures", ["DFlashDraftModel"])
        out.setdefault("model_type", "qwen3")
        return out

    def rope_config(self) -> Qwen3Config:
        return Qwen3Config(hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
                           max_position_embeddings=self.max_position_embeddings)


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in float32, cast back, then scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * normalized(x, self.eps)


def normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in float32, cast back (the RMSNorm without its weight)."""
    return F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


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


def cat_or_none(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if tensors[0] is None else torch.cat([t.detach() for t in tensors])


def linear_of(modules: list[nn.Linear], dtype: torch.dtype) -> CastLinear:
    """One GEMM for these projections of the same input, stacked along the output."""
    return CastLinear(cat_or_none([m.weight for m in modules]), cat_or_none([m.bias for m in modules]), dtype)


@dataclass
class InferenceWeights:
    """What the inference path multiplies: every GEMM in `dtype` (`CastLinear`), fused from the modules'
    parameters (copies), and the norm weights the fused path applies itself."""

    fc: CastLinear
    context_kv: CastLinear  # every layer's k then v projection, stacked: [layers * 2 * Hkv * D] outputs
    context_k_norm: torch.Tensor  # [layers, 1, D]: each layer's k_norm weight
    qkv: list[CastLinear]  # per layer [(Hq + 2 Hkv) * D] outputs
    qk_norm: list[torch.Tensor]  # per layer [Hq + Hkv, D]: q_norm per query head, then k_norm per KV head
    o_proj: list[CastLinear]
    gate_up: list[CastLinear]  # per layer [2 I] outputs
    down_proj: list[CastLinear]

    @classmethod
    def build(cls, drafter: "DFlashDrafter", dtype: torch.dtype | None = None) -> "InferenceWeights":
        cfg, dtype = drafter.config, dtype or drafter.dtype
        attns = [layer.self_attn for layer in drafter.layers]
        mlps = [layer.mlp for layer in drafter.layers]
        return cls(
            fc=linear_of([drafter.fc], dtype),
            context_kv=linear_of([p for a in attns for p in (a.k_proj, a.v_proj)], dtype),
            context_k_norm=torch.stack([a.k_norm.weight.detach() for a in attns])[:, None],
            qkv=[linear_of([a.q_proj, a.k_proj, a.v_proj], dtype) for a in attns],
            qk_norm=[torch.cat([a.q_norm.weight.detach().expand(cfg.num_attention_heads, -1),
                                a.k_norm.weight.detach().expand(cfg.num_key_value_heads, -1)]) for a in attns],
            o_proj=[linear_of([a.o_proj], dtype) for a in attns],
            gate_up=[linear_of([m.gate_proj, m.up_proj], dtype) for m in mlps],
            down_proj=[linear_of([m.down_proj], dtype) for m in mlps],
        )


def block_visibility(context_lens: torch.Tensor, width: int, length: int, window: int | None) -> torch.Tensor:
    """[b, width, length] bool: the arena slots each block slot sees -- its context (all of
    [0, context_len), or the last `window` positions before the slot, as the plugin reference defines
    it) and the block itself, written at [context_len, context_len + width) for the current forward."""
    slots = torch.arange(length, device=context_lens.device)
    block = (slots >= context_lens[:, None]) & (slots < context_lens[:, None] + width)
    return context_visibility(context_lens, width, length, window) | block[:, None]


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
                        context_lens: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Block queries q [b, Hq, B, D] over the request's context and the block's own k/v [b, B, Hkv, D]
        -> [b, B, Hq*D]. The plain path writes k/v to the arena slots just past the context and reads
        both from there under `visible` (`attention_bias` form on CPU, `block_visibility` elsewhere);
        the plugin gets them apart."""
        if self.use_plugin:
            return self.plugin_attention(q, k.transpose(1, 2), v.transpose(1, 2), cache.k[layer], cache.v[layer],
                                         context_lens)
        width = q.shape[2]
        cache.write(layer, context_lens[:, None] + torch.arange(width, device=q.device), k, v)
        keys, values = cache.read(layer, visible.shape[-1])
        if q.device.type == "cpu":
            return fused_attention(q, keys, values, visible, None, self.scale)
        return sink_attention(q, keys, values, visible, None, self.scale)

    def block_mask(self, context_lens: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
        """`block_attention`'s `visible` for a block of `width` slots, built once per step for all
        layers: the bool mask, or on CPU the additive bias the fused kernel takes."""
        cfg = self.config
        visible = block_visibility(context_lens, width, int(context_lens.max()) + width, cfg.sliding_window)
        if context_lens.device.type == "cpu":
            return attention_bias(visible, cfg.num_attention_heads // cfg.num_key_value_heads, dtype)
        return visible

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
    def write_context(self, features: torch.Tensor, positions: torch.Tensor, cache: KVArena,
                      matmul_dtype: torch.dtype | None = None) -> None:
        """Project target features [b, n, F] of committed tokens at `positions` [b, n] into every
        layer's context K/V. Done once per committed token; never recomputed. All layers at once:
        fc -> hidden_norm -> one GEMM over the stacked k/v weights -> each layer's k_norm -> RoPE.
        `matmul_dtype`: the GEMMs' dtype (`CastLinear`; None: the parameters')."""
        cfg = self.config
        features = features.to(self.dtype)
        if self.bypassed_modules_hooked():
            fused = self.hidden_norm(self.fc(features))
            cos, sin = self.rotary(positions, fused.dtype)
            for i, layer in enumerate(self.layers):
                k, v = layer.self_attn.keys_values(fused, cos, sin)
                cache.write(i, positions, k.transpose(1, 2), v.transpose(1, 2))
            return
        w = self.inference_weights(matmul_dtype)
        fused = self.hidden_norm(w.fc(features))
        cos, sin = self.rotary(positions, fused.dtype)
        b, n, _ = fused.shape
        kv = w.context_kv(fused).view(b, n, cfg.num_hidden_layers, 2, cfg.num_key_value_heads, cfg.head_dim)
        k = rotate(normalized(kv[:, :, :, 0], cfg.rms_norm_eps) * w.context_k_norm, cos[:, :, None, None],
                   sin[:, :, None, None])
        cache.write_all(positions, k, kv[:, :, :, 1])

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
    def forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor, cache: KVArena,
                context_lens: torch.Tensor, matmul_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Draft one block per request: embeds [b, B, H] at positions [b, B]; request i sees its
        context positions [0, context_lens[i]). Returns the final-normed hidden states [b, B, H].
        `matmul_dtype`: the GEMMs' dtype (`CastLinear`; None: the parameters').

        The block's K/V go to arena slots [context_lens[i], context_lens[i] + B) (the cache must have
        room for them), which hold no context: the next `write_context` overwrites them."""
        cfg = self.config
        x = block_embeds.to(self.dtype)
        b, width, _ = x.shape
        hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        cos, sin = self.rotary(block_positions, x.dtype)
        visible = self.block_mask(context_lens, width, x.dtype)
        if self.bypassed_modules_hooked():
            return self.run_layers(x, cos, sin, lambda i, q, k, v: self.block_attention(
                i, q, k.transpose(1, 2), v.transpose(1, 2), cache, context_lens, visible))
        w = self.inference_weights(matmul_dtype)
        cos, sin = cos[:, :, None], sin[:, :, None]
        for i, layer in enumerate(self.layers):
            qkv = w.qkv[i](layer.input_layernorm(x)).view(b, width, -1, cfg.head_dim)
            qk = rotate(normalized(qkv[:, :, : hq + hkv], cfg.rms_norm_eps) * w.qk_norm[i], cos, sin)
            attended = self.block_attention(i, qk[:, :, :hq].transpose(1, 2), qk[:, :, hq:], qkv[:, :, hq + hkv:],
                                            cache, context_lens, visible)
            x = x + w.o_proj[i](attended)
            gate, up = w.gate_up[i](layer.post_attention_layernorm(x)).chunk(2, dim=-1)
            x = x + w.down_proj[i](F.silu(gate) * up)
        return self.norm(x)

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
        cos, sin = self.drafter.rotary(positions, block_embeds.dtype)

        def attend(i, q, k, v):
            return self.drafter.plugin_attention(q, k, v, ctx_kv[2 * i], ctx_kv[2 * i + 1], ctx_lens)

        hidden = self.drafter.run_layers(block_embeds, cos, sin, attend)
        return self.lm_head(hidden[:, 1:])
