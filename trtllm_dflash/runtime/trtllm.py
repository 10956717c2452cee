"""The TensorRT-LLM runtime: the same `Runtime` interface, served by `tensorrt_llm.LLM` with DFlash.

NOT YET RUN ON A GPU. Every mapping below is a pure function over plain data (dicts, objects with
attributes) so it is unit-tested without TensorRT-LLM; only `TrtllmRuntime` touches the library,
and it imports it lazily.

Names used, as read in NVIDIA/TensorRT-LLM (see docs/trtllm.md for the file list):
  * `tensorrt_llm.LLM(model=..., **TorchLlmArgs fields)`; `LLM.generate_async(inputs,
    sampling_params=..., streaming=True)` returns a `RequestOutput` that is async-iterable;
    `LLM.shutdown()`.
  * `tensorrt_llm.llmapi.llm_args.DFlashDecodingConfig` (pydantic; `decoding_type: "DFlash"`,
    `max_draft_len`, `speculative_model` (alias `speculative_model_dir`), `mask_token_id`,
    `target_layer_ids`, `attention_backend`, ...).
  * `tensorrt_llm.SamplingParams` (dataclass): `max_tokens`, `temperature`, `top_p`, `top_k`,
    `seed`, `stop_token_ids`, `include_stop_str_in_output`, `ignore_eos`, `detokenize`,
    `return_perf_metrics`.
  * `RequestOutput.outputs[0]` (`CompletionOutput`): `token_ids`, `finish_reason`,
    `request_perf_metrics` (`RequestPerfMetrics`: `.speculative_decoding.{acceptance_rate,
    total_accepted_draft_tokens, total_draft_tokens}`, `.timing_metrics.{arrival_time,
    first_scheduled_time, first_token_time, last_token_time}` as timedeltas);
    `RequestOutput.decoding_iter`, `RequestOutput.avg_decoded_tokens_per_iter`.

Statistics: TensorRT-LLM reports per-request totals, not a per-step histogram; `trtllm_stats.py`
turns them into `RequestStats` without inventing what is unknown.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..engine.trtllm_versions import (FIRST_DOCUMENTED_WITH_DFLASH, FIRST_SERIES_WITH_DFLASH, NEWEST_CHECKED, PROBES,
                                      check_installed, engine_requirements, parse_version)
from ..errors import InputError, MissingDependencyError
from .interface import OnTokens, check_request
from .sampling import SamplingParams
from .stats import GenerationResult
from .trtllm_stats import finish_reason_of, request_stats_from_metrics

OPTIONS_FILE = "llm_api_options.yaml"
TARGET_DIR = "target"

INSTALL_HINT = (f"Install TensorRT-LLM >= {FIRST_DOCUMENTED_WITH_DFLASH} on a Linux host with an NVIDIA GPU "
                "(Hopper or Blackwell) from NVIDIA's package index (`pip install tensorrt-llm --extra-index-url https://pypi.nvidia.com`) "
                "or use the NGC container nvcr.io/nvidia/tensorrt-llm/release; the PyPI packages are "
                "download stubs. See docs/trtllm.md.")


# --------------------------------------------------------------------------------------------
# Versions
# --------------------------------------------------------------------------------------------

def check_version(version: str, requirements: Mapping | None = None) -> list[str]:
    """Refuse versions without DFlash or outside the engine's range (its manifest's `trtllm`
    section; without one, what every engine needs); return warnings for the ones we allow. The
    version facts themselves are engine/trtllm_versions.py."""
    if parse_version(version) < parse_version(FIRST_SERIES_WITH_DFLASH):
        raise MissingDependencyError(
            f"TensorRT-LLM with DFlash (1.3.0rc series or newer; found {version})",
            "the trtllm backend",
            "DFlash speculative decoding is not in TensorRT-LLM 1.0-1.2.x. " + INSTALL_HINT)
    check_installed(version, engine_requirements({}) if requirements is None else requirements)
    if parse_version(version) > parse_version(NEWEST_CHECKED):
        return [f"TensorRT-LLM {version} is newer than {NEWEST_CHECKED}, the newest version this toolkit was "
                "checked against; field names may have changed."]
    return []


def engine_manifest(engine_dir: str | Path) -> dict:
    """The engine's manifest.json as a dict ({} without one), read once for every check below."""
    import json

    path = Path(engine_dir) / "manifest.json"
    try:
        manifest = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        raise InputError("not valid JSON; rebuild the engine with dflash-build.", path=path) from None
    return manifest if isinstance(manifest, dict) else {}


