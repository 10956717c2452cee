"""Traps a new GPU user met: silent cpu-reference defaults, a CPU-measured schedule in a B200
engine, a trtllm-serve command that resolves the drafter against the wrong directory, and
dflash-run's unchecked --max-tokens, anonymous write errors, a target passed as --drafter and an
engine run without prompts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

import trtllm_dflash.cli.build as build_cli
from trtllm_dflash.cli.run import main as run_main
from trtllm_dflash.engine.build import build_engine
from trtllm_dflash.engine.plan import BuildOptions

REPO = Path(__file__).resolve().parents[1]


def build(*args):
    return CliRunner().invoke(build_cli.main, [str(a) for a in args])


def run(*args):
    return CliRunner().invoke(run_main, [str(a) for a in args])


def one_line(result) -> str:
    return " ".join(result.output.split())


# ----------------------------------------------------------------------------- no silent profile


def test_profile_is_required_for_a_target_that_is_not_the_embedded_pair(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setattr(build_cli, "detected_gpu", lambda: None)
    target, drafter = tiny_pair
    result = build("--target", target, "--drafter", drafter, "-o", tmp_path / "e")
    assert result.exit_code == 2, result.output
    message = one_line(result)
    assert "--profile" in message and "required" in message and "no GPU was detected" in message
    assert "b200-latency" in message and "cpu-reference" in message and "Traceback" not in message
    assert not (tmp_path / "e").exists()
    monkeypatch.setattr(build_cli, "detected_gpu", lambda: "NVIDIA A100-SXM4-80GB")
    assert "A100-SXM4-80GB has no shipped profile" in one_line(build("--target", target, "--drafter", drafter,
                                                                    "-o", tmp_path / "e"))


def test_profile_is_chosen_from_the_detected_gpu_and_said(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setattr(build_cli, "detected_gpu", lambda: "NVIDIA H200")
    target, drafter = tiny_pair
    result = build("--target", target, "--drafter", drafter, "-o", tmp_path / "e", "--tp", 1, "--ep", 1,
                   "--max-seq-len", 2048, "--check")
    assert result.exit_code == 0, result.output
    assert "profile: h200-latency (chosen for the detected NVIDIA H200" in result.output
    assert "profile h200-latency" in result.output


def test_the_embedded_pair_defaults_to_cpu_reference(tmp_path, monkeypatch):
    from trtllm_dflash import embedded

    monkeypatch.setattr(build_cli, "detected_gpu", lambda: "NVIDIA B200")  # ignored for the embedded pair
    for pair in ([], ["--target", embedded.TARGET_DIR, "--drafter", embedded.DRAFTER_DIR]):
        result = build("-o", tmp_path / "e", "--check", *pair)
        assert result.exit_code == 0, result.output
        assert "profile cpu-reference" in result.output and "chosen for" not in result.output


# ----------------------------------------------------------------------------- schedules and devices


def bench(tmp_path, name, **where):
    path = tmp_path / name
    path.write_text(json.dumps({**where, "schedule": {"max_draft_len": 3, "draft_len_schedule": {"1": 3, "4": 1}}}))
    return path


B200_CHECK = ("--profile", "b200-latency", "--tp", 1, "--ep", 1, "--max-seq-len", 2048, "--check")


@pytest.mark.parametrize("where,needles", [
    ({"machine": "2-core x86_64 CPU", "device": "cpu"}, ["measured on 2-core x86_64 CPU (cpu)", "a B200 GPU"]),
    ({"machine": "NVIDIA GB200", "device": "cuda:0"}, ["measured on NVIDIA GB200 (cuda:0)", "a B200 GPU"]),
    ({}, ["does not say where it was measured"]),
])
def test_schedule_from_another_device_class_is_refused(tiny_pair, tmp_path, where, needles):
    target, drafter = tiny_pair
    path = bench(tmp_path, "bench.json", **where)
    result = build("--target", target, "--drafter", drafter, "-o", tmp_path / "e", "--schedule-from", path, *B200_CHECK)
    assert result.exit_code == 2, result.output
    message = one_line(result)
    for needle in [str(path), "--schedule-from", "--allow-foreign-schedule", *needles]:
        assert needle in message, (needle, message)
    allowed = build("--target", target, "--drafter", drafter, "-o", tmp_path / "e", "--schedule-from", path,
                    "--allow-foreign-schedule", *B200_CHECK)
    assert allowed.exit_code == 0, allowed.output


def test_a_matching_schedule_is_used_and_the_engine_records_where_it_was_measured(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    assert build("--target", target, "--drafter", drafter, "-o", tmp_path / "g", "--schedule-from",
                 bench(tmp_path, "b200.json", machine="NVIDIA B200", device="cuda:0"), *B200_CHECK).exit_code == 0
    cpu = bench(tmp_path, "cpu.json", machine="2-core x86_64 CPU", device="cpu")
    result = build("--target", target, "--drafter", drafter, "-o", tmp_path / "e", "--profile", "cpu-reference",
                   "--schedule-from", cpu, "--quiet")
    assert result.exit_code == 0, result.output
    schedule = json.loads((tmp_path / "e" / "manifest.json").read_text())["schedule"]
    assert schedule == {"file": str(cpu), "measured_on": {"machine": "2-core x86_64 CPU", "device": "cpu"},
                        "foreign_allowed": False}


# ----------------------------------------------------------------------------- serving commands


def test_documented_trtllm_serve_commands_run_from_inside_the_engine():
    """TensorRT-LLM treats speculative_model as a local directory only if it exists relative to its
    working directory (llm_args.py `_ModelWrapper`), else as a Hugging Face id: our relative
    `drafter` only resolves when the server starts inside the engine."""
    commands = []
    for doc in ("docs/trtllm.md", "trtllm_dflash/engine/README.md", "README.md"):
        commands += [(doc, line) for line in (REPO / doc).read_text().splitlines()
                     if re.search(r"trtllm-serve\s+[^-\s]", line) and "llm_api_options.yaml" in line]
    assert commands
    for doc, line in commands:
        assert re.search(r"cd \S+ && .*trtllm-serve \./target --extra_llm_api_options llm_api_options\.yaml", line), \
            (doc, line)


# ----------------------------------------------------------------------------- dflash-run traps


@pytest.fixture(scope="module")
def short_engine(tiny_pair, tmp_path_factory):
    target, drafter = tiny_pair
    return build_engine(BuildOptions(target, drafter, tmp_path_factory.mktemp("short") / "engine", max_seq_len=1024),
                        show_progress=False, log=lambda _: None).engine


def test_max_tokens_is_checked_against_the_engine_max_seq_len(short_engine):
    result = run(short_engine.root, "--prompt", "abc", "--max-tokens", 2000)  # within the target's 4096 positions
    assert result.exit_code == 2, result.output
    message = one_line(result)
    assert "--max-tokens" in message and "max_seq_len 1024" in message and "llm_api_options.yaml" in message
    assert "tok/s" not in result.output  # refused before any model ran


def test_an_engine_without_prompts_runs_the_held_out_prompts(short_engine):
    result = run(short_engine.root, "--max-tokens", 2, "--json")
    assert result.exit_code == 0, result.output
    assert "embedded held-out prompts" in result.stderr
    *records, summary = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(records) == 4 and summary["summary"] is True


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_names_the_output_file(tiny_pair):
    target, drafter = tiny_pair
    result = run("--target", target, "--drafter", drafter, "--prompt", "x", "--max-tokens", 2, "--no-stream",
                 "--output", "/dev/full")
    assert result.exit_code == 1, result.output
    assert "error: /dev/full: No space left on device" in result.output and "Traceback" not in result.output


def test_a_target_passed_as_the_drafter_is_named(tiny_pair, tmp_path):
    target, _ = tiny_pair
    for result in (run("--target", target, "--drafter", target, "--prompt", "x"),
                   build("--target", target, "--drafter", target, "-o", tmp_path / "e", "--profile", "cpu-reference")):
        assert result.exit_code == 2, result.output
        message = one_line(result)
        assert "this is a target checkpoint (gpt-oss), not a DFlash drafter" in message
        assert str(target / "config.json") in message and "block_size" in message
