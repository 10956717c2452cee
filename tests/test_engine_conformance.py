"""Conformance: every key, nested key and enum value our llm_api_options.yaml can contain, for every
shipped profile and every option combination that changes the YAML, is checked against the fact
table of TensorRT-LLM's TorchLlmArgs and config classes (tests/trtllm_llm_args_facts.py, written
from llm_args.py at 0004396), including its cross-field rules, and enum values that only some
versions accept against the version range the engine records (engine/trtllm_versions.py)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Literal, get_args, get_origin

import pytest
import yaml
from trtllm_llm_args_facts import FIELDS

from trtllm_dflash.checkpoints.validate import validate_pair
from trtllm_dflash.engine import options
from trtllm_dflash.engine import trtllm_versions as tv
from trtllm_dflash.engine.plan import BuildOptions, render_options
from trtllm_dflash.engine.profiles import available_profiles, load_profile, profile_path

DRAFT_SETTINGS = [(None, None), (1, None), (3, None), (None, {1: 3, 4: 1}), (None, {2: 2, 16: 1})]
ATTENTION = [None, "VANILLA", "TRTLLM", "FA4"]


def violations(section: str, data: dict, where: str, engine_range: tuple[str, str | None]) -> list[str]:
    """What in `data` (one config class's YAML mapping) the fact table does not allow."""
    found = []
    facts = FIELDS[section]
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in facts:
            found.append(f"{path}: no such field in TensorRT-LLM's {section}")
            continue
        kind, constraint = facts[key]
        if kind == "section":
            if not isinstance(value, dict):
                found.append(f"{path}: expected a mapping")
            else:
                found += violations(constraint, value, path, engine_range)
        elif kind == "enum":
            if value not in constraint:
                found.append(f"{path}: {value!r} not one of {sorted(constraint)}")
            elif not covers(constraint[value], engine_range):
                found.append(f"{path}: {value!r} is accepted only in {constraint[value]}, the engine records "
                             f"{engine_range}")
        elif not conforms(kind, constraint, value):
            found.append(f"{path}: {value!r} is not a valid {kind} {constraint or ''}")
    return found


def conforms(kind: str, bounds, value) -> bool:
    def number_ok(v, types):
        return isinstance(v, types) and not isinstance(v, bool) and (
            bounds is None or ((bounds[0] is None or v >= bounds[0]) and (bounds[1] is None or v <= bounds[1])))

    return {
        "bool": lambda: isinstance(value, bool),
        "int": lambda: number_ok(value, int),
        "float": lambda: number_ok(value, (int, float)),
        "str": lambda: isinstance(value, str) and value != "",
        "int_list": lambda: isinstance(value, list) and bool(value) and all(number_ok(v, int) for v in value),
        "str_dict": lambda: isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                            for k, v in value.items()),
        "int_int_dict": lambda: isinstance(value, dict) and all(type(k) is int and type(v) is int
                                                                for k, v in value.items()),
    }[kind]()


def covers(allowed: tuple[str | None, str | None], engine: tuple[str, str | None]) -> bool:
    """Every version in the engine's range [min, max] is inside the value's range."""
    since, until = allowed
    low, high = engine
    if since is not None and tv.parse_version(low) < tv.parse_version(since):
        return False
    return until is None or (high is not None and tv.parse_version(high) <= tv.parse_version(until))


def cross_field_violations(data: dict, block_size: int) -> list[str]:
    """TensorRT-LLM's rules across fields (DecodingBaseConfig, BaseCudaGraphConfig validators; the
    DFlash worker's block rule)."""
    found = []
    graphs = data.get("cuda_graph_config") or {}
    if graphs.get("batch_sizes") and graphs.get("max_batch_size") and \
            graphs["max_batch_size"] != max(graphs["batch_sizes"]):
        found.append("cuda_graph_config.max_batch_size != max(batch_sizes)")
    spec = data.get("speculative_config") or {}
    draft_len = spec.get("max_draft_len")
    if draft_len is not None and draft_len > block_size - 1:
        found.append(f"max_draft_len {draft_len} > block_size - 1 = {block_size - 1}")
    schedule = spec.get("draft_len_schedule")
    if schedule:
        if min(schedule) < 1 or min(schedule.values()) < 0:
            found.append("draft_len_schedule: thresholds must be >= 1 and lengths >= 0")
        if draft_len is not None and (schedule[min(schedule)] != draft_len or max(schedule.values()) > draft_len):
            found.append("draft_len_schedule: the smallest key must map to max_draft_len and none exceed it")
        if spec.get("max_concurrency") is not None:
            found.append("max_concurrency and draft_len_schedule are mutually exclusive")
    return found