def read_requirements(manifest: Mapping, path: Path) -> dict:
    """The engine's TensorRT-LLM requirements (engine/trtllm_versions.py), refusing an engine that
    only the reference runtime can run, before TensorRT-LLM is even imported."""
    requirements = engine_requirements(manifest)
    if requirements.get("reference_only"):
        raise InputError(f"this engine runs on the reference runtime only: {requirements['reference_only']} "
                         "Run it with --backend reference, or rebuild with --drafter-quant keep.", path=path,
                         field="trtllm.reference_only")
    return requirements


def check_probes(features: Sequence[str]) -> None:
    """Capabilities whose first release is not pinned are looked for in the installed TensorRT-LLM."""
    for feature in features:
        if feature not in PROBES:
            continue
        module_name, attributes = PROBES[feature]
        try:
            found = importlib.import_module(module_name)
            for attribute in attributes.split("."):
                found = getattr(found, attribute)
        except (ImportError, AttributeError):
            raise MissingDependencyError(f"TensorRT-LLM with {module_name}.{attributes}", f"this engine ({feature})",
                                         "The installed TensorRT-LLM cannot load NVFP4 gpt-oss experts; install a "
                                         "newer one or rebuild with --quant keep or mxfp4.") from None


def ignored_engine_settings(manifest: Mapping) -> list[str]:
    """Notes for the reference-runtime settings an engine's manifest carries ("runtime" section):
    TensorRT-LLM's DFlash has no suffix-automaton drafting, so `sa_threshold` and `sa_max_drafts` are ignored here."""
    runtime = manifest.get("runtime")
    runtime = runtime if isinstance(runtime, dict) else {}
    return [f"the engine's {name} ({runtime[name]}) is a setting of the reference runtime's dflash-sa drafting; "
            "the trtllm backend runs DFlash without suffix-automaton drafts and ignores it."
            for name in ("sa_threshold", "sa_max_drafts") if runtime.get(name) is not None]


# --------------------------------------------------------------------------------------------
# Engine directory -> LLM(...) keyword arguments
# --------------------------------------------------------------------------------------------

def read_options(engine_dir: str | Path) -> dict:
    """Read `<engine>/llm_api_options.yaml` (the YAML trtllm-serve --extra_llm_api_options takes)."""
    import yaml

    engine_dir = Path(engine_dir)
    if not engine_dir.is_dir():
        raise InputError("engine directory not found.", path=engine_dir)
    path = engine_dir / OPTIONS_FILE
    if not path.is_file():
        raise InputError(f"no {OPTIONS_FILE} in the engine directory (build it with dflash-build).", path=path)
    try:
        options = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise InputError(f"not valid YAML ({exc}).", path=path) from None
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise InputError("the top level must be a mapping of LLM() arguments.", path=path)
    return options


def resolve_speculative_model(engine_dir: str | Path, value: str | os.PathLike) -> str:
    """A drafter path relative to the engine directory becomes absolute; an absolute path stays;
    a Hugging Face id ('org/name', not present locally) stays as it is."""
    engine_dir = Path(engine_dir)
    text = str(value)
    path = Path(text).expanduser()
    if path.is_absolute():
        if not path.exists():
            raise InputError(f"drafter directory {text} does not exist.", path=engine_dir / OPTIONS_FILE,
                             field="speculative_config.speculative_model")
        return str(path)
    candidate = engine_dir / path
    if candidate.exists():
        return str(candidate.resolve())
    looks_like_hub_id = re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", text) is not None and not text.startswith(".")
    if looks_like_hub_id:
        return text
    raise InputError(f"drafter {text!r} is neither under the engine directory nor a Hugging Face id 'org/name'.",
                     path=engine_dir / OPTIONS_FILE, field="speculative_config.speculative_model")


