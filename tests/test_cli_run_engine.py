"""dflash-run on engine directories of the tiny pair: the engine's block, schedule and runtime settings
(dflash-sa's, which live in the manifest, never in TensorRT-LLM's options), and a damaged engine's errors."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

from run_cli import build_engine, invoke, json_lines


def test_run_engine_directory_and_verify(tiny_pair, tmp_path):
    target, _ = tiny_pair
    engine = build_engine(tiny_pair, tmp_path / "engine", "--max-draft-len", 2)
    result = invoke(engine, "--prompt", "abc", "--max-tokens", 8, "--json", "--baseline", "--verify")
    assert result.exit_code == 0, result.output
    (record,), _ = json_lines(result)
    # max_draft_len 2: a verify block of 3, suffix drafts up to 2 x 3 - 1 = 5 (the histogram counts 0..5 kept)
    assert record["matches_baseline"] and len(record["acceptance_histogram"]) == 6
    config = engine / "target" / "config.json"
    config.write_text(config.read_text().replace('"hidden_size": 64', '"hidden_size": 65'))  # same size
    result = invoke(engine, "--prompt", "abc", "--verify")
    assert result.exit_code == 2 and "config.json" in result.output and "Traceback" not in result.output
    assert invoke(engine, "--target", target, "--prompt", "x").exit_code == 2

def test_schedule_from_bench_reaches_the_engine_and_the_run(tiny_pair, tmp_path):
    import yaml

    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"machine": "2-core x86_64 CPU", "device": "cpu",
                                 "schedule": {"max_draft_len": 3, "draft_len_schedule": {"1": 3, "2": 1}}}))
    engine = build_engine(tiny_pair, tmp_path / "engine", "--schedule-from", bench)
    spec = yaml.safe_load((engine / "llm_api_options.yaml").read_text())["speculative_config"]
    assert spec["draft_len_schedule"] == {1: 3, 2: 1} and spec["max_draft_len"] == 3
    result = invoke(engine, "--prompt", "abc", "--prompt", "xyz", "--prompt", "q", "--batch-size", 3,
                    "--max-tokens", 10, "--json", "--baseline")
    assert result.exit_code == 0, result.output
    assert all(record["matches_baseline"] for record in json_lines(result)[0])

def test_sa_max_drafts_lives_in_the_manifest_and_reaches_the_runtimes(tiny_pair, tmp_path):
    """An engine's longest suffix draft: dflash-run and the engine's reference runtime (the Triton model's) take it;
    without it both default to 2 x the verify block - 1; below max_draft_len the build refuses it."""
    from trtllm_dflash.cli.build import main as build_main
    from trtllm_dflash.engine.load import reference_runtime
    from trtllm_dflash.engine.manifest import open_engine
    from trtllm_dflash.runtime.trtllm import engine_manifest, ignored_engine_settings

    target, drafter = tiny_pair  # a block of 4: max_draft_len 3
    plain = build_engine(tiny_pair, tmp_path / "plain")
    longer = build_engine(tiny_pair, tmp_path / "longer", "--sa-max-drafts", 9)
    assert open_engine(plain).sa_max_drafts is None and open_engine(longer).sa_max_drafts == 9
    assert "sa_max_drafts" not in (longer / "llm_api_options.yaml").read_text()
    assert any("sa_max_drafts (9)" in note for note in ignored_engine_settings(engine_manifest(longer)))
    for engine, args, longest in ((plain, [], 7), (longer, [], 9), (longer, ["--sa-max-drafts", 5], 5)):
        result = invoke(engine, "--prompt", "abcabcabcabc", "--max-tokens", 6, "--json", *args)
        assert result.exit_code == 0, result.output
        assert json_lines(result)[1]["sa_max_drafts"] == longest
    for engine, longest in ((plain, 7), (longer, 9)):
        runtime = reference_runtime(open_engine(engine), torch.device("cpu"), torch.float32)
        assert runtime.proposer.num_drafts == longest
    bad = CliRunner().invoke(build_main, ["--target", str(target), "--drafter", str(drafter), "-o",
                                          str(tmp_path / "short"), "--profile", "cpu-reference",
                                          "--sa-max-drafts", "2"])
    assert bad.exit_code == 2 and "--sa-max-drafts" in bad.output and "max_draft_len (3)" in bad.output
    assert not (tmp_path / "short").exists()
    manifest = longer / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"sa_max_drafts": 9', '"sa_max_drafts": 0'))
    result = invoke(longer, "--prompt", "abc")
    assert result.exit_code == 2 and "runtime.sa_max_drafts" in result.output and "Traceback" not in result.output

def test_sa_threshold_lives_in_the_manifest_not_the_trtllm_options(tiny_pair, tmp_path):
    from trtllm_dflash.cli.build import main as build_main
    from trtllm_dflash.engine.manifest import open_engine
    from trtllm_dflash.runtime.trtllm import engine_manifest, ignored_engine_settings

    target, drafter = tiny_pair
    engine = build_engine(tiny_pair, tmp_path / "engine", "--sa-threshold", 3)
    assert open_engine(engine).sa_threshold == 3
    assert "sa_threshold" not in (engine / "llm_api_options.yaml").read_text()  # TensorRT-LLM forbids unknown keys
    (note,) = ignored_engine_settings(engine_manifest(engine))
    assert "sa_threshold (3)" in note and "ignores it" in note
    for args, threshold in (([], 3), (["--sa-threshold", 5], 5)):
        result = invoke(engine, "--prompt", "abc", "--max-tokens", 6, "--json", *args)
        assert result.exit_code == 0, result.output
        assert json_lines(result)[1]["sa_threshold"] == threshold
    bad = CliRunner().invoke(build_main, ["--target", str(target), "--drafter", str(drafter), "-o",
                                          str(tmp_path / "other"), "--sa-threshold", "0"])
    assert bad.exit_code == 2 and "--sa-threshold" in bad.output
    assert not (tmp_path / "other").exists()
    result = invoke(engine, "--prompt", "abc", "--backend", "trtllm", "--draft-method", "dflash-sa")
    assert result.exit_code == 2 and "reference backend only" in result.output and "Traceback" not in result.output
    manifest = engine / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"sa_threshold": 3', '"sa_threshold": "3"'))
    result = invoke(engine, "--prompt", "abc")
    assert result.exit_code == 2 and "runtime.sa_threshold" in result.output and "Traceback" not in result.output


def test_the_served_baseline_times_the_expert_storages_on_one_token_steps(tiny_pair, tmp_path, monkeypatch):
    """The autoregressive server never verifies a block: its start-up timing of the expert storages must not weigh
    one (AMX tiles win 8-token verifies and lose one-token steps on an AMX Xeon, round 32)."""
    import trtllm_dflash.engine.load as load
    from trtllm_dflash.engine.manifest import open_engine

    engine = open_engine(build_engine(tiny_pair, tmp_path / "engine"))
    timed = []
    monkeypatch.setattr(load, "choose_expert_storage", lambda target, choice, batch, block: timed.append(block))
    load.reference_runtime(engine, torch.device("cpu"), torch.float32, draft_method=None)
    load.reference_runtime(engine, torch.device("cpu"), torch.float32)
    assert timed == [1, load.engine_speculation(engine)[0]] and timed[1] > 1  # the DFlash server: its verify block
