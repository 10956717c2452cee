"""dflash-build refuses bad input before writing anything: exit 2, message naming file and field."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from trtllm_dflash.cli.build import main
from trtllm_dflash.engine.profiles import profile_path
from trtllm_dflash.models.random_pair import save_byte_tokenizer


@pytest.fixture
def out(tmp_path):
    return tmp_path / "engine"


def run(args, default_profile="cpu-reference"):
    """dflash-build with args; a profile is required for non-embedded targets, cpu-reference unless given."""
    args = [str(a) for a in args]
    if default_profile and "--profile" not in args:
        args += ["--profile", default_profile]
    return CliRunner().invoke(main, args)


def refused(result, out, *needles):
    assert result.exit_code == 2, result.output
    for needle in needles:
        assert str(needle) in result.output, (needle, result.output)
    assert not out.exists() and not any(out.parent.glob(f".{out.name}.*")), "nothing may be written"


def test_check_writes_nothing(tiny_pair, out):
    target, drafter = tiny_pair
    result = run(["--target", target, "--drafter", drafter, "-o", out, "--check"])
    assert result.exit_code == 0 and "nothing written" in result.output
    assert not out.exists()


def test_embedded_pair_not_available(out, monkeypatch, tmp_path):
    import trtllm_dflash.embedded as embedded

    monkeypatch.setattr(embedded, "TARGET_DIR", tmp_path / "not-shipped")
    refused(run(["-o", out]), out, "embedded", "--target")


def test_draft_len_above_block(tiny_pair, out):
    target, drafter = tiny_pair
    refused(run(["--target", target, "--drafter", drafter, "-o", out, "--max-draft-len", 4]), out,
            "--max-draft-len", drafter / "config.json", "block_size", "1..3")


def test_seq_len_above_target(tiny_pair, out):
    target, drafter = tiny_pair
    refused(run(["--target", target, "--drafter", drafter, "-o", out, "--max-seq-len", 100000]), out,
            "--max-seq-len", target / "config.json", "max_position_embeddings")


def drafter_with_tokenizer(tiny_pair, tmp_path, **kwargs):
    _, drafter = tiny_pair
    copy = tmp_path / "drafter"
    shutil.copytree(drafter, copy)
    save_byte_tokenizer(copy, **kwargs)
    return copy


def test_drafter_tokenizer_must_match(tiny_pair, tmp_path, out):
    target, _ = tiny_pair
    same = drafter_with_tokenizer(tiny_pair, tmp_path)
    assert run(["--target", target, "--drafter", same, "-o", out, "--check"]).exit_code == 0
    shutil.rmtree(same)
    other = drafter_with_tokenizer(tiny_pair, tmp_path, mask="<|other|>")
    refused(run(["--target", target, "--drafter", other, "-o", out]), out, other / "tokenizer.json", "added_tokens")


def test_quant_needs_blackwell_on_h200(tiny_pair, out):
    target, drafter = tiny_pair
    refused(run(["--target", target, "--drafter", drafter, "-o", out, "--profile", "h200-latency", "--quant", "nvfp4",
                 "--max-seq-len", 2048]),
            out, "--quant", "H200", "SM90", "Blackwell", "mxfp4", "keep")
    refused(run(["--target", target, "--drafter", drafter, "-o", out, "--profile", "h200-latency",
                 "--drafter-quant", "nvfp4", "--max-seq-len", 2048]), out, "--drafter-quant")


def test_mxfp8_activation_override_needs_blackwell(tiny_pair, tmp_path, out):
    target, drafter = tiny_pair
    profile = tmp_path / "h200-mxfp8.yaml"
    profile.write_text(profile_path("h200-latency").read_text().replace(
        '    TRTLLM_ENABLE_PDL: "1"', '    TRTLLM_ENABLE_PDL: "1"\n    OVERRIDE_QUANT_ALGO: W4A8_MXFP4_MXFP8'))
    refused(run(["--target", target, "--drafter", drafter, "-o", out, "--profile", profile, "--max-seq-len", 2048]), out,
            profile, "OVERRIDE_QUANT_ALGO", "Blackwell")


def test_profile_backend_must_fit_gpu(tiny_pair, tmp_path, out):
    target, drafter = tiny_pair
    profile = tmp_path / "h200-trtllm.yaml"
    profile.write_text(profile_path("h200-latency").read_text().replace("backend: TRITON", "backend: TRTLLM"))
    refused(run(["--target", target, "--drafter", drafter, "-o", out, "--profile", profile, "--max-seq-len", 2048]), out,
            profile, "llm_api_options.moe_config.backend")


@pytest.mark.parametrize("args,needles", [
    (["--tp", 3], ["--tp", "num_attention_heads", "config.json"]),
    (["--tp", 4], ["--tp", "num_key_value_heads"]),
    (["--tp", 3, "--ep", 3], ["--ep", "num_local_experts"]),
    (["--tp", 2, "--ep", 4], ["--ep", "divide TP"]),
    (["--tp", 0], ["--tp", ">=1"]),
    (["--max-draft-len", 0], ["--max-draft-len", ">=1"]),
])
def test_sizes_must_be_positive_and_split_the_model(tiny_pair, out, args, needles):
    target, drafter = tiny_pair
    refused(run(["--target", target, "--drafter", drafter, "-o", out, *args]), out, *needles)


def test_latency_profile_tp8_refused_for_tiny_model(tiny_pair, out):
    target, drafter = tiny_pair
    refused(run(["--target", target, "--drafter", drafter, "-o", out, "--profile", "b200-latency",
                 "--max-seq-len", 2048]), out,
            "--ep", "EP 8", "num_local_experts")


def test_bad_choices_and_pair_errors(tiny_pair, tmp_path, out):
    target, drafter = tiny_pair
    refused(run(["--target", target, "--drafter", drafter, "-o", out, "--quant", "int3"]), out, "--quant", "keep")
    refused(run(["--target", target, "--drafter", drafter, "-o", out, "--profile", "nope"]), out, "--profile")
    refused(run(["--target", target, "-o", out]), out, "--drafter")
    refused(run(["--target", drafter, "--drafter", drafter, "-o", out]), out, drafter / "config.json", "model_type")


def test_bad_input_amax_file_is_refused(tiny_pair, out, tmp_path):
    target, drafter = tiny_pair
    amax = tmp_path / "amax.json"
    amax.write_text('{"model.layers.0.mlp.experts.down_proj": "big"}')
    result = run(["--target", target, "--drafter", drafter, "-o", out, "--quant", "nvfp4", "--input-amax", amax])
    refused(result, out, "amax.json", "weight name -> amax")


def test_input_amax_is_checked_against_the_recipe_before_anything_is_written(tiny_pair, out, tmp_path):
    target, drafter = tiny_pair
    amax = tmp_path / "amax.json"
    experts = {f"model.layers.{i}.mlp.experts.{p}": 3.0 for i in range(4) for p in ("gate_up_proj", "down_proj")}
    for entries, needles in [
        ({**experts, "model.layers.9.mlp.experts.down_proj": 1.0}, ["layers.9", "no FP8/NVFP4 weight"]),
        (dict(list(experts.items())[:3]), ["need a calibrated input amax"]),
        ({**experts, "model.layers.0.mlp.experts.down_proj": -1.0}, ["finite and > 0"]),
    ]:
        amax.write_text(json.dumps(entries))
        for check in ([], ["--check"]):
            refused(run(["--target", target, "--drafter", drafter, "-o", out, "--quant", "nvfp4",
                         "--input-amax", amax, *check]), out, "amax.json", *needles)
    refused(run(["--target", target, "--drafter", drafter, "-o", out, "--input-amax", amax]), out,
            "amax.json", "--input-amax", "keeps the target")


def test_a_stale_shard_index_is_found_by_check(tiny_pair, out, tmp_path):
    from safetensors.torch import load_file, save_file

    target, drafter = tiny_pair
    stale = tmp_path / "target"
    shutil.copytree(target, stale)
    tensors = load_file(stale / "model.safetensors")
    (stale / "model.safetensors").unlink()
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file({n: t for n, t in tensors.items() if n != "model.norm.weight"}, stale / first)
    save_file({"model.norm.weight": tensors["model.norm.weight"]}, stale / second)
    weight_map = {n: first for n in tensors} | {"model.norm.weight": second, "lm_head.weight": second}  # stale
    (stale / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    refused(run(["--target", stale, "--drafter", drafter, "-o", out, "--quant", "nvfp4", "--check"]), out,
            "model.safetensors.index.json", "lm_head.weight")


def test_an_output_that_overlaps_a_source_is_refused(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    source = tmp_path / "target"
    shutil.copytree(target, source)
    for out in (source, source / "engine", tmp_path):
        result = run(["--target", source, "--drafter", drafter, "-o", out, "--force"])
        assert result.exit_code == 2 and "overlaps the source checkpoint" in result.output, result.output
    assert sorted(p.name for p in source.iterdir()) == sorted(p.name for p in target.iterdir())