def _merge(base: Mapping, overrides: Mapping) -> dict:
    """Overrides win; nested mappings merge key by key (so {'kv_cache_config': {'dtype': 'fp8'}}
    changes one field, not the whole section)."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def speculative_config_dict(engine_dir: str | Path, options: Mapping) -> dict:
    """The DFlash section of the options, validated, with the drafter path resolved."""
    where = Path(engine_dir) / OPTIONS_FILE
    spec = options.get("speculative_config")
    if not isinstance(spec, Mapping):
        raise InputError("no speculative_config mapping; DFlash needs one.", path=where, field="speculative_config")
    spec = dict(spec)
    if spec.get("decoding_type") != "DFlash":
        raise InputError(f"expected decoding_type: DFlash, got {spec.get('decoding_type')!r}.", path=where,
                         field="speculative_config.decoding_type")
    draft_len = spec.get("max_draft_len")
    if not isinstance(draft_len, int) or isinstance(draft_len, bool) or draft_len < 1:
        raise InputError(f"expected a positive integer, got {draft_len!r}.", path=where,
                         field="speculative_config.max_draft_len")
    if "speculative_model_dir" in spec:  # TensorRT-LLM's alias; keep one spelling
        if "speculative_model" in spec:
            raise InputError("give speculative_model or speculative_model_dir, not both.", path=where,
                             field="speculative_config.speculative_model")
        spec["speculative_model"] = spec.pop("speculative_model_dir")
    if spec.get("speculative_model") is None:
        raise InputError("no drafter given.", path=where, field="speculative_config.speculative_model")
    spec["speculative_model"] = resolve_speculative_model(engine_dir, spec["speculative_model"])
    block_size = drafter_block_size(spec["speculative_model"])
    if block_size is not None and draft_len > block_size - 1:
        raise InputError(f"max_draft_len {draft_len} is more than the drafter's block_size - 1 = {block_size - 1}.",
                         path=where, field="speculative_config.max_draft_len")
    return spec


def drafter_block_size(drafter: str) -> int | None:
    """`block_size` from a local drafter's config.json (None for a hub id or when absent)."""
    import json

    config = Path(drafter) / "config.json"
    if not config.is_file():
        return None
    try:
        value = json.loads(config.read_text()).get("block_size")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) else None


def check_spec_keys(spec: Mapping, known_fields: set[str] | None, where: Path | None = None) -> None:
    """Fail clearly on keys the installed DFlashDecodingConfig does not have (the acceptance
    auto-disable pair was renamed between versions, so a YAML written for one can break another)."""
    if known_fields is None:
        return
    unknown = sorted(set(spec) - set(known_fields) - {"speculative_model_dir"})
    if unknown:
        raise InputError(f"the installed TensorRT-LLM's DFlashDecodingConfig has no field(s) {', '.join(unknown)}; "
                         f"it has: {', '.join(sorted(known_fields))}.", path=where, field="speculative_config")


def llm_kwargs(engine_dir: str | Path, options: Mapping, overrides: Mapping | None = None, *,
               spec_config_cls: Any = None, llm_fields: set[str] | None = None) -> dict:
    """Keyword arguments for `tensorrt_llm.LLM(**kwargs)` from the engine's YAML plus overrides.

    - `model` is `<engine>/target` (an override named `model` wins);
    - `speculative_config` is validated, `speculative_model` resolved against the engine dir, and,
      when `spec_config_cls` (the installed `DFlashDecodingConfig`) is given, turned into that
      object: older LLM API versions do not coerce a dict for this union field, every version
      accepts the object (trtllm-serve's own YAML merge leaves it to the LLM args model);
    - other nested sections (kv_cache_config, cuda_graph_config, moe_config, ...) stay dicts,
      which the pydantic LLM args model validates into its config classes;
    - `return_perf_metrics=True` is added when `llm_fields` says the installed LLM args have it
      (newer versions gate per-request metric collection on it; it is a strict model, so an
      unknown field would be an error), unless the options already set it.
    """
    engine_dir = Path(engine_dir)
    merged = _merge(options, overrides or {})
    merged.setdefault("model", str(engine_dir / TARGET_DIR))
    if "model" not in (overrides or {}) and not (engine_dir / TARGET_DIR).is_dir():
        raise InputError("no target/ checkpoint in the engine directory.", path=engine_dir / TARGET_DIR)
    spec = speculative_config_dict(engine_dir, merged)
    if spec_config_cls is not None:
        known = getattr(spec_config_cls, "model_fields", None)
        check_spec_keys(spec, set(known) if known is not None else None, engine_dir / OPTIONS_FILE)
        merged["speculative_config"] = spec_config_cls(**spec)
    else:
        merged["speculative_config"] = spec
    if llm_fields is not None:
        if "return_perf_metrics" in llm_fields:
            merged.setdefault("return_perf_metrics", True)
        unknown = sorted(set(merged) - set(llm_fields))
        if unknown:
            raise InputError(f"the installed TensorRT-LLM's LLM() takes no argument(s) {', '.join(unknown)}.",
                             path=engine_dir / OPTIONS_FILE)
    return merged


