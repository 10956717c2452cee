"""Facts about the TensorRT-LLM LLM-API fields our engines write, as data, for the conformance test.

Written from reading NVIDIA/TensorRT-LLM tensorrt_llm/llmapi/llm_args.py at commit
0004396720054fd8e205cbf616f21f0b57c6b412 (classes TorchLlmArgs / BaseLlmArgs, KvCacheConfig,
BaseCudaGraphConfig / DecodeCudaGraphConfig, MoeConfig, AttentionDpConfig, DecodingBaseConfig,
DFlashDecodingConfig), the 1.3.0rc27 / 1.4.0rc1 documentation for `attention_backend: FA4`, and
the DFlash worker's block-size rule (tensorrt_llm/_torch/speculative/dflash.py and
shared/reference/trtllm-integration.md section 3). Only the fields we may write are listed; a key
not listed here is a key TensorRT-LLM's strict models would refuse or that we never checked.
Facts, not code: each entry is (kind, constraint).
"""

from __future__ import annotations

ALWAYS = (None, None)  # allowed in every version checked
FA4_RANGE = ("1.3.0rc27", "1.4.0rc1")  # documented there; gone from llm_args.py at 0004396

# kind: "bool" | "int" | "float" | "str" | "int_list" | "str_dict" | "int_int_dict" | "enum" | "section"
# constraint: for int/float (low, high) inclusive bounds (None = open); for enum {value: (since, until)};
# for section the class name.
FIELDS = {
    "TorchLlmArgs": {
        "backend": ("enum", {"pytorch": ALWAYS}),  # TorchLlmArgs.backend: Literal["pytorch"] (deprecated)
        "max_seq_len": ("int", (1, None)),  # Optional[int]
        "max_batch_size": ("int", (1, None)),  # Optional[int] = 2048
        "max_num_tokens": ("int", (1, None)),  # Optional[int] = 8192
        "tensor_parallel_size": ("int", (1, None)),
        "moe_expert_parallel_size": ("int", (1, None)),  # Optional[int]; None -> -1 (auto)
        "enable_attention_dp": ("bool", None),
        "attention_dp_config": ("section", "AttentionDpConfig"),
        "kv_cache_config": ("section", "KvCacheConfig"),
        "cuda_graph_config": ("section", "CudaGraphConfig"),
        "moe_config": ("section", "MoeConfig"),
        "speculative_config": ("section", "DFlashDecodingConfig"),
        "enable_chunked_prefill": ("bool", None),
        "stream_interval": ("int", (1, None)),  # PositiveInt = 1
        "num_postprocess_workers": ("int", (0, None)),
        "print_iter_log": ("bool", None),
        "env_overrides": ("str_dict", None),  # Optional[Dict[str, str]]
    },
    "KvCacheConfig": {
        "enable_block_reuse": ("bool", None),
        "max_tokens": ("int", (1, None)),
        "free_gpu_memory_fraction": ("float", (0.0, 1.0)),  # ge=0, le=1
        # dtype: str; the values its description names ('auto' keeps the checkpoint's KV-cache algo)
        "dtype": ("enum", {"auto": ALWAYS, "fp8": ALWAYS, "fp8_ds_mla": ALWAYS, "nvfp4": ALWAYS}),
    },
    "CudaGraphConfig": {  # DecodeCudaGraphConfig (mode 'decode' is inferred when absent)
        "batch_sizes": ("int_list", (1, None)),
        "max_batch_size": ("int", (0, None)),  # NonNegativeInt = 0
        "enable_padding": ("bool", None),
    },
    "MoeConfig": {
        "backend": ("enum", {name: ALWAYS for name in (
            "AUTO", "CUTLASS", "CUTEDSL", "TRTLLM", "DEEPGEMM", "DENSEGEMM", "VANILLA", "TRITON", "MARLIN",
            "MEGAMOE_DEEPGEMM", "MEGAMOE_CUTEDSL")}),
        "max_num_tokens": ("int", (1, None)),
    },
    "AttentionDpConfig": {
        "enable_balance": ("bool", None),
        "timeout_iters": ("int", (0, None)),  # >= 0 required when enable_balance
        "batching_wait_iters": ("int", (0, None)),
    },
    "DFlashDecodingConfig": {
        "decoding_type": ("enum", {"DFlash": ALWAYS}),
        "max_draft_len": ("int", (0, None)),  # Optional[NonNegativeInt]
        "speculative_model": ("str", None),  # alias speculative_model_dir
        "mask_token_id": ("int", (0, None)),
        "target_layer_ids": ("int_list", (0, None)),
        "attention_backend": ("enum", {"VANILLA": ALWAYS, "TRTLLM": ALWAYS, "FA4": FA4_RANGE}),
        "max_concurrency": ("int", (1, None)),  # Optional[PositiveInt]
        "draft_len_schedule": ("int_int_dict", None),
        "acceptance_rate_window_size": ("int", (0, None)),
        "acceptance_rate_threshold": ("float", (0.0, 1.0)),
        "use_rejection_sampling": ("bool", None),
    },
}
