"""Engines TensorRT-LLM can load: quantized drafters refused for GPU profiles (reference-only
elsewhere), the version range an engine records and the runtime enforces, FA4 draft attention, the
probe for the NVFP4 gpt-oss loader. TensorRT-LLM is a stand-in here (test_runtime_trtllm.py's fake):
nothing on this page ran on a GPU."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch
from click.testing import CliRunner
from test_runtime_trtllm import install_fake_tensorrt_llm, make_engine

from trtllm_dflash.cli.build import main as build_main
from trtllm_dflash.cli.run import main as run_main
from trtllm_dflash.engine import trtllm_versions as tv
from trtllm_dflash.engine.build import build_engine
from trtllm_dflash.engine.plan import BuildOptions
from trtllm_dflash.engine.profiles import profile_path
from trtllm_dflash.errors import InputError, MissingDependencyError
from trtllm_dflash.runtime import trtllm as rt


def build(args):
    return CliRunner().invoke(build_main, [str(a) for a in args])


@pytest.mark.parametrize("profile,recipe", [("b200-latency", "nvfp4"), ("b200-latency", "fp8"),
                                            ("h200-latency", "fp8"), ("b300-latency", "mxfp4")])
def test_quantized_drafter_is_refused_for_trtllm_profiles(tiny_pair, tmp_path, profile, recipe):
    target, drafter = tiny_pair
    out = tmp_path / "engine"
    for check in ([], ["--check"]):
        result = build(["--target", target, "--drafter", drafter, "-o", out, "--profile", profile,
                        "--drafter-quant", recipe, "--max-seq-len", 2048, *check])
        assert result.exit_code == 2, result.output
        message = " ".join(result.output.split())
        for needle in ("--drafter-quant", profile, "TensorRT-LLM", "fc.weight_scale is never read",
                       "qkv_proj.weight", "modeling_dflash.py", "--profile cpu-reference", "reference-only"):
            assert needle in message, (needle, message)
        assert "Traceback" not in result.output
        assert not out.exists() and not any(tmp_path.glob(".engine.*")), "nothing may be written"


@pytest.fixture(scope="module")
def reference_only_engine(tiny_pair, tmp_path_factory):
    target, drafter = tiny_pair
    out = tmp_path_factory.mktemp("refonly") / "engine"
    return build_engine(BuildOptions(target, drafter, out, drafter_quant="fp8", max_draft_len=2),
                        show_progress=False, log=lambda _: None).engine


def test_quantized_drafter_engine_is_labelled_reference_only(reference_only_engine, monkeypatch):
    section = reference_only_engine.manifest["trtllm"]
    assert "--drafter-quant fp8" in section["reference_only"] and "modeling_dflash.py" in section["reference_only"]
    install_fake_tensorrt_llm(monkeypatch)  # installed or not, the engine itself is what is refused
    with pytest.raises(InputError, match="reference runtime only") as info:
        rt.TrtllmRuntime(reference_only_engine.root)
    assert info.value.exit_code == 2 and "--backend reference" in str(info.value)


def test_dflash_run_refuses_trtllm_and_auto_falls_back(reference_only_engine, monkeypatch):
    import trtllm_dflash.engine.load as load

    refused = CliRunner().invoke(run_main, [str(reference_only_engine.root), "--backend", "trtllm", "--prompt", "x"])
    assert refused.exit_code == 2 and "reference runtime only" in refused.output and "quantized" in refused.output
    monkeypatch.setattr(load, "choose_backend", lambda requested: ("trtllm", "pretend a GPU host"))
    ran = CliRunner().invoke(run_main, [str(reference_only_engine.root), "--prompt", "x", "--max-tokens", 4, "--json"])
    assert ran.exit_code == 0, ran.output
    assert "backend: reference (the engine is reference-only" in ran.stderr
    runtime, reason = load.engine_runtime(reference_only_engine, "auto", torch.device("cpu"), torch.float32)
    assert runtime.backend == "reference" and "reference-only" in reason  # what the Triton model uses


def test_build_records_and_prints_the_minimum_version(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    result = build(["--target", target, "--drafter", drafter, "-o", tmp_path / "e", "--profile", "cpu-reference",
                    "--max-draft-len", 2, "--quiet"])
    assert result.exit_code == 0, result.output
    section = json.loads((tmp_path / "e" / "manifest.json").read_text())["trtllm"]
    assert section == {"min_version": tv.FIRST_DOCUMENTED_WITH_DFLASH, "max_version": None, "features": ["dflash"],
                       "unpinned": [], "reference_only": None}
    assert f"runs on: TensorRT-LLM >= {tv.FIRST_DOCUMENTED_WITH_DFLASH} (needs dflash)" in result.output
    check = build(["--target", target, "--drafter", drafter, "-o", tmp_path / "c", "--profile", "cpu-reference",
                   "--drafter-quant", "nvfp4", "--check"])
    assert check.exit_code == 0 and "runs on: reference runtime only" in check.output


def fa4_profile(tmp_path):
    path = tmp_path / "fa4.yaml"
    path.write_text(profile_path("cpu-reference").read_text().replace("attention_backend: VANILLA",
                                                                      "attention_backend: FA4"))
    return path


def test_fa4_draft_attention_is_accepted_and_bounds_the_version(tiny_pair, tmp_path):
    """1.3.0rc27 and 1.4.0rc1 document FA4; newer sources dropped it: the engine says so."""
    target, drafter = tiny_pair
    engine = build_engine(BuildOptions(target, drafter, tmp_path / "e", profile=fa4_profile(tmp_path)),
                          show_progress=False, log=lambda _: None).engine
    assert engine.llm_api_options().speculative_config.attention_backend == "FA4"
    section = engine.manifest["trtllm"]
    assert section["max_version"] == tv.NEWEST_CHECKED and "dflash_attention_fa4" in section["features"]
    tv.check_installed("1.4.0rc1", section)
    with pytest.raises(MissingDependencyError, match=r"<= 1\.4\.0rc1 \(found 1\.5\.0\).*dflash_attention_fa4"):
        tv.check_installed("1.5.0", section)


def engine_with_requirements(tmp_path, section):
    engine = make_engine(tmp_path, block_size=4, spec={"decoding_type": "DFlash", "max_draft_len": 3,
                                                       "speculative_model": "drafter"})
    (engine / "manifest.json").write_text(json.dumps({"trtllm": section}))
    return engine


def test_nvfp4_target_needs_the_loader_and_the_newest_checked_version(tmp_path, monkeypatch):
    options = types.SimpleNamespace(speculative_config=None)
    section = tv.requirements(options, "nvfp4", "keep")
    assert section["min_version"] == tv.NEWEST_CHECKED and section["unpinned"] == ["gpt_oss_nvfp4_experts"]
    engine = engine_with_requirements(tmp_path, section)
    install_fake_tensorrt_llm(monkeypatch, version="1.3.0rc27")
    with pytest.raises(MissingDependencyError, match="gpt_oss_nvfp4_experts: first release not pinned"):
        rt.TrtllmRuntime(engine)
    install_fake_tensorrt_llm(monkeypatch, version=tv.NEWEST_CHECKED)
    with pytest.raises(MissingDependencyError, match="load_nvfp4_weights"):
        rt.TrtllmRuntime(engine)  # the version is new enough, but this build has no NVFP4 gpt-oss loader
    loader = types.ModuleType("tensorrt_llm._torch.models.modeling_gpt_oss")
    loader.GptOssForCausalLM = type("GptOssForCausalLM", (), {"load_nvfp4_weights": lambda self, weights: None})
    monkeypatch.setitem(sys.modules, loader.__name__, loader)
    runtime = rt.TrtllmRuntime(engine)
    assert runtime.version == tv.NEWEST_CHECKED and runtime.warnings == []


def test_engines_before_the_trtllm_section_keep_working(tmp_path):
    assert tv.engine_requirements({})["reference_only"] is None
    legacy = tv.engine_requirements({"options": {"drafter_quant": "nvfp4"}})
    assert "--drafter-quant nvfp4" in legacy["reference_only"]


def test_every_feature_row_cites_its_source_and_sorts():
    for row in tv.SUPPORT.values():
        assert row.source and row.what
        for version in (row.since, row.until):
            if version is not None:
                tv.parse_version(version)
    assert tv.version_range(["dflash", "draft_len_schedule"]) == (tv.FIRST_DOCUMENTED_WITH_DFLASH, None)
    assert tv.version_range(["dflash", "rejection_sampling"]) == (tv.NEWEST_CHECKED, None)


def test_options_and_runtime_state_the_same_checked_versions():
    """Both take their versions from engine/trtllm_versions.py (they used to disagree: <1.5 vs 1.4.0rc1)."""
    from trtllm_dflash.engine.options import LlmApiOptions

    with pytest.raises(InputError) as info:
        LlmApiOptions.from_dict({"max_seq_len": 8, "speculative_config": {
            "max_draft_len": 3, "speculative_model": "d", "acceptance_window": 1}})
    assert tv.CHECKED_RANGE in str(info.value)
    newer, = rt.check_version("9.0.0")
    assert f"newer than {tv.NEWEST_CHECKED}" in newer and tv.CHECKED_RANGE.endswith(tv.NEWEST_CHECKED)
