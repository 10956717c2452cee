"""The TensorRT-LLM LLM-API options an engine carries, as one typed model.

`llm_api_options.yaml` is what `trtllm-serve --extra_llm_api_options` and `LLM(**options)` read.
TensorRT-LLM validates it with strict pydantic models (`tensorrt_llm/llmapi/llm_args.py`); we mirror
the subset we write, one class per concept, with `extra="forbid"`, so a misspelt or stale key fails
here at build time instead of at server start on a GPU host.

Field names follow `llm_args.py` of the TensorRT-LLM versions in `trtllm_versions.CHECKED_RANGE`
(DFlash is PyTorch-backend only and absent before 1.3.0rc); what each version supports is in
`trtllm_versions.SUPPORT`, and the build records the range an engine needs. PR #12905 renamed the
acceptance auto-disable pair; the source read uses `acceptance_rate_window_size` /
`acceptance_rate_threshold` (a rate in [0, 1]), so the other spelling is refused with a message
naming these. `attention_backend: FA4` is accepted because 1.3.0rc27 and 1.4.0rc1 document it;
newer sources dropped it, so an engine using it records that upper bound.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (AliasChoices, BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, ValidationError,
                      field_validator, model_validator)

from ..errors import InputError
from .trtllm_versions import CHECKED_RANGE

# Old spelling -> current spelling (llm_args.py DecodingBaseConfig, see module docstring).
RENAMED_SPEC_FIELDS = {
    "acceptance_window": "acceptance_rate_window_size",
    "acceptance_length_threshold": "acceptance_rate_threshold",
}

DraftAttentionBackend = Literal["VANILLA", "TRTLLM", "FA4"]  # FA4: trtllm_versions.SUPPORT["dflash_attention_fa4"]
MoeBackend = Literal["AUTO", "CUTLASS", "CUTEDSL", "TRTLLM", "DEEPGEMM", "DENSEGEMM", "VANILLA", "TRITON",
                     "MARLIN", "MEGAMOE_DEEPGEMM", "MEGAMOE_CUTEDSL"]


class Strict(BaseModel):
    """Unknown keys are errors, as in TensorRT-LLM's StrictBaseModel."""

    model_config = ConfigDict(extra="forbid")


class KvCacheConfig(Strict):
    enable_block_reuse: bool | None = None
    free_gpu_memory_fraction: float | None = Field(default=None, ge=0, le=1)
    dtype: Literal["auto", "fp8"] = "auto"
    max_tokens: PositiveInt | None = None


class CudaGraphConfig(Strict):
    enable_padding: bool = False
    max_batch_size: NonNegativeInt | None = None
    batch_sizes: list[PositiveInt] | None = None

    @model_validator(mode="after")
    def _max_matches_sizes(self) -> "CudaGraphConfig":
        """TensorRT-LLM rejects a max_batch_size that differs from max(batch_sizes)."""
        if self.batch_sizes and self.max_batch_size and self.max_batch_size != max(self.batch_sizes):
            raise ValueError(f"max_batch_size {self.max_batch_size} must equal max(batch_sizes) "
                             f"{max(self.batch_sizes)}")
        return self

    @property
    def largest_batch(self) -> int | None:
        return max(self.batch_sizes) if self.batch_sizes else self.max_batch_size


class MoeConfig(Strict):
    backend: MoeBackend = "AUTO"
    max_num_tokens: PositiveInt | None = None


class AttentionDpConfig(Strict):
    enable_balance: bool = False
    timeout_iters: NonNegativeInt | None = None
    batching_wait_iters: NonNegativeInt | None = None


