"""Quantization recipes: which weights get which format, and what the checkpoint says about it.

A recipe maps parameter-name patterns (``fnmatch``, first match wins) to a :class:`Format`. The same
names cover the gpt-oss target (``model.layers.N...``) and a DFlash drafter (``layers.N...``,
``fc.weight``), so one recipe applies to both. Parameters are *logical* weights: gpt-oss experts
are ``...mlp.experts.gate_up_proj`` / ``...down_proj`` whether stored as MXFP4 ``*_blocks`` +
``*_scales`` or as a bf16 tensor.

Standard exclusions, applied before any recipe rule, keep in the source dtype (bf16 for gpt-oss):
the MoE router (its top-k choice is discontinuous, so small errors flip experts), embeddings and
LM head (vocab-sized, accuracy-critical, and memory-bound rather than compute-bound), norms,
attention sinks and all biases (tiny tensors added, not multiplied).

TensorRT-LLM reads the result through ``hf_quant_config.json`` (ModelOpt unified HF format) or,
for native MXFP4, through ``config.json``'s ``quantization_config`` (see :func:`quant_configs`).

The gpt-oss TARGET gets its own variants of ``fp8`` and ``nvfp4`` (:data:`GPT_OSS_RECIPES`, chosen
by ``get_recipe(name, "gpt_oss")``) because TensorRT-LLM's ``GptOssForCausalLM`` ignores per-layer
``MIXED_PRECISION`` configs, forces attention to bf16 under NVFP4, and has no FP8 expert path:

* ``nvfp4`` on gpt-oss: NVFP4 experts only, attention bf16; ``quant_algo: "NVFP4"``,
  ``group_size: 16``, attention listed in ``exclude_modules``, no ``quantized_layers``. The NVFP4
  MoE loader also needs ``*_input_scale``: the converter refuses to run without calibrated amax.
* ``fp8`` on gpt-oss: FP8 attention, experts bf16 (excluded as ``*mlp.experts*``);
  ``quant_algo: "FP8"``. Not verified against a TensorRT-LLM loader (there is no gpt-oss FP8
  checkpoint to compare with). MXFP4 experts are dequantized to bf16, so the checkpoint is about
  4x the size of the native one; for quantized experts use ``mxfp4`` or ``nvfp4``.

The DFlash DRAFTER (Qwen3-like dense layers, loaded by TensorRT-LLM's generic linear path) keeps the
generic recipes: ``nvfp4`` = NVFP4 MLP + FP8 attention and ``fc`` as ``MIXED_PRECISION``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from fnmatch import fnmatchcase

import trtllm_dflash


class Format(str, Enum):
    """Storage format of one weight."""

    BF16 = "bf16"  # unquantized: floats are copied, MXFP4 sources are dequantized to bf16
    FP8 = "fp8"  # float8_e4m3fn + fp32 per-tensor weight_scale
    NVFP4 = "nvfp4"  # packed E2M1 + E4M3 per-16 weight_scale + fp32 weight_scale_2
    MXFP4 = "mxfp4"  # gpt-oss *_blocks / *_scales (E2M1 + E8M0 per 32)


# TensorRT-LLM QuantAlgo names for per-layer entries of a MIXED_PRECISION config.
TRTLLM_ALGO = {Format.FP8: "FP8", Format.NVFP4: "NVFP4"}
NVFP4_GROUP_SIZE = 16
MXFP4_GROUP_SIZE = 32

KEEP_UNQUANTIZED = ("*router*", "*embed_tokens*", "lm_head*", "*norm*", "*sinks", "*bias")
EXPERTS = ("*mlp.experts.gate_up_proj", "*mlp.experts.down_proj")
ATTENTION = ("*self_attn.q_proj.weight", "*self_attn.k_proj.weight", "*self_attn.v_proj.weight", "*self_attn.o_proj.weight")
DENSE_MLP = ("*mlp.gate_proj.weight", "*mlp.up_proj.weight", "*mlp.down_proj.weight")  # drafter MLP
DRAFTER_FC = ("fc.weight",)  # drafter projection of the concatenated target hidden states

# Module names and wildcards listed as excluded in hf_quant_config.json. Both the HF names and
# TensorRT-LLM's module names for gpt-oss (router -> mlp.gate, embed_tokens -> embedding) are
# given because TensorRT-LLM matches exclude_modules against its own module tree.
EXCLUDE_MODULES = ["lm_head", "*lm_head", "*router*", "*.mlp.gate", "*embed_tokens*", "*embedding*"]

KV_CACHE_ALGOS = {"auto": None, "fp8": "FP8"}


@dataclass(frozen=True)
class Recipe:
    """A named weight-format policy.

    ``trtllm_quant_algo`` is the ``QuantAlgo`` written to ``hf_quant_config.json``; ``None`` means
    the recipe writes no ModelOpt config (``none``: plain checkpoint; ``mxfp4``: TensorRT-LLM picks
    ``W4A16_MXFP4`` on Hopper, ``W4A8_MXFP4_MXFP8`` or, with the TRITON MoE backend,
    ``W4A8_MXFP4_FP8`` on Blackwell, from ``quantization_config.quant_method == "mxfp4"``).
    """

    name: str
    summary: str
    rules: tuple[tuple[tuple[str, ...], Format], ...]
    trtllm_quant_algo: str | None
    exclude_modules: tuple[str, ...] = ()  # listed in hf_quant_config.json on top of EXCLUDE_MODULES

    def format_for(self, param: str) -> Format:
        """Format for logical parameter ``param`` (unmatched names stay unquantized)."""
        if _matches(param, KEEP_UNQUANTIZED):
            return Format.BF16
        for patterns, fmt in self.rules:
            if _matches(param, patterns):
                return fmt
        return Format.BF16


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatchcase(name, p) for p in patterns)


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            "none",
            "bf16 everywhere; MXFP4 experts are dequantized (exactly) to bf16",
            (),
            None,
        ),
        Recipe(
            "fp8",
            "FP8 E4M3 weights with per-tensor scales for attention, drafter MLP and fc "
            "(gpt-oss experts stay bf16: see GPT_OSS_RECIPES)",
            ((ATTENTION + DENSE_MLP + DRAFTER_FC, Format.FP8),),
            "FP8",
        ),
        Recipe(
            "nvfp4",
            "drafter: NVFP4 MLP, FP8 attention and fc, written as MIXED_PRECISION with per-module "
            "quantized_layers (a gpt-oss target gets GPT_OSS_RECIPES['nvfp4'] instead)",
            ((DENSE_MLP, Format.NVFP4), (ATTENTION + DRAFTER_FC, Format.FP8)),
            "MIXED_PRECISION",
        ),
        Recipe(
            "mxfp4",
            "native gpt-oss MXFP4 experts kept byte for byte (bf16 experts are encoded); the rest bf16. "
            "A drafter has no experts, so it stays bf16.",
            ((EXPERTS, Format.MXFP4),),
            None,
        ),
    )
}


# The gpt-oss target's variants (see the module docstring): what TensorRT-LLM's GptOssForCausalLM
# actually loads. Attention is excluded under NVFP4 under both its HF (self_attn) and TensorRT-LLM
# (attn) module names; TensorRT-LLM forces it to bf16 anyway.
GPT_OSS_RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(
            "fp8",
            "gpt-oss: FP8 E4M3 attention (per-tensor scales), experts kept bf16 (TensorRT-LLM has no FP8 "
            "expert path for gpt-oss); unverified against a TensorRT-LLM loader",
            ((ATTENTION, Format.FP8),),
            "FP8",
            ("*mlp.experts*",),
        ),
        Recipe(
            "nvfp4",
            "gpt-oss: NVFP4 experts only (re-expressed exactly from MXFP4 where E4M3 range allows), "
            "[E, in/2, out] with scalar global and input scales (calibration required); attention bf16. "
            "Written as quant_algo NVFP4, group_size 16.",
            ((EXPERTS, Format.NVFP4),),
            "NVFP4",
            ("*self_attn*", "*.attn", "*.attn.*"),
        ),
    )
}


def get_recipe(name: str, model_type: str | None = None) -> Recipe:
    """Look up a recipe by name, in its gpt-oss variant for ``model_type == "gpt_oss"``; ValueError
    lists the valid names (the CLI maps it to a usage error)."""
    try:
        recipe = RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown quantization recipe {name!r}; choose one of {sorted(RECIPES)}") from None
    return GPT_OSS_RECIPES.get(name, recipe) if model_type == "gpt_oss" else recipe


def is_gpt_oss(config: dict, param_names: list[str] | None = None) -> bool:
    """A gpt-oss target: its config says so, or it has gpt-oss expert tensors."""
    if config.get("model_type") == "gpt_oss" or "GptOssForCausalLM" in (config.get("architectures") or []):
        return True
    return any(_matches(n, EXPERTS) for n in param_names or ())


def module_of(param: str) -> str:
    """Module that owns ``param``: ``a.q_proj.weight`` -> ``a.q_proj``; experts -> ``...mlp.experts``."""
    return param.removesuffix(".weight") if param.endswith(".weight") else param.rsplit(".", 1)[0]


def quant_configs(
    recipe: Recipe,
    kv_cache_dtype: str,
    formats: dict[str, Format],
    source_quantization_config: dict | None = None,
) -> tuple[dict | None, dict | None]:
    """``(hf_quant_config.json content, config.json quantization_config)`` for a converted checkpoint.

    ``formats`` maps every quantized logical parameter to its format. ModelOpt-style output uses the
    legacy ``{"producer", "quantization"}`` shape in ``hf_quant_config.json`` and the flat
    ``quant_method: "modelopt"`` shape in ``config.json``; TensorRT-LLM reads either. ``None`` means
    "do not write" (``hf_quant_config.json``) or "remove" (``quantization_config``).
    """
    kv_algo = KV_CACHE_ALGOS[kv_cache_dtype]
    if recipe.name == "mxfp4":
        return None, _mxfp4_quantization_config(formats, source_quantization_config)
    if recipe.trtllm_quant_algo is None and kv_algo is None:
        return None, None
    quantization: dict = {
        "quant_algo": recipe.trtllm_quant_algo,
        "kv_cache_quant_algo": kv_algo,
        "exclude_modules": list(EXCLUDE_MODULES) + list(recipe.exclude_modules),
    }
    if recipe.trtllm_quant_algo == "NVFP4":
        quantization["group_size"] = NVFP4_GROUP_SIZE
    if recipe.trtllm_quant_algo == "MIXED_PRECISION":
        quantization["quantized_layers"] = _quantized_layers(formats)
    producer = {"name": "trtllm_dflash", "version": trtllm_dflash.__version__}
    return {"producer": producer, "quantization": quantization}, {"quant_method": "modelopt", **quantization}


def _quantized_layers(formats: dict[str, Format]) -> dict[str, dict]:
    layers: dict[str, dict] = {}
    for param, fmt in sorted(formats.items()):
        entry = {"quant_algo": TRTLLM_ALGO[fmt]}
        if fmt is Format.NVFP4:
            entry["group_size"] = NVFP4_GROUP_SIZE
        layers[module_of(param)] = entry
    return layers


def _mxfp4_quantization_config(formats: dict[str, Format], source: dict | None) -> dict | None:
    if not formats:
        return None  # nothing in MXFP4 (a drafter): a plain bf16 checkpoint
    if source and source.get("quant_method") == "mxfp4":
        return source
    return {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    }
