"""Checks a build makes before writing anything, beyond `validate_pair`'s shape checks.

Each one stops a build that TensorRT-LLM would only refuse (or silently degrade) on the GPU host:
draft length vs the drafter's block, tokenizer mismatches, quantization formats the profile's GPU
cannot run, parallel sizes that do not split the model, a sequence length past the target's reach.
"""

from __future__ import annotations

from pathlib import Path

from ..checkpoints.hf import read_json
from ..checkpoints.validate import Pair
from ..errors import InputError
from .options import LlmApiOptions
from .profiles import Profile
from .trtllm_versions import QUANT_KEEPS_DRAFTER_LOADABLE, QUANTIZED_DRAFTER_REASON

TOKENIZER_FILE = "tokenizer.json"
BLACKWELL = 100
# Formats -> (minimum SM, why). `keep` and `none` (bf16) run anywhere TensorRT-LLM runs gpt-oss.
QUANT_MIN_SM = {
    "fp8": (89, "FP8 GEMMs need Ada/Hopper or newer (SM89+)"),
    "mxfp4": (90, "TensorRT-LLM runs gpt-oss MXFP4 experts on Hopper (W4A16_MXFP4) and Blackwell "
                  "(W4A8_MXFP4_MXFP8) only"),
    "nvfp4": (BLACKWELL, "NVFP4 needs Blackwell FP4 tensor cores (SM100+)"),
}
HOPPER_ALTERNATIVES = "use --quant keep (native MXFP4, run as W4A16_MXFP4), mxfp4, fp8 or none"
# TensorRT-LLM QuantAlgo names that imply Blackwell-only activation formats (OVERRIDE_QUANT_ALGO).
BLACKWELL_ALGOS = ("NVFP4", "MXFP8")


def check_draft_len(max_draft_len: int, pair: Pair, source: str = "--max-draft-len") -> None:
    block = pair.drafter_config.block_size
    if not 1 <= max_draft_len <= block - 1:
        raise InputError(f"expected 1..{block - 1} (the drafter's block_size {block} minus the anchor slot; "
                         f"{pair.drafter_dir / 'config.json'} field 'block_size'), got {max_draft_len}.",
                         field=source)


def check_seq_len(max_seq_len: int, pair: Pair) -> None:
    limit = pair.target_config.get("max_position_embeddings")
    if isinstance(limit, int) and max_seq_len > limit:
        raise InputError(f"max_seq_len {max_seq_len} (the profile's unless given) exceeds the target's "
                         f"max_position_embeddings {limit} ({pair.target_dir / 'config.json'}).",
                         field="--max-seq-len")


def tokenizer_summary(path: Path) -> tuple[int, dict[int, str]]:
    """(vocabulary size incl. added tokens, {id: content} of special tokens) from tokenizer.json."""
    data = read_json(path)
    model = data.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    added = data.get("added_tokens") or []
    if not isinstance(vocab, dict) or not isinstance(added, list):
        raise InputError("expected 'model.vocab' (object) and 'added_tokens' (list).", path=path, field="model.vocab")
    ids = [i for i in vocab.values() if isinstance(i, int)] + [t.get("id", -1) for t in added]
    special = {t["id"]: t.get("content") for t in added if t.get("special")}
    return max(ids, default=-1) + 1, special


def check_tokenizers(pair: Pair) -> None:
    """The drafter shares the target's embeddings and LM head, so a tokenizer shipped with the
    drafter must be the target's; the target's must fit its own vocabulary."""
    target_file, drafter_file = pair.target_dir / TOKENIZER_FILE, pair.drafter_dir / TOKENIZER_FILE
    if not target_file.is_file():
        return
    size, special = tokenizer_summary(target_file)
    vocab = pair.target_config["vocab_size"]
    if size > vocab:
        raise InputError(f"the tokenizer has {size} tokens but {pair.target_dir / 'config.json'} vocab_size is "
                         f"{vocab}.", path=target_file, field="model.vocab")
    if not drafter_file.is_file():
        return
    drafter_size, drafter_special = tokenizer_summary(drafter_file)
    if drafter_size != size:
        raise InputError(f"{drafter_size} tokens, but the target's tokenizer ({target_file}) has {size}.",
                         path=drafter_file, field="model.vocab")
    if drafter_special != special:
        differ = sorted(set(drafter_special.items()) ^ set(special.items()))[:3]
        raise InputError(f"special tokens differ from the target's ({target_file}), e.g. {differ}.",
                         path=drafter_file, field="added_tokens")


def check_quant(recipe: str, profile: Profile, option: str) -> None:
    """Refuse a weight format the profile's GPU cannot run (no SM = reference runtime: anything goes)."""
    sm = profile.sm
    if sm is None or recipe not in QUANT_MIN_SM:
        return
    minimum, why = QUANT_MIN_SM[recipe]
    if sm < minimum:
        alternatives = HOPPER_ALTERNATIVES if sm >= 90 else "use --quant keep or none"
        raise InputError(f"{recipe!r} cannot run on the profile's {profile.gpu} (SM{sm}): {why}; {alternatives}.",
                         field=option)