def profile_variants():
    for name in available_profiles():
        profile = load_profile(name)
        for backend in ATTENTION:
            if backend is None:
                yield f"{name}", profile
            elif backend != profile.speculative.attention_backend:
                speculative = profile.speculative.model_copy(update={"attention_backend": backend})
                yield f"{name}+{backend}", profile.model_copy(update={"speculative": speculative})


@pytest.mark.parametrize("label,profile", list(profile_variants()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_yaml_key_and_value_is_one_trtllm_accepts(tiny_pair, tmp_path, label, profile):
    pair = validate_pair(*tiny_pair)
    block_size = pair.drafter_config.block_size
    checked = 0
    for kv_dtype, (draft_len, schedule), tp, recipe in itertools.product(
            [None, "auto", "fp8"], DRAFT_SETTINGS, [None, 1], ["keep", "nvfp4"]):
        options = BuildOptions(*tiny_pair, tmp_path / "e", profile=label, kv_cache_dtype=kv_dtype,
                               max_draft_len=draft_len, draft_len_schedule=schedule, tp=tp, quant=recipe)
        rendered = render_options(profile, pair, options, Path(profile_path(profile.name)))
        data = yaml.safe_load(rendered.to_yaml())  # exactly what llm_api_options.yaml holds
        section = tv.requirements(rendered, recipe, "keep")
        problems = violations("TorchLlmArgs", data, "", (section["min_version"], section["max_version"]))
        problems += cross_field_violations(data, block_size)
        assert not problems, (label, kv_dtype, draft_len, schedule, tp, recipe, problems)
        checked += 1
    assert checked == 3 * len(DRAFT_SETTINGS) * 2 * 2


def test_the_checker_finds_what_trtllm_would_refuse():
    """The table and the walk can fail: each of these is refused by TensorRT-LLM's models."""
    engine = (tv.FIRST_DOCUMENTED_WITH_DFLASH, None)
    assert violations("TorchLlmArgs", {"max_batch_sise": 8}, "", engine)
    assert violations("TorchLlmArgs", {"kv_cache_config": {"dtype": "int4"}}, "", engine)
    assert violations("TorchLlmArgs", {"kv_cache_config": {"free_gpu_memory_fraction": 1.5}}, "", engine)
    assert violations("TorchLlmArgs", {"enable_attention_dp": 1}, "", engine)
    assert violations("TorchLlmArgs", {"speculative_config": {"attention_backend": "FA4"}}, "", engine)
    assert not violations("TorchLlmArgs", {"speculative_config": {"attention_backend": "FA4"}}, "",
                          (tv.FIRST_DOCUMENTED_WITH_DFLASH, tv.NEWEST_CHECKED))
    assert cross_field_violations({"cuda_graph_config": {"batch_sizes": [1, 8], "max_batch_size": 4}}, 4)
    assert cross_field_violations({"speculative_config": {"max_draft_len": 4}}, 4)
    assert cross_field_violations({"speculative_config": {"max_draft_len": 3, "draft_len_schedule": {4: 2}}}, 4)


def literal_values(annotation) -> set:
    """Every Literal value inside an annotation (Optional[Literal[...]], Literal aliases)."""
    if get_origin(annotation) is Literal:
        return set(get_args(annotation))
    return set().union(*(literal_values(arg) for arg in get_args(annotation))) if get_args(annotation) else set()


OUR_MODELS = {options.LlmApiOptions: "TorchLlmArgs", options.KvCacheConfig: "KvCacheConfig",
              options.CudaGraphConfig: "CudaGraphConfig", options.MoeConfig: "MoeConfig",
              options.AttentionDpConfig: "AttentionDpConfig", options.DFlashDecodingConfig: "DFlashDecodingConfig"}


@pytest.mark.parametrize("model", list(OUR_MODELS), ids=lambda m: m.__name__)
def test_every_field_our_options_model_can_write_is_a_trtllm_field(model):
    """A user profile may set any field of engine/options.py, not only those the shipped profiles use."""
    facts = FIELDS[OUR_MODELS[model]]
    for name, info in model.model_fields.items():
        assert name in facts, f"{model.__name__}.{name} has no fact in TensorRT-LLM's {OUR_MODELS[model]}"
        kind, constraint = facts[name]
        values = literal_values(info.annotation)
        if values:
            assert kind == "enum" and values <= set(constraint), (model.__name__, name, values - set(constraint or ()))
