"""A DFlash drafter's config.json (z-lab layout, with TensorRT-LLM's spellings of the same fields):
read, checked, written; and z-lab's default choice of target layers."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from transformers import Qwen3Config

from ..checkpoints.hf import read_json, require
from ..errors import InputError
from ..quant.recipes import is_gpt_oss


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
