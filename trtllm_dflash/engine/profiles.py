"""Hardware profiles: TensorRT-LLM options for one GPU type and goal, plus DFlash settings.

A profile is a YAML file (`build_configs/<name>.yaml`, or any path a user passes) with the GPU's
SM version, which the quantization checks need, and a partial `llm_api_options` block that the
build completes with the drafter-derived `speculative_config` and the command-line overrides.
Named profiles are looked up in the repository's `build_configs/` (source tree) and in the
package's `build_configs/` (installed wheel, shipped as package data).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import PositiveInt

import trtllm_dflash

from ..errors import InputError
from .options import LlmApiOptions, Strict, read_yaml, validated

PACKAGE_ROOT = Path(trtllm_dflash.__file__).resolve().parent
PROFILE_DIRS = (PACKAGE_ROOT.parent / "build_configs", PACKAGE_ROOT / "build_configs")


class SpeculativeDefaults(Strict):
    """DFlash settings a profile may fix; the rest comes from the drafter's config."""

    max_draft_len: PositiveInt | None = None  # None: drafter block_size - 1
    attention_backend: Literal["VANILLA", "TRTLLM"] | None = None
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