def check_drafter_quant(recipe: str, profile: Profile) -> None:
    """A GPU profile is for TensorRT-LLM, which cannot load a quantized DFlash drafter."""
    if recipe in QUANT_KEEPS_DRAFTER_LOADABLE or not profile.targets_trtllm:
        return
    raise InputError(f"{recipe!r} cannot be used with the profile {profile.name} ({profile.gpu}), which targets "
                     f"TensorRT-LLM. {QUANTIZED_DRAFTER_REASON} Use --drafter-quant keep or none here, or build "
                     "with --profile cpu-reference to measure a quantized drafter on the reference runtime (that "
                     "engine is labelled reference-only).", field="--drafter-quant")


def check_schedule_device(measured_on: dict[str, str] | None, profile: Profile, path: Path | None,
                          allow_foreign: bool) -> None:
    """A draft_len_schedule holds for the device class it was measured on: a CPU bench says nothing
    about a B200 engine's batch costs."""
    if allow_foreign:
        return
    expected = f"a {profile.gpu} GPU" if profile.targets_trtllm else "a CPU"
    if not measured_on:
        raise InputError("does not say where it was measured (fields 'machine' and 'device', written by "
                         f"dflash-bench); the profile {profile.name} needs a schedule measured on {expected}. Pass "
                         "--allow-foreign-schedule to use it anyway.", path=path, field="--schedule-from")
    machine, device = measured_on.get("machine", "?"), measured_on.get("device", "?")
    if not profile.runs_on(machine, device):
        raise InputError(f"was measured on {machine} ({device}), but the profile {profile.name} runs on {expected}: "
                         "the batch sizes where speculation pays off differ between devices. Measure on the "
                         "profile's GPU, or pass --allow-foreign-schedule to use it anyway.", path=path,
                         field="--schedule-from")


def check_profile_hardware(options: LlmApiOptions, profile: Profile, path: str) -> None:
    """Options the profile's GPU generation cannot run (from TensorRT-LLM's gpt-oss support matrix)."""
    sm = profile.sm
    if sm is None:
        return
    moe = options.moe_config.backend if options.moe_config else "AUTO"
    if sm < BLACKWELL and moe == "TRTLLM":
        raise InputError(f"the TRTLLM MoE backend has no {profile.gpu} (SM{sm}) path for gpt-oss; use TRITON or "
                         "CUTLASS.", path=path, field="llm_api_options.moe_config.backend")
    spec = options.speculative_config
    if spec is not None and spec.attention_backend == "TRTLLM" and sm not in (100, 103):
        raise InputError(f"DFlash's TRTLLM draft attention needs SM100 or SM103, not {profile.gpu} (SM{sm}); use "
                         "VANILLA.", path=path, field="speculative.attention_backend")
    if options.kv_cache_config.dtype == "fp8" and sm < 89:
        raise InputError(f"an fp8 KV cache needs SM89+, not SM{sm}.", field="--kv-cache-dtype")
    algo = (options.env_overrides or {}).get("OVERRIDE_QUANT_ALGO", "")
    if sm < BLACKWELL and any(name in algo for name in BLACKWELL_ALGOS):
        raise InputError(f"{algo} uses NVFP4/MXFP8 activations, which need Blackwell (SM100+), not {profile.gpu} "
                         f"(SM{sm}); {HOPPER_ALTERNATIVES}.", path=path,
                         field="llm_api_options.env_overrides.OVERRIDE_QUANT_ALGO")


def check_parallel(options: LlmApiOptions, pair: Pair) -> None:
    """TP must split attention heads (unless attention is data-parallel) and EP the experts;
    TensorRT-LLM's Mapping requires moe_tp_size x moe_ep_size = tp_size."""
    tp = options.tensor_parallel_size
    ep = options.moe_expert_parallel_size or 1
    if tp % ep:
        raise InputError(f"EP {ep} must divide TP {tp} (TensorRT-LLM splits MoE as moe_tp x moe_ep = tp).",
                         field="--ep")
    target_path = pair.target_dir / "config.json"
    experts = pair.target_config.get("num_local_experts")
    if isinstance(experts, int) and experts % ep:
        raise InputError(f"EP {ep} does not divide the {experts} experts of {target_path} "
                         "(field 'num_local_experts').", field="--ep")
    if options.enable_attention_dp:
        return
    drafter = pair.drafter_config
    heads = [(key, pair.target_config.get(key), target_path) for key in ("num_attention_heads", "num_key_value_heads")]
    heads += [("num_attention_heads", drafter.num_attention_heads, pair.drafter_dir / "config.json"),
              ("num_key_value_heads", drafter.num_key_value_heads, pair.drafter_dir / "config.json")]
    for key, count, path in heads:
        if isinstance(count, int) and count % tp:
            raise InputError(f"TP {tp} does not divide {key}={count} of {path}.", field="--tp")
