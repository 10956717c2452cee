"""What each TensorRT-LLM version supports, as data, and what an engine therefore needs.

One row per capability an engine can depend on: the first release known to have it (`since`),
the last one known to have it when it was later removed (`until`), and the upstream file, commit or
document the row was read from. A capability whose first release could not be pinned has
`since=None`; an engine that uses it is gated on `NEWEST_CHECKED`, the newest version this table
was checked against (and, where the runtime can probe for it, the probe decides).

Every other module takes its version facts from here: `options.py` (the field names it mirrors),
`runtime/trtllm.py` (what it refuses or warns about), the build (the minimum version it records in
the manifest) and the docs. Sources are in NVIDIA/TensorRT-LLM unless named otherwise; "docs X"
means the published documentation of release X. NOT RUN ON A GPU: no row was checked against an
installed TensorRT-LLM.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import InputError, MissingDependencyError

# DFlash first shipped inside the 1.3.0rc series (PR #12794, April 2026; the exact rc is not pinned
# by any source we read, estimates say rc11-rc13). 1.0, 1.1 and 1.2.x never had it.
FIRST_SERIES_WITH_DFLASH = "1.3.0rc0"
FIRST_DOCUMENTED_WITH_DFLASH = "1.3.0rc27"  # the first release whose documentation lists DFlash
NEWEST_CHECKED = "1.4.0rc1"  # the newest release whose DFlash documentation and source were read
CHECKED_RANGE = f"{FIRST_DOCUMENTED_WITH_DFLASH} .. {NEWEST_CHECKED}"

LLM_ARGS = "tensorrt_llm/llmapi/llm_args.py @ 0004396720054fd8e205cbf616f21f0b57c6b412"
MODELING_DFLASH = "tensorrt_llm/_torch/models/modeling_dflash.py @ 009d8fa431bd3de92245aab80f8b57dc70da1ac4"


@dataclass(frozen=True)
class Support:
    feature: str
    what: str
    since: str | None  # first release with it; None: not pinned (engines using it need NEWEST_CHECKED)
    until: str | None  # last release known to have it; None: still in the newest source read
    source: str

    @property
    def required_since(self) -> str:
        return self.since or NEWEST_CHECKED


SUPPORT: dict[str, Support] = {s.feature: s for s in (
    Support("dflash", "DFlash one-model speculative decoding (DFlashDecodingConfig, PyTorch backend)",
            FIRST_DOCUMENTED_WITH_DFLASH, None,
            f"docs 1.3.0rc27 (first to list DFlash; PR #12794); {LLM_ARGS} class DFlashDecodingConfig"),
    Support("dflash_attention_trtllm", "speculative_config.attention_backend: TRTLLM (SM100/SM103 draft attention)",
            FIRST_DOCUMENTED_WITH_DFLASH, None,
            f"docs 1.3.0rc27; {LLM_ARGS} attention_backend Literal['VANILLA', 'TRTLLM']; {MODELING_DFLASH}"),
    Support("dflash_attention_fa4", "speculative_config.attention_backend: FA4",
            FIRST_DOCUMENTED_WITH_DFLASH, NEWEST_CHECKED,
            f"docs 1.3.0rc27 and 1.4.0rc1 list FA4; gone from {LLM_ARGS} (VANILLA/TRTLLM only) and "
            f"{MODELING_DFLASH} (DFlashForCausalLM raises for any other backend)"),
    Support("draft_len_schedule", "speculative_config.draft_len_schedule (dynamic draft length)", "1.3.0rc8", None,
            f"release notes v1.3.0rc8 (#10860, dynamic draft length on the one-model path); {LLM_ARGS} "
            "DecodingBaseConfig.validate_draft_len_schedule_and_sort"),
    Support("max_concurrency", "speculative_config.max_concurrency (speculation off above a batch size)",
            "1.3.0rc8", None,
            f"{LLM_ARGS} DecodingBaseConfig (translated into draft_len_schedule, which needs #10860, v1.3.0rc8)"),
    Support("acceptance_rate_auto_disable",
            "speculative_config.acceptance_rate_window_size / acceptance_rate_threshold", FIRST_DOCUMENTED_WITH_DFLASH,
            None, f"docs 1.3.0rc27 and 1.4.0rc1; {LLM_ARGS} DecodingBaseConfig (renamed by PR #12905)"),
    Support("rejection_sampling", "speculative_config.use_rejection_sampling", None, None,
            f"PR #15775 (one-model DFLASH); {LLM_ARGS} DecodingBaseConfig; first release not pinned"),
    Support("gpt_oss_nvfp4_experts",
            "NVFP4 gpt-oss experts (GptOssForCausalLM.load_nvfp4_weights, gate/up de-interleaved on the last dim)",
            None, None,
            "PR #8956 'Support nvfp4 for gptoss', merged to main 2026-01-04 as afc533193d, between main's "
            "1.2.0rc7 (2025-12-23) and 1.2.0rc8 (2026-01-08) version bumps, so every 1.3.0rc release should "
            "have it; not read at any release tag (the stored main copies of modeling_gpt_oss.py at 050b6cb "
            "and 7924c7f predate it): not pinned, and probed at load"),
)}

# Runtime probes for capabilities whose first release is not pinned: (module, attribute path).
PROBES = {"gpt_oss_nvfp4_experts": ("tensorrt_llm._torch.models.modeling_gpt_oss",
                                    "GptOssForCausalLM.load_nvfp4_weights")}

# Why TensorRT-LLM cannot load a quantized DFlash drafter (read in MODELING_DFLASH).
QUANTIZED_DRAFTER_REASON = (
    "TensorRT-LLM's DFlash drafter loads unquantized weights only: DFlashForCausalLM.load_weights builds "
    "`fc` as a plain nn.Linear in fc.weight's dtype and copies the raw weight (fc.weight_scale is never read, "
    "and the worker takes its context-buffer dtype from it), and the fused context K/V path slices "
    "self_attn.qkv_proj.weight and applies it with F.linear, without scales "
    f"(NVIDIA/TensorRT-LLM {MODELING_DFLASH}). Keeping fc and attention bf16 and quantizing only the MLP "
    "would further need calibrated static input scales for the drafter and per-module entries under TensorRT-LLM's fused "
    "names (model.layers.N.mlp.gate_up_proj), neither verified here.")
QUANT_KEEPS_DRAFTER_LOADABLE = ("keep", "none")


# --------------------------------------------------------------------------------------------
# Versions


_VERSION_RE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?(?:\.?(a|b|rc|dev)\.?(\d*))?(?:\.?post(\d+))?(?:\+.*)?\s*$")
_PRE_RANK = {"dev": 0, "a": 1, "b": 2, "rc": 3, None: 4}


def parse_version(version: str) -> tuple[int, int, int, int, int, int]:
    """'1.3.0rc11' -> a tuple that sorts like PEP 440 for the forms TensorRT-LLM uses
    (X.Y.Z, X.Y.ZrcN, X.Y.Z.devN, X.Y.ZrcN.postM, optional +local)."""
    match = _VERSION_RE.match(str(version))
    if not match:
        raise InputError(f"cannot read TensorRT-LLM version {version!r} (expected e.g. 1.3.0rc27).",
                         field="tensorrt_llm.__version__")
    major, minor, patch, pre, pre_num, post = match.groups()
    return (int(major), int(minor), int(patch or 0), _PRE_RANK[pre], int(pre_num or 0), int(post or 0))


# --------------------------------------------------------------------------------------------
# What an engine needs


def features_used(options: Any, target_quant: str) -> list[str]:
    """The SUPPORT rows an engine with these LLM-API options (engine/options.py `LlmApiOptions`) and
    this target recipe (`--quant`) depends on."""
    used = ["dflash"]
    spec = options.speculative_config
    if spec is not None:
        used += {"TRTLLM": ["dflash_attention_trtllm"], "FA4": ["dflash_attention_fa4"]}.get(spec.attention_backend, [])
        used += [name for name, value in (("draft_len_schedule", spec.draft_len_schedule),
                                          ("max_concurrency", spec.max_concurrency),
                                          ("acceptance_rate_auto_disable", spec.acceptance_rate_window_size),
                                          ("rejection_sampling", spec.use_rejection_sampling)) if value]
    if target_quant == "nvfp4":
        used.append("gpt_oss_nvfp4_experts")
    return used


def version_range(features: Iterable[str]) -> tuple[str, str | None]:
    """(minimum version, maximum version or None) that has every one of `features`."""
    rows = [SUPPORT[f] for f in features]
    least = max((r.required_since for r in rows), key=parse_version, default=FIRST_DOCUMENTED_WITH_DFLASH)
    most = min((r.until for r in rows if r.until), key=parse_version, default=None)
    return least, most


def requirements(options: Any, target_quant: str, drafter_quant: str) -> dict[str, Any]:
    """The manifest's `trtllm` section: versions, the features that set them, and whether
    TensorRT-LLM can load this engine at all (`reference_only` gives the reason when not)."""
    features = features_used(options, target_quant)
    least, most = version_range(features)
    return {"min_version": least, "max_version": most, "features": features,
            "unpinned": [f for f in features if SUPPORT[f].since is None],
            "reference_only": reference_only_reason(drafter_quant)}


def reference_only_reason(drafter_quant: str) -> str | None:
    """Why TensorRT-LLM cannot load an engine with this `--drafter-quant` (None: it can)."""
    if drafter_quant in QUANT_KEEPS_DRAFTER_LOADABLE:
        return None
    return f"the drafter is quantized (--drafter-quant {drafter_quant}). {QUANTIZED_DRAFTER_REASON}"


def engine_requirements(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The `trtllm` section of a manifest; engines built before it existed get the range they were
    built for, and are reference-only when their drafter was quantized."""
    section = manifest.get("trtllm")
    if isinstance(section, Mapping):
        return dict(section)
    drafter_quant = (manifest.get("options") or {}).get("drafter_quant", "keep")
    return {"min_version": FIRST_DOCUMENTED_WITH_DFLASH, "max_version": None, "features": ["dflash"], "unpinned": [],
            "reference_only": reference_only_reason(drafter_quant)}


