"""What the Triton model does with one request, without Triton: the thin request adapter.

`model.py` only turns Triton tensors into a dict of numpy arrays and `emit` calls into Triton
responses; everything else (parsing, defaults, streaming deltas, acceptance statistics) is here
and unit-tested without a server. The tensor names follow Triton's LLM-API model
(`triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt`): `text_input`, `streaming`,
`sampling_param_*` in; `text_output` and the speculative-decoding statistics out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..checkpoints.gpt_oss import read_target_config, stop_token_ids
from ..errors import InputError
from ..runtime.interface import Runtime
from ..runtime.sampling import SamplingParams
from ..runtime.stats import RequestStats


@dataclass(frozen=True)
class TensorSpec:
    name: str
    data_type: str  # Triton TYPE_* name
    dims: tuple[int, ...]
    optional: bool = True


INPUTS = (
    TensorSpec("text_input", "TYPE_STRING", (1,)),
    TensorSpec("input_ids", "TYPE_INT32", (-1,)),
    TensorSpec("streaming", "TYPE_BOOL", (1,)),
    TensorSpec("sampling_param_max_tokens", "TYPE_INT32", (1,)),
    TensorSpec("sampling_param_temperature", "TYPE_FP32", (1,)),
    TensorSpec("sampling_param_top_p", "TYPE_FP32", (1,)),
    TensorSpec("sampling_param_top_k", "TYPE_INT32", (1,)),
    TensorSpec("sampling_param_seed", "TYPE_UINT64", (1,)),
)
OUTPUTS = (
    TensorSpec("text_output", "TYPE_STRING", (1,)),
    TensorSpec("output_ids", "TYPE_INT32", (-1,)),
    TensorSpec("finish_reason", "TYPE_STRING", (1,)),
    TensorSpec("acceptance_rate", "TYPE_FP32", (1,)),
    TensorSpec("acceptance_length", "TYPE_FP32", (1,)),
    TensorSpec("total_accepted_draft_tokens", "TYPE_INT32", (1,)),
    TensorSpec("total_draft_tokens", "TYPE_INT32", (1,)),
)
INPUT_NAMES = tuple(t.name for t in INPUTS)
DEFAULT_MAX_TOKENS = 256

Outputs = dict[str, np.ndarray]
Emit = Callable[[Outputs, bool], None]  # (output tensors, final)


def scalar(inputs: Mapping[str, np.ndarray], name: str, kind: type, default):
    """The single value of an optional input as `kind` (UTF-8 text for str); anything else is an
    InputError naming the tensor, so one malformed request never takes the model down."""
    value = inputs.get(name)
    if value is None or value.size == 0:
        return default
    if value.size != 1:
        raise InputError(f"expected one value, got {value.size}.", field=name)
    item = value.reshape(-1)[0]
    try:
        if isinstance(item, bytes) != (kind is str):
            raise TypeError
        return item.decode("utf-8") if kind is str else kind(item)
    except (UnicodeDecodeError, ValueError, OverflowError, TypeError):
        expected = {str: "UTF-8 text", int: "an integer", float: "a number", bool: "a boolean"}[kind]
        raise InputError(f"expected {expected}, got {item!r}.", field=name) from None


def acceptance(stats: RequestStats) -> tuple[int, int]:
    """(accepted drafts, drafted tokens) over a request's verify steps."""
    accepted = sum(a * n for a, n in enumerate(stats.accepted_histogram))
    return accepted, stats.steps * (stats.block_size - 1)


class DFlashService:
    """Runs requests on any `Runtime`; text needs the engine's tokenizer, token ids never do."""

    def __init__(self, runtime: Runtime, tokenizer, stop_ids: tuple[int, ...]):
        self.runtime, self.tokenizer, self.stop_ids = runtime, tokenizer, stop_ids

    @classmethod
    def from_engine(cls, engine_dir: str | Path, backend: str = "auto",
                    verify_checksums: bool = False) -> "DFlashService":
        from ..cli.common import resolve_device, resolve_dtype
        from ..engine.load import engine_runtime
        from ..engine.manifest import open_engine

        engine = open_engine(engine_dir, verify_checksums)
        device = resolve_device("auto")
        runtime, _ = engine_runtime(engine, backend, device, resolve_dtype("auto", device))
        tokenizer = None
        if (engine.target_dir / "tokenizer.json").is_file():
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(engine.target_dir)
        stops = stop_token_ids(engine.target_dir, read_target_config(engine.target_dir))
        return cls(runtime, tokenizer, tuple(stops))

    def prompt_ids(self, inputs: Mapping[str, np.ndarray]) -> list[int]:
        ids = inputs.get("input_ids")
        if ids is not None and ids.size:
            if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
                raise InputError(f"expected a 1-D array of integer token ids, got {ids.dtype} {ids.shape}.",
                                 field="input_ids")
            return [int(t) for t in ids]
        text = scalar(inputs, "text_input", str, None)
        if text is None:
            raise InputError("give 'text_input' or 'input_ids'.", field="text_input")
        if self.tokenizer is None:
            raise InputError("the engine's target has no tokenizer.json; send 'input_ids' instead.",
                             field="text_input")
        return self.tokenizer.encode(text)

    def params(self, inputs: Mapping[str, np.ndarray]) -> SamplingParams:
        return SamplingParams(
            max_tokens=scalar(inputs, "sampling_param_max_tokens", int, DEFAULT_MAX_TOKENS),
            temperature=scalar(inputs, "sampling_param_temperature", float, 0.0),
            top_p=scalar(inputs, "sampling_param_top_p", float, 1.0),
            top_k=scalar(inputs, "sampling_param_top_k", int, 0),
            seed=scalar(inputs, "sampling_param_seed", int, 0),
            stop_token_ids=self.stop_ids,
        )

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def handle(self, inputs: Mapping[str, np.ndarray], emit: Emit) -> None:
        """Generate for one request. Streaming emits each committed group of tokens (text delta and
        ids) as it is verified, then a final response with the statistics; otherwise one response."""
        prompt, params = self.prompt_ids(inputs), self.params(inputs)
        streaming = scalar(inputs, "streaming", bool, False)
        emitted: list[int] = []
        sent_text = ""

        def on_tokens(_request: int, tokens: list[int]) -> None:
            nonlocal sent_text
            emitted.extend(tokens)
            full = self.text(emitted)
            emit({"text_output": np.array([full[len(sent_text):].encode()], dtype=object),
                  "output_ids": np.array(tokens, dtype=np.int32)}, False)
            sent_text = full

        [result] = self.runtime.generate([prompt], params, 1, on_tokens if streaming else None)
        accepted, drafted = acceptance(result.stats)
        final: Outputs = {
            "finish_reason": np.array([result.finish_reason.encode()], dtype=object),
            "acceptance_rate": np.array([accepted / drafted if drafted else 0.0], dtype=np.float32),
            "acceptance_length": np.array([result.stats.acceptance_length], dtype=np.float32),
            "total_accepted_draft_tokens": np.array([accepted], dtype=np.int32),
            "total_draft_tokens": np.array([drafted], dtype=np.int32),
        }
        if not streaming:
            final["text_output"] = np.array([self.text(result.output_token_ids).encode()], dtype=object)
            final["output_ids"] = np.array(result.output_token_ids, dtype=np.int32)
        emit(final, True)
