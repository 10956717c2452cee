"""dflash-build on tiny random pairs: layout, lossless generation from the engine, tamper detection.

(The embedded pair is not shipped yet; these use the random pairs of models/random_pair.py.)
"""

from __future__ import annotations

import contextlib
import json
import shutil

import pytest
import torch
from safetensors import safe_open

from trtllm_dflash.engine.build import build_engine
from trtllm_dflash.engine.plan import BuildOptions
from trtllm_dflash.engine.load import reference_runtime
from trtllm_dflash.engine.manifest import MANIFEST, OPTIONS_FILE, open_engine
from trtllm_dflash.errors import InputError
from trtllm_dflash.runtime.reference import ReferenceRuntime
from trtllm_dflash.runtime.sampling import SamplingParams

PROMPTS = [[72, 101, 108, 108, 111], [1, 2, 3, 4, 5, 6, 7, 8, 9], [200]]


@pytest.fixture(scope="module")
def engine(tiny_pair, tmp_path_factory):
    target, drafter = tiny_pair
    out = tmp_path_factory.mktemp("engines") / "engine"
    return build_engine(BuildOptions(target, drafter, out), show_progress=False, log=lambda _: None).engine


def test_layout(engine):
    root = engine.root
    for rel in ("manifest.json", "llm_api_options.yaml", "target/config.json", "target/tokenizer.json",
                "drafter/config.json", "drafter/model.safetensors", "triton/dflash/config.pbtxt",
                "triton/dflash/1/model.py"):
        assert (root / rel).is_file(), rel
    assert not (root / "triton/dflash/1/model.yaml").exists()  # its relative paths would resolve against the cwd
    listed = set(engine.manifest["files"])
    on_disk = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()} - {MANIFEST}
    assert listed == on_disk
    assert engine.manifest["complete"] is True and list(engine.manifest)[-1] == "complete"
    assert engine.manifest["sources"]["target"]["files"]["model.safetensors"]["sha256"]
    assert not any(p.name.startswith(".engine.") for p in root.parent.iterdir())  # partial/records cleaned up