def max_draft_len_of(kwargs: Mapping) -> int:
    spec = kwargs["speculative_config"]
    return int(spec["max_draft_len"] if isinstance(spec, Mapping) else spec.max_draft_len)


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------

def sampling_kwargs(params: SamplingParams) -> dict:
    """Keyword arguments for `tensorrt_llm.SamplingParams` that reproduce our `SamplingParams`.

    - greedy (temperature 0) sends temperature=0 and no top_p/top_k: TensorRT-LLM treats
      temperature == 0 as greedy;
    - top_p 1.0 and top_k 0 mean "off" here and are left unset there (TensorRT-LLM's defaults);
    - stops: our stop tokens are the only stop rule (gpt-oss's end tokens are among them), so
      `ignore_eos=True` keeps TensorRT-LLM's tokenizer `end_id` out of it, and
      `include_stop_str_in_output=True` keeps the stop token in the output as our reference does;
    - `detokenize=False` (we work in token ids); `return_perf_metrics=True` for the per-request
      speculative counters.
    """
    kwargs: dict[str, Any] = {
        "max_tokens": params.max_tokens,
        "seed": params.seed,
        "detokenize": False,
        "return_perf_metrics": True,
        "ignore_eos": True,
        "include_stop_str_in_output": True,
    }
    if params.stop_token_ids:
        kwargs["stop_token_ids"] = [int(t) for t in params.stop_token_ids]
    if params.greedy:
        kwargs["temperature"] = 0.0
    else:
        kwargs["temperature"] = float(params.temperature)
        if params.top_p < 1.0:
            kwargs["top_p"] = float(params.top_p)
        if params.top_k > 0:
            kwargs["top_k"] = int(params.top_k)
    return kwargs


# --------------------------------------------------------------------------------------------
# Streaming
# --------------------------------------------------------------------------------------------

def new_tokens(previous_len: int, output_token_ids: Sequence[int]) -> list[int]:
    """Tokens committed since the last update. `CompletionOutput.token_ids` grows monotonically
    while streaming; if it ever comes back shorter (a final trim), nothing new is reported and the
    final `token_ids` stay authoritative for the result."""
    if len(output_token_ids) <= previous_len:
        return []
    return [int(t) for t in output_token_ids[previous_len:]]


# --------------------------------------------------------------------------------------------
# The runtime (needs tensorrt_llm and a GPU)
# --------------------------------------------------------------------------------------------

def import_tensorrt_llm():
    """`import tensorrt_llm`, or a MissingDependencyError that says how to get it."""
    try:
        return importlib.import_module("tensorrt_llm")
    except ImportError as exc:
        raise MissingDependencyError("tensorrt_llm (TensorRT-LLM)", "the trtllm backend",
                                     f"({exc}) " + INSTALL_HINT) from None


def dflash_config_class(trtllm) -> Any:
    for module in ("tensorrt_llm.llmapi", "tensorrt_llm.llmapi.llm_args"):
        try:
            cls = getattr(importlib.import_module(module), "DFlashDecodingConfig", None)
        except ImportError:
            cls = None
        if cls is not None:
            return cls
    raise MissingDependencyError(
        f"TensorRT-LLM with DFlashDecodingConfig (installed: {getattr(trtllm, '__version__', '?')})",
        "the trtllm backend", INSTALL_HINT)


