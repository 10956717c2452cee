"""The LLM-API options model and the hardware profiles: field names, YAML round trips, TensorRT-LLM's rules."""

from __future__ import annotations

import pytest
import yaml

from trtllm_dflash.engine.checks import check_profile_hardware
from trtllm_dflash.engine.options import DFlashDecodingConfig, LlmApiOptions
from trtllm_dflash.engine.profiles import available_profiles, load_profile, profile_path
from trtllm_dflash.errors import InputError

PROFILES = ["b200-latency", "b200-throughput", "gb200-throughput", "b300-latency", "h200-latency", "cpu-reference"]


def with_spec(profile, max_draft_len: int = 9) -> dict:
    data = profile.llm_api_options.to_dict()
    data["speculative_config"] = {**profile.speculative.model_dump(exclude_none=True), "max_draft_len": max_draft_len,
                                  "speculative_model": "drafter", "mask_token_id": 200000,
                                  "target_layer_ids": [1, 9, 17, 25, 33]}
    return data


def test_all_profiles_are_shipped():
    assert set(PROFILES) <= set(available_profiles())


@pytest.mark.parametrize("name", PROFILES)
def test_profile_renders_and_round_trips(name):
    profile = load_profile(name)
    options = LlmApiOptions.from_dict(with_spec(profile))
    text = options.to_yaml()
    again = LlmApiOptions.from_dict(yaml.safe_load(text))  # extra="forbid": no unknown keys survive
    assert again == options
    assert again.max_seq_len and again.speculative_config.decoding_type == "DFlash"
    check_profile_hardware(options, profile, str(profile_path(name)))  # consistent with its own GPU


def test_user_profile_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(profile_path("cpu-reference").read_text().replace("name: cpu-reference", "name: mine"))
    assert load_profile(path).name == "mine"
    assert load_profile(str(path)).name == "mine"


def test_profile_unknown_key_names_file_and_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(profile_path("cpu-reference").read_text().replace("  max_batch_size: 8", "  max_batch_sise: 8"))
    with pytest.raises(InputError) as info:
        load_profile(path)
    assert str(path) in str(info.value) and "llm_api_options.max_batch_sise" in str(info.value)


def test_unknown_profile_lists_choices():
    with pytest.raises(InputError, match="b200-latency"):
        load_profile("a100-latency")


@pytest.mark.parametrize("old,new", [("acceptance_window", "acceptance_rate_window_size"),
                                     ("acceptance_length_threshold", "acceptance_rate_threshold")])
def test_renamed_acceptance_fields_are_refused(old, new):
    with pytest.raises(InputError) as info:
        LlmApiOptions.from_dict({"max_seq_len": 8, "speculative_config": {
            "max_draft_len": 3, "speculative_model": "d", old: 1}}, "x.yaml")
    assert new in str(info.value) and "x.yaml" in str(info.value)


def test_current_acceptance_fields_accepted():
    spec = DFlashDecodingConfig(max_draft_len=3, speculative_model="d", acceptance_rate_window_size=64,
                                acceptance_rate_threshold=0.3)
    assert spec.acceptance_rate_threshold == 0.3


def test_speculative_model_dir_alias():
    spec = DFlashDecodingConfig.model_validate({"max_draft_len": 3, "speculative_model_dir": "d"})
    assert spec.model_dump(exclude_none=True)["speculative_model"] == "d"


def test_draft_len_schedule_rules_and_round_trip():
    options = LlmApiOptions.from_dict({"max_seq_len": 64, "speculative_config": {
        "max_draft_len": 4, "speculative_model": "d", "draft_len_schedule": {32: 1, 4: 4, 8: 2}}})
    assert list(options.speculative_config.draft_len_schedule) == [4, 8, 32]
    assert LlmApiOptions.from_dict(yaml.safe_load(options.to_yaml())) == options
    bad = [{4: 3, 8: 2},  # smallest key must map to max_draft_len
           {4: 4, 8: 5},  # longer than max_draft_len
           {0: 4},  # threshold below 1
           {}]
    for schedule in bad:
        with pytest.raises(InputError, match="draft_len_schedule"):
            LlmApiOptions.from_dict({"max_seq_len": 64, "speculative_config": {
                "max_draft_len": 4, "speculative_model": "d", "draft_len_schedule": schedule}})
    with pytest.raises(InputError, match="mutually exclusive"):
        LlmApiOptions.from_dict({"max_seq_len": 64, "speculative_config": {
            "max_draft_len": 4, "speculative_model": "d", "max_concurrency": 8, "draft_len_schedule": {4: 4}}})


def test_consistency_rules():
    with pytest.raises(InputError, match="max_batch_size"):
        LlmApiOptions.from_dict({"max_seq_len": 64, "max_batch_size": 4,
                                 "cuda_graph_config": {"batch_sizes": [1, 8]}})
    with pytest.raises(InputError, match="max\\(batch_sizes\\)"):
        LlmApiOptions.from_dict({"max_seq_len": 64, "cuda_graph_config": {"batch_sizes": [1, 8], "max_batch_size": 4}})
    with pytest.raises(InputError, match="max_seq_len"):
        LlmApiOptions.from_dict({})
    options = LlmApiOptions.from_dict({"max_seq_len": 64, "env_overrides": {"TRTLLM_ENABLE_PDL": 1}})
    assert options.env_overrides == {"TRTLLM_ENABLE_PDL": "1"}