def test_drafter_is_in_trtllm_layout(engine):
    config = json.loads((engine.drafter_dir / "config.json").read_text())
    assert config["block_size"] == 4 and set(config["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    with safe_open(engine.drafter_dir / "model.safetensors", framework="pt") as handle:
        names = set(handle.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= names
    assert all(not n.startswith("model.") and "embed" not in n and "lm_head" not in n for n in names)
    assert any(n.startswith("layers.0.") for n in names)


def test_options_point_into_the_engine(engine, tmp_path):
    spec = engine.llm_api_options().speculative_config
    assert spec.speculative_model == str(engine.root / "drafter") and spec.max_draft_len == 3
    moved = tmp_path / "moved"
    shutil.copytree(engine.root, moved)
    relocated = open_engine(moved, verify_checksums=True)
    assert relocated.llm_api_options().speculative_config.speculative_model == str(moved / "drafter")


def test_engine_runs_losslessly(engine):
    runtime = reference_runtime(engine, torch.device("cpu"), torch.float32)
    params = SamplingParams(max_tokens=24)
    dflash = runtime.generate(PROMPTS, params, batch_size=2)
    baseline = ReferenceRuntime(runtime.target, None).generate(PROMPTS, params, batch_size=2)
    assert [r.output_token_ids for r in dflash] == [r.output_token_ids for r in baseline]
    # the engine's verify block of 4 bounds the drafter's steps; suffix steps run to 2 x 4 - 1 = 7 drafts
    assert runtime.proposer.dflash.num_drafts == 3 and all(r.stats.block_size == 8 for r in dflash)


def test_quantized_engine_runs_losslessly(tiny_pair, tmp_path):
    target, drafter = tiny_pair
    built = build_engine(BuildOptions(target, drafter, tmp_path / "fp8", quant="fp8", drafter_quant="fp8",
                                      max_draft_len=2), show_progress=False, log=lambda _: None)
    engine = built.engine
    assert (engine.target_dir / "hf_quant_config.json").is_file()
    runtime = reference_runtime(engine, torch.device("cpu"), torch.float32)
    params = SamplingParams(max_tokens=16)
    ours = runtime.generate(PROMPTS[:2], params)
    base = ReferenceRuntime(runtime.target, None).generate(PROMPTS[:2], params)
    assert [r.output_token_ids for r in ours] == [r.output_token_ids for r in base]
    assert runtime.proposer.dflash.num_drafts == 2 and all(r.stats.block_size == 6 for r in ours)


def test_every_file_is_guarded(engine, tmp_path):
    """Appending a byte is caught by the size check; flipping one is caught by sha256 only."""
    for rel in engine.manifest["files"]:
        copy = tmp_path / rel.replace("/", "_")
        shutil.copytree(engine.root, copy)
        file = copy / rel
        data = bytearray(file.read_bytes())
        file.write_bytes(bytes(data) + b"\0")
        with pytest.raises(InputError, match="size") as info:
            open_engine(copy)
        assert str(file) in str(info.value)
        data[len(data) // 2] ^= 0xFF
        file.write_bytes(bytes(data))
        if rel == OPTIONS_FILE:  # parsed on every open: a flipped byte there may already fail to parse
            with contextlib.suppress(InputError):
                open_engine(copy)
        else:
            open_engine(copy)  # same size: the cheap check passes
        with pytest.raises(InputError, match="sha256") as info:
            open_engine(copy, verify_checksums=True)
        assert str(file) in str(info.value)
        shutil.rmtree(copy)


def test_incomplete_or_missing_manifest_is_refused(engine, tmp_path):
    copy = tmp_path / "e"
    shutil.copytree(engine.root, copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    (copy / MANIFEST).write_text(json.dumps({**manifest, "complete": False}))
    with pytest.raises(InputError, match="complete"):
        open_engine(copy)
    (copy / "drafter" / "config.json").unlink()
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(InputError, match="missing") as info:
        open_engine(copy)
    assert "drafter/config.json" in str(info.value)
    (copy / MANIFEST).unlink()
    with pytest.raises(InputError, match="manifest.json"):
        open_engine(copy)


def test_damaged_manifest_records_and_options_are_refused(engine, tmp_path):
    copy = tmp_path / "e"
    shutil.copytree(engine.root, copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    first = next(iter(manifest["files"]))
    damaged = {**manifest, "files": {**manifest["files"], first: {"size": "big", "sha256": "0"}}}
    (copy / MANIFEST).write_text(json.dumps(damaged))
    with pytest.raises(InputError, match=f"field 'files\\['{first}'\\]'"):
        open_engine(copy)
    (copy / MANIFEST).write_text(json.dumps(manifest))
    options = copy / "llm_api_options.yaml"
    options.write_text(options.read_text().replace("max_draft_len:", "max_draft_len: [", 1))
    with pytest.raises(InputError, match="llm_api_options.yaml"):
        open_engine(copy)  # refused on opening, by every command, though the manifest does not guard content


def test_existing_output_needs_force(tiny_pair, engine, tmp_path):
    target, drafter = tiny_pair
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(InputError, match="--force"):
        build_engine(BuildOptions(target, drafter, out), show_progress=False)
    assert (out / "keep.txt").is_file()
    result = build_engine(BuildOptions(target, drafter, out, force=True), show_progress=False, log=lambda _: None)
    assert not (out / "keep.txt").exists() and result.engine.manifest["complete"]


def test_nvfp4_target_build_calibrates_input_scales(tiny_pair, tmp_path):
    """NVFP4 gpt-oss experts need *_input_scale (TensorRT-LLM's NVFP4 MoE loader): dflash-build
    calibrates the target on built-in prompts when no amax file is given, or uses the file."""
    from trtllm_dflash.checkpoints.safetensors_io import ShardedReader

    target, drafter = tiny_pair
    built = build_engine(BuildOptions(target, drafter, tmp_path / "nvfp4", quant="nvfp4", max_draft_len=2),
                         show_progress=False, log=lambda _: None)
    engine = built.engine
    quant = json.loads((engine.target_dir / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "NVFP4" and quant["group_size"] == 16
    reader = ShardedReader(engine.target_dir)
    layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    for layer in range(layers):
        for param in ("gate_up_proj", "down_proj"):
            scale = reader.read(f"model.layers.{layer}.mlp.experts.{param}_input_scale")
            assert scale.shape == () and float(scale) > 0
    runtime = reference_runtime(engine, torch.device("cpu"), torch.float32)
    params = SamplingParams(max_tokens=12)
    ours = runtime.generate(PROMPTS[:2], params)
    base = ReferenceRuntime(runtime.target, None).generate(PROMPTS[:2], params)
    assert [r.output_token_ids for r in ours] == [r.output_token_ids for r in base]

    amax = {f"model.layers.{i}.mlp.experts.{p}": 3.0 for i in range(layers) for p in ("gate_up_proj", "down_proj")}
    (tmp_path / "amax.json").write_text(json.dumps(amax))
    built = build_engine(BuildOptions(target, drafter, tmp_path / "file", quant="nvfp4", max_draft_len=2,
                                      input_amax_file=tmp_path / "amax.json"), show_progress=False, log=lambda _: None)
    scale = ShardedReader(built.engine.target_dir).read("model.layers.0.mlp.experts.down_proj_input_scale")
    assert float(scale) == pytest.approx(3.0 / (6 * 448))


def test_calibration_prompts_set_the_static_input_scales(tiny_pair, tmp_path):
    """--calibration-prompts: the target is calibrated on the user's prompts (nvfp4 experts; fp8 also
    gets its attention input scales), and the stage key follows the prompts."""
    from trtllm_dflash.checkpoints.safetensors_io import ShardedReader
    from trtllm_dflash.engine.build import calibrate_target

    target, drafter = tiny_pair
    prompts = tmp_path / "calibration.jsonl"
    ids = [[7, 8, 9, 10, 11, 12], [200, 3, 3, 3]]
    prompts.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in ids))
    for recipe, name in (("nvfp4", "model.layers.1.mlp.experts.down_proj"),
                         ("fp8", "model.layers.1.self_attn.q_proj.weight")):
        built = build_engine(BuildOptions(target, drafter, tmp_path / recipe, quant=recipe, max_draft_len=2,
                                          calibration_prompts_file=prompts), show_progress=False, log=lambda _: None)
        expected = calibrate_target(target, recipe, ids)[name] / (6 * 448 if recipe == "nvfp4" else 448)
        scale_name = name.removesuffix(".weight") + ".input_scale" if recipe == "fp8" else name + "_input_scale"
        assert float(ShardedReader(built.engine.target_dir).read(scale_name)) == pytest.approx(expected)
        default = calibrate_target(target, recipe)[name] / (6 * 448 if recipe == "nvfp4" else 448)
        assert expected != pytest.approx(default)  # the prompts mattered
    for options, message in [
        (BuildOptions(target, drafter, tmp_path / "k", calibration_prompts_file=prompts), "not keep"),
        (BuildOptions(target, drafter, tmp_path / "a", quant="nvfp4", calibration_prompts_file=prompts,
                      input_amax_file=tmp_path / "amax.json"), "not both"),
    ]:
        with pytest.raises(InputError, match=message):
            build_engine(options, show_progress=False)


def test_default_engine_cache_follows_the_pair_content(tiny_pair, tmp_path, monkeypatch):
    """A re-shipped embedded pair (same toolkit version) must not reuse the old cached engine."""
    from trtllm_dflash.engine.build import default_engine_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    target, drafter = (shutil.copytree(d, tmp_path / d.name) for d in tiny_pair)
    first = default_engine_dir((target, drafter))
    assert first.parent == tmp_path / "cache" / "trtllm-dflash"
    assert default_engine_dir((target, drafter)) == first
    config = drafter / "config.json"
    config.write_text(config.read_text() + "\n")
    assert default_engine_dir((target, drafter)) != first