class DFlashDecodingConfig(Strict):
    """`speculative_config` for DFlash (llm_args.py `DFlashDecodingConfig` + `DecodingBaseConfig`)."""

    decoding_type: Literal["DFlash"] = "DFlash"
    max_draft_len: PositiveInt
    speculative_model: str = Field(validation_alias=AliasChoices("speculative_model", "speculative_model_dir"))
    mask_token_id: NonNegativeInt | None = None
    target_layer_ids: list[NonNegativeInt] | None = None
    attention_backend: DraftAttentionBackend | None = None
    max_concurrency: PositiveInt | None = None
    draft_len_schedule: dict[int, int] | None = None
    acceptance_rate_window_size: NonNegativeInt | None = None
    acceptance_rate_threshold: float | None = Field(default=None, ge=0, le=1)
    use_rejection_sampling: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_renamed(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for old, new in RENAMED_SPEC_FIELDS.items():
                if old in data:
                    raise ValueError(f"'{old}' was renamed to '{new}' in TensorRT-LLM {CHECKED_RANGE} "
                                     f"(PR #12905); use '{new}'")
        return data

    @field_validator("draft_len_schedule")
    @classmethod
    def _schedule(cls, schedule: dict[int, int] | None, info) -> dict[int, int] | None:
        """TensorRT-LLM's rules: batch thresholds >= 1, lengths in [0, max_draft_len], the smallest
        threshold maps to max_draft_len; sorted by threshold (0 drafts above the largest)."""
        if schedule is None:
            return None
        if not schedule:
            raise ValueError("must not be empty (omit it instead)")
        max_draft_len = info.data.get("max_draft_len")
        for batch, length in schedule.items():
            if batch < 1:
                raise ValueError(f"batch-size threshold must be >= 1, got {batch}")
            if not 0 <= length <= (max_draft_len if max_draft_len is not None else length):
                raise ValueError(f"draft length for batch {batch} must be in [0, max_draft_len={max_draft_len}], "
                                 f"got {length}")
        smallest = min(schedule)
        if max_draft_len is not None and schedule[smallest] != max_draft_len:
            raise ValueError(f"the smallest threshold {smallest} must map to max_draft_len={max_draft_len}, "
                             f"got {schedule[smallest]}")
        return dict(sorted(schedule.items()))

    @model_validator(mode="after")
    def _exclusive(self) -> "DFlashDecodingConfig":
        if self.max_concurrency is not None and self.draft_len_schedule is not None:
            raise ValueError("max_concurrency and draft_len_schedule are mutually exclusive")
        return self


class LlmApiOptions(Strict):
    """Top-level `LLM(...)` keyword arguments (TensorRT-LLM `TorchLlmArgs`) that engines use."""

    backend: Literal["pytorch"] | None = None
    max_seq_len: PositiveInt
    max_batch_size: PositiveInt | None = None
    max_num_tokens: PositiveInt | None = None
    tensor_parallel_size: PositiveInt = 1
    moe_expert_parallel_size: PositiveInt | None = None
    enable_attention_dp: bool | None = None
    attention_dp_config: AttentionDpConfig | None = None
    kv_cache_config: KvCacheConfig = Field(default_factory=KvCacheConfig)
    cuda_graph_config: CudaGraphConfig | None = None
    moe_config: MoeConfig | None = None
    speculative_config: DFlashDecodingConfig | None = None
    enable_chunked_prefill: bool | None = None
    stream_interval: PositiveInt | None = None
    num_postprocess_workers: NonNegativeInt | None = None
    print_iter_log: bool | None = None
    env_overrides: dict[str, str] | None = None

    @field_validator("env_overrides", mode="before")
    @classmethod
    def _env_as_strings(cls, env: Any) -> Any:
        """NVIDIA's YAMLs write `TRTLLM_ENABLE_PDL: 1`; environment values are strings."""
        if isinstance(env, dict):
            return {k: v if isinstance(v, str) else str(int(v) if isinstance(v, bool) else v) for k, v in env.items()}
        return env

    @model_validator(mode="after")
    def _consistent(self) -> "LlmApiOptions":
        graphs = self.cuda_graph_config
        if graphs is not None and self.max_batch_size and (graphs.largest_batch or 0) > self.max_batch_size:
            raise ValueError(f"cuda_graph_config batch size {graphs.largest_batch} exceeds max_batch_size "
                             f"{self.max_batch_size}")
        if self.attention_dp_config is not None and not self.enable_attention_dp:
            raise ValueError("attention_dp_config is set but enable_attention_dp is not true")
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: Any, path: str | Path | None = None, prefix: str = "") -> "LlmApiOptions":
        return validated(cls, data, path, prefix)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "LlmApiOptions":
        return cls.from_dict(read_yaml(Path(path)), path)


def read_yaml(path: Path) -> Any:
    if not path.is_file():
        raise InputError("file not found; expected a YAML file here.", path=path)
    try:
        return yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise InputError(f"not valid YAML ({exc}).", path=path) from None


def validated(model: type[BaseModel], data: Any, path: str | Path | None, prefix: str = "") -> Any:
    """`model.model_validate(data)` with the first problem as an InputError naming file and field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(part) for part in (prefix, *error["loc"]) if part != "")
        hint = " (unknown key; see trtllm_dflash/engine/options.py for the accepted ones)" \
            if error["type"] == "extra_forbidden" else ""
        raise InputError(f"{error['msg']}{hint}.", path=path, field=field or None) from None
