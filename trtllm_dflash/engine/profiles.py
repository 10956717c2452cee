"""Hardware profiles: TensorRT-LLM options for one GPU type and goal, plus DFlash settings.

A profile is a YAML file (`build_configs/<name>.yaml`, or any path a user passes) with the GPU's
SM version, which the quantization checks need, and a partial `llm_api_options` block that the
build completes with the drafter-derived `speculative_config` and the command-line overrides.
Named profiles are looked up in the repository's `build_configs/` (source tree) and in the
package's `build_configs/` (installed wheel, shipped as package data).
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import PositiveInt

import trtllm_dflash

from ..errors import InputError
from .options import DraftAttentionBackend, LlmApiOptions, Strict, read_yaml, validated

PACKAGE_ROOT = Path(trtllm_dflash.__file__).resolve().parent
PROFILE_DIRS = (PACKAGE_ROOT.parent / "build_configs", PACKAGE_ROOT / "build_configs")


class SpeculativeDefaults(Strict):
    """DFlash settings a profile may fix; the rest comes from the drafter's config."""

    max_draft_len: PositiveInt | None = None  # None: drafter block_size - 1
    attention_backend: DraftAttentionBackend | None = None
    max_concurrency: PositiveInt | None = None
    draft_len_schedule: dict[int, int] | None = None


class Profile(Strict):
    name: str
    description: str
    gpu: str
    sm: int | None  # compute capability x10 (90 = Hopper, 100/103 = Blackwell); None = no GPU
    sources: list[str]
    llm_api_options: LlmApiOptions
    speculative: SpeculativeDefaults = SpeculativeDefaults()

    @property
    def targets_trtllm(self) -> bool:
        """A GPU profile is for TensorRT-LLM; one without an SM (cpu-reference) for the reference runtime."""
        return self.sm is not None

    def runs_on(self, machine: str, device: str) -> bool:
        """Whether a machine (`torch.cuda.get_device_name`, or 'N-core ... CPU' with device 'cpu', as
        dflash-bench records them) is of this profile's device class: its GPU by name, or a CPU."""
        if not self.targets_trtllm:
            return device == "cpu"
        return device != "cpu" and gpu_named(self.gpu, machine)


def gpu_named(gpu: str, machine: str) -> bool:
    """'B200' names 'NVIDIA B200' but not 'NVIDIA GB200' (whole words, case-insensitive)."""
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(gpu)}(?![A-Za-z0-9])", machine, re.IGNORECASE) is not None


def profile_dirs() -> list[Path]:
    return [d for d in PROFILE_DIRS if d.is_dir()]


def available_profiles() -> list[str]:
    return sorted({p.stem for d in profile_dirs() for p in d.glob("*.yaml")})


def profile_path(name_or_file: str | Path) -> Path:
    """A file path as given, else a named profile from the profile directories."""
    candidate = Path(name_or_file)
    if candidate.suffix in (".yaml", ".yml") or candidate.is_file():
        if not candidate.is_file():
            raise InputError("profile file not found.", path=candidate, field="--profile")
        return candidate
    for directory in profile_dirs():
        path = directory / f"{name_or_file}.yaml"
        if path.is_file():
            return path
    raise InputError(f"unknown profile {str(name_or_file)!r}; choose one of {', '.join(available_profiles())} "
                     "or pass a YAML file.", field="--profile")


def load_profile(name_or_file: str | Path) -> Profile:
    path = profile_path(name_or_file)
    return validated(Profile, read_yaml(path), path)


def profile_for_gpu(device_name: str) -> str | None:
    """The first shipped profile (by name: latency before throughput) for a detected GPU, if any."""
    for name in available_profiles():
        profile = load_profile(name)
        if profile.targets_trtllm and gpu_named(profile.gpu, device_name):
            return name
    return None