def describe(section: Mapping[str, Any]) -> str:
    """One line for dflash-build: what TensorRT-LLM version the engine needs, or why none will do."""
    if section.get("reference_only"):
        return "reference runtime only (TensorRT-LLM cannot load a quantized DFlash drafter)"
    text = f">= {section['min_version']}"
    if section.get("max_version"):
        text += f", <= {section['max_version']}"
    unpinned = section.get("unpinned") or []
    note = f"; {', '.join(unpinned)}: first release not pinned, so the newest checked" if unpinned else ""
    return f"TensorRT-LLM {text} (needs {', '.join(section['features'])}{note})"


def check_installed(version: str, section: Mapping[str, Any]) -> None:
    """Refuse an installed TensorRT-LLM outside the engine's recorded range, naming the features
    that set the bound (exit code 3: the engine is fine, this machine's TensorRT-LLM is not)."""
    installed = parse_version(version)
    features = [f for f in section.get("features") or ["dflash"] if f in SUPPORT]
    least, most = section.get("min_version") or FIRST_DOCUMENTED_WITH_DFLASH, section.get("max_version")
    if installed < parse_version(least):
        needing = [f for f in features if parse_version(SUPPORT[f].required_since) > installed] or features
        unpinned = [f for f in needing if SUPPORT[f].since is None]
        note = (f" ({', '.join(unpinned)}: first release not pinned, so the newest checked version is required)"
                if unpinned else "")
        raise MissingDependencyError(f"TensorRT-LLM >= {least} (found {version})", "this engine",
                                     f"It uses {', '.join(needing)}{note}; see docs/trtllm.md.")
    if most and installed > parse_version(most):
        removed = [f for f in features if SUPPORT[f].until]
        raise MissingDependencyError(f"TensorRT-LLM <= {most} (found {version})", "this engine",
                                     f"It uses {', '.join(removed)}, which newer TensorRT-LLM dropped; rebuild the "
                                     "engine without it (e.g. draft attention VANILLA or TRTLLM).")
