"""The request interface: the tensors of Triton's TensorRT-LLM llmapi model, plus ours.

Every input of the upstream model is accepted under its name, dtype and dims, and each is either
honoured or refused with an error naming it (never silently ignored). Upstream, read for this:
  NVIDIA/TensorRT-LLM triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt
    @ 0a71057313ec0626527e164a8fc0205c5822e2f5, 1/helpers.py @ 0df60f9ad779c4dc4f55da07e08b969fc4684e56,
    1/model.py @ 044a90d209e380c95e23e8ae42f3583fa05ada78;
  triton-inference-server/tensorrtllm_backend all_models/llmapi/tensorrt_llm/config.pbtxt
    @ c1e19638304d287f554f738c1411746555ed348c (the last copy there: `sampling_param_beam_width`).
Ours on top: `input_ids` (token ids instead of text) in; `output_ids` and `acceptance_length` out.
Differences, by choice: `text_input` is optional (when `input_ids` is given); streaming responses
carry the new text (a delta, as `generate_stream` clients concatenate) rather than the running text;
`sampling_param_exclude_input_from_output` defaults to true (the prompt is not echoed).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from ..runtime.sampling import SamplingParams


@dataclass(frozen=True)
class TensorSpec:
    name: str
    data_type: str  # Triton TYPE_* name
    dims: tuple[int, ...]
    optional: bool = True


def spec(name: str, data_type: str, dims: tuple[int, ...] = (1,)) -> TensorSpec:
    return TensorSpec(name, data_type, dims)


INPUTS = (
    spec("text_input", "TYPE_STRING", (-1,)),
    spec("input_ids", "TYPE_INT32", (-1,)),
    spec("image_url", "TYPE_STRING", (-1,)),
    spec("streaming", "TYPE_BOOL"),
    spec("sampling_param_best_of", "TYPE_INT32"),
    spec("sampling_param_beam_width", "TYPE_INT32"),
    spec("sampling_param_temperature", "TYPE_FP32"),
    spec("sampling_param_top_k", "TYPE_INT32"),
    spec("sampling_param_top_p", "TYPE_FP32"),
    spec("sampling_param_frequency_penalty", "TYPE_FP32"),
    spec("sampling_param_presence_penalty", "TYPE_FP32"),
    spec("sampling_param_max_tokens", "TYPE_INT32"),
    spec("sampling_param_stop", "TYPE_STRING", (-1,)),
    spec("sampling_param_seed", "TYPE_UINT64"),
    spec("sampling_param_exclude_input_from_output", "TYPE_BOOL"),
    spec("sampling_param_return_perf_metrics", "TYPE_BOOL"),
    spec("sampling_param_logits_post_processor_name", "TYPE_STRING"),
    spec("return_finish_reason", "TYPE_BOOL"),
    spec("return_stop_reason", "TYPE_BOOL"),
    spec("return_cumulative_logprob", "TYPE_BOOL"),
    spec("stop", "TYPE_BOOL"),
    spec("lora_id", "TYPE_UINT64"),
    spec("lora_name", "TYPE_STRING"),
    spec("lora_path", "TYPE_STRING"),
    spec("lora_ckpt_source", "TYPE_STRING"),
)
# Upstream's cumulative_logprob and kv_cache_* outputs are not declared: this runtime computes no
# log-probabilities and has no paged KV cache, so a client asking for them by name gets Triton's error.
OUTPUTS = (
    spec("text_output", "TYPE_STRING", (-1,)),
    spec("output_ids", "TYPE_INT32", (-1,)),
    spec("finish_reason", "TYPE_STRING", (-1,)),
    spec("stop_reason", "TYPE_STRING", (-1,)),
    spec("arrival_time_ns", "TYPE_INT64"),
    spec("first_scheduled_time_ns", "TYPE_INT64"),
    spec("first_token_time_ns", "TYPE_INT64"),
    spec("last_token_time_ns", "TYPE_INT64"),
    spec("acceptance_rate", "TYPE_FP32"),
    spec("acceptance_length", "TYPE_FP32"),
    spec("total_accepted_draft_tokens", "TYPE_INT32"),
    spec("total_draft_tokens", "TYPE_INT32"),
)
INPUT_NAMES = tuple(t.name for t in INPUTS)
DEFAULT_MAX_TOKENS = 256

# Inputs we cannot honour: (name, the value that means "not used", why not).
REFUSED = (
    ("image_url", None, "this engine serves a text-only model"),
    ("sampling_param_best_of", 1, "one sequence is generated per request"),
    ("sampling_param_beam_width", 1, "beam search is not supported; one sequence is generated per request"),
    ("sampling_param_frequency_penalty", 0.0, "penalties are not implemented by this runtime"),
    ("sampling_param_presence_penalty", 0.0, "penalties are not implemented by this runtime"),
    ("sampling_param_logits_post_processor_name", "", "logits post-processors are not supported"),
    ("return_cumulative_logprob", False, "this runtime computes no log-probabilities"),
    ("lora_id", None, "a DFlash engine has no LoRA adapters"),
    ("lora_name", None, "a DFlash engine has no LoRA adapters"),
    ("lora_path", None, "a DFlash engine has no LoRA adapters"),
    ("lora_ckpt_source", None, "a DFlash engine has no LoRA adapters"),
)
KINDS = {"TYPE_STRING": str, "TYPE_BOOL": bool, "TYPE_FP32": float, "TYPE_INT32": int, "TYPE_UINT64": int}
INPUT_KINDS = {t.name: KINDS[t.data_type] for t in INPUTS if t.dims == (1,)}


def scalar(inputs: Mapping[str, np.ndarray], name: str, kind: type, default):
    """The single value of an optional input as `kind` (UTF-8 text for str); anything else is an
    InputError naming the tensor, so one malformed request never takes the model down."""
    value = inputs.get(name)
    if value is None or value.size == 0:
        return default
    if value.size != 1:
        raise InputError(f"expected one value, got {value.size}.", field=name)
    return item_as(value.reshape(-1)[0], name, kind)


def item_as(item, name: str, kind: type):
    try:
        if isinstance(item, bytes) != (kind is str):
            raise TypeError
        return item.decode("utf-8") if kind is str else kind(item)
    except (UnicodeDecodeError, ValueError, OverflowError, TypeError):
        expected = {str: "UTF-8 text", int: "an integer", float: "a number", bool: "a boolean"}[kind]
        raise InputError(f"expected {expected}, got {item!r}.", field=name) from None


def strings(inputs: Mapping[str, np.ndarray], name: str) -> list[str]:
    value = inputs.get(name)
    return [] if value is None else [item_as(item, name, str) for item in value.reshape(-1)]


@dataclass(frozen=True)
class RequestSpec:
    """One request, parsed and checked: what to generate and what to return."""

    prompt_text: str | None
    prompt_ids: list[int] | None
    params: SamplingParams
    streaming: bool = False
    stop_strings: tuple[str, ...] = ()
    exclude_input: bool = True
    perf_metrics: bool = False
    stop_reason: bool = False
    stop_request: bool = False  # upstream's `stop`: cancel the requests sharing this request's id


def refuse_unsupported(inputs: Mapping[str, np.ndarray]) -> None:
    for name, unused, why in REFUSED:
        if name not in inputs or inputs[name].size == 0:
            continue
        if unused is not None and scalar(inputs, name, INPUT_KINDS[name], unused) == unused:
            continue
        raise InputError(f"cannot be honoured: {why}.", field=name)


def refuse_parameters(parameters: Mapping[str, object]) -> None:
    """Triton passes JSON fields that are not inputs (HTTP generate) as request parameters; this
    model reads none, so each is an error rather than silently ignored."""
    if parameters:
        name = sorted(parameters)[0]
        raise InputError(f"is not an input of this model (inputs: {', '.join(INPUT_NAMES)}).", field=name)


def prompt_of(inputs: Mapping[str, np.ndarray]) -> tuple[str | None, list[int] | None]:
    ids = inputs.get("input_ids")
    if ids is not None and ids.size:
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise InputError(f"expected a 1-D array of integer token ids, got {ids.dtype} {ids.shape}.",
                             field="input_ids")
        return None, [int(t) for t in ids]
    texts = strings(inputs, "text_input")
    if not texts:
        raise InputError("give 'text_input' (or 'input_ids').", field="text_input")
    if len(texts) > 1:
        raise InputError(f"one prompt per request, got {len(texts)}.", field="text_input")
    return texts[0], None


def parse_request(inputs: Mapping[str, np.ndarray]) -> RequestSpec:
    """Inputs (name -> numpy array) -> RequestSpec; any input we cannot honour is an InputError."""
    if scalar(inputs, "stop", bool, False):
        return RequestSpec(None, None, SamplingParams(), stop_request=True)
    refuse_unsupported(inputs)
    text, ids = prompt_of(inputs)
    values = {name: scalar(inputs, f"sampling_param_{name}", kind, default) for name, kind, default in
              (("max_tokens", int, DEFAULT_MAX_TOKENS), ("temperature", float, 0.0), ("top_p", float, 1.0),
               ("top_k", int, 0), ("seed", int, 0))}
    try:
        params = SamplingParams(**values)
    except InputError as exc:
        raise InputError(str(exc).split(": ", 1)[1], field=f"sampling_param_{exc.field}") from None
    stops = tuple(strings(inputs, "sampling_param_stop"))
    if any(not s for s in stops):
        raise InputError("stop strings must not be empty.", field="sampling_param_stop")
    return RequestSpec(
        text, ids, params,
        streaming=scalar(inputs, "streaming", bool, False),
        stop_strings=stops,
        exclude_input=scalar(inputs, "sampling_param_exclude_input_from_output", bool, True),
        perf_metrics=scalar(inputs, "sampling_param_return_perf_metrics", bool, False),
        stop_reason=scalar(inputs, "return_stop_reason", bool, False),
    )