def llm_arg_fields() -> set[str] | None:
    """Field names of the installed `TorchLlmArgs` (None when it cannot be introspected)."""
    try:
        args_module = importlib.import_module("tensorrt_llm.llmapi.llm_args")
    except ImportError:
        return None
    cls = getattr(args_module, "TorchLlmArgs", None)
    fields = getattr(cls, "model_fields", None)
    if fields is None:
        return None
    names = set(fields)
    for info in fields.values():  # accept declared aliases too
        alias = getattr(info, "alias", None)
        if alias:
            names.add(alias)
    return names


class TrtllmRuntime:
    """`Runtime` on TensorRT-LLM (PyTorch backend, one-model DFlash). Not yet run on a GPU.

    engine_dir: the dflash-build output (`target/`, drafter, `llm_api_options.yaml`).
    overrides: extra or replacing `LLM()` arguments (nested sections merge key by key).
    """

    backend = "trtllm"

    def __init__(self, engine_dir: str | Path, **overrides):
        self.engine_dir = Path(engine_dir)
        manifest = engine_manifest(self.engine_dir)
        requirements = read_requirements(manifest, self.engine_dir / "manifest.json")
        trtllm = import_tensorrt_llm()
        self.version = str(getattr(trtllm, "__version__", "0"))
        self.warnings = check_version(self.version, requirements) + ignored_engine_settings(manifest)
        check_probes(requirements.get("features") or [])
        spec_cls = dflash_config_class(trtllm)
        options = read_options(self.engine_dir)
        self.llm_kwargs = llm_kwargs(self.engine_dir, options, overrides, spec_config_cls=spec_cls,
                                     llm_fields=llm_arg_fields())
        self.block_size = max_draft_len_of(self.llm_kwargs) + 1
        self._trtllm = trtllm
        self.llm = trtllm.LLM(**self.llm_kwargs)

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None and hasattr(llm, "shutdown"):
            llm.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def warm_up(self, prompt: Sequence[int]) -> None:
        """One short untimed request (CUDA graphs and autotuning happen at LLM() construction;
        this covers first-request costs)."""
        self.generate([prompt], SamplingParams(max_tokens=3))

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, batch_size: int = 1,
                 on_tokens: OnTokens | None = None) -> list[GenerationResult]:
        check_request(prompts, batch_size)
        if self.llm is None:
            raise RuntimeError("this TrtllmRuntime was closed.")
        sampling = self._trtllm.SamplingParams(**sampling_kwargs(params))
        return asyncio.run(self._generate_all(prompts, sampling, params.max_tokens, batch_size, on_tokens))

    async def _generate_all(self, prompts, sampling, max_tokens, batch_size, on_tokens) -> list[GenerationResult]:
        # Chunks of batch_size requests in flight together, in input order: the same static
        # batching the reference runtime does, so total_stats' clock rule holds.
        results: list[GenerationResult] = []
        for first in range(0, len(prompts), batch_size):
            chunk = range(first, min(first + batch_size, len(prompts)))
            results.extend(await asyncio.gather(
                *(self._generate_one(i, prompts[i], sampling, max_tokens, on_tokens) for i in chunk)))
        return results

    async def _generate_one(self, index, prompt, sampling, max_tokens, on_tokens) -> GenerationResult:
        start = time.perf_counter()
        first_token_at = None
        seen = 0
        request = self.llm.generate_async({"prompt_token_ids": [int(t) for t in prompt]},
                                          sampling_params=sampling, streaming=True)
        final = request
        async for output in request:
            final = output
            fresh = new_tokens(seen, output.outputs[0].token_ids)
            if fresh:
                if first_token_at is None:
                    first_token_at = time.perf_counter()
                seen += len(fresh)
                if on_tokens is not None:
                    on_tokens(index, fresh)
        end = time.perf_counter()
        completion = final.outputs[0]
        tokens = [int(t) for t in completion.token_ids]
        first_token_at = first_token_at if first_token_at is not None else end
        stats = request_stats_from_metrics(
            getattr(completion, "request_perf_metrics", None), len(tokens), self.block_size,
            decoding_iter=getattr(final, "decoding_iter", None),
            wall_times=(first_token_at - start, end - first_token_at))
        return GenerationResult(list(prompt), tokens, finish_reason_of(completion.finish_reason, len(tokens),
                                                                       max_tokens), stats)
