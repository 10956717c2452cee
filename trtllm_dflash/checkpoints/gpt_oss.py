"""Loading a gpt-oss checkpoint (HF layout, experts in MXFP4 or plain) for the reference runtime."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ..errors import InputError
from .hf import read_json, require, safetensors_files


def read_target_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    raw = read_json(path)
    model_type = raw.get("model_type")
    if model_type != "gpt_oss":
        raise InputError(f"expected 'gpt_oss' (a gpt-oss checkpoint in Hugging Face layout), got {model_type!r}.",
                         path=path, field="model_type")
    for key in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "num_key_value_heads"):
        require(raw, key, int, path)
    return raw


def check_weight_files(directory: Path) -> list[Path]:
    """Open every safetensors header; a truncated or corrupt file fails here, before loading."""
    files = safetensors_files(directory)
    for file in files:
        try:
            with safe_open(file, framework="pt") as handle:
                handle.keys()
        except (SafetensorError, OSError) as exc:
            raise InputError(f"cannot read safetensors (truncated or corrupt?): {exc}", path=file) from None
    return files


def stop_token_ids(directory: Path, config: dict[str, Any]) -> list[int]:
    """gpt-oss declares its full stop set in generation_config.json; config.json has only one id."""
    generation = directory / "generation_config.json"
    ids = read_json(generation).get("eos_token_id") if generation.is_file() else None
    if ids is None:
        ids = config.get("eos_token_id")
    if ids is None:
        return []
    return [ids] if isinstance(ids, int) else [int(i) for i in ids]


def is_modelopt_quantized(directory: Path, config: dict[str, Any]) -> bool:
    """A checkpoint our converter (or ModelOpt) wrote with FP8 / NVFP4 scale tensors."""
    method = (config.get("quantization_config") or {}).get("quant_method")
    return method == "modelopt" or (directory / "hf_quant_config.json").is_file()


def load_hf_gpt_oss(directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """transformers' GptOssForCausalLM with eager attention; MXFP4 experts dequantized, and
    FP8 / NVFP4 checkpoints dequantized by our codecs (so acceptance can be measured on them)."""
    from transformers import GptOssConfig, GptOssForCausalLM, Mxfp4Config
    from transformers.utils import logging as hf_logging

    directory = Path(directory)
    raw = read_target_config(directory)
    files = check_weight_files(directory)
    if is_modelopt_quantized(directory, raw):
        from ..quant.convert import load_dequantized_state_dict

        config = GptOssConfig.from_dict({k: v for k, v in raw.items() if k != "quantization_config"})
        config._attn_implementation = "eager"
        model = GptOssForCausalLM(config)
        missing, _ = model.load_state_dict(load_dequantized_state_dict(directory, dtype), strict=False)
        missing = [name for name in missing if not name.endswith("inv_freq")]
        if missing:
            raise InputError(f"{len(missing)} weight(s) missing, e.g. {missing[:3]}.", path=files[0])
        return model.to(device=device, dtype=dtype).eval()
    kwargs: dict[str, Any] = {}
    if (raw.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model, info = GptOssForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="eager",
                                                        output_loading_info=True, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise InputError(f"{len(missing)} weight(s) missing, e.g. {missing[:3]}.", path=files[0])
    return model.to(device=device, dtype=dtype).eval()
