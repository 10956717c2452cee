"""Calibration amax from hooks, and quantized checkpoints round-tripping into the reference runtime."""

from __future__ import annotations

import json

import pytest
import torch

from trtllm_dflash.checkpoints.gpt_oss import load_hf_gpt_oss
from trtllm_dflash.models.drafter import load_drafter
from trtllm_dflash.models.random_pair import (
    drafter_config_for, save_random_drafter, save_random_target, tiny_target_config)
from trtllm_dflash.models.target import GptOssTarget
from trtllm_dflash.quant.calibrate import calibrate, for_recipe
from trtllm_dflash.quant.convert import convert_checkpoint
from trtllm_dflash.runtime.proposers import DFlashProposer
from trtllm_dflash.runtime.reference import ReferenceRuntime
from trtllm_dflash.runtime.sampling import SamplingParams

PROMPTS = [list(range(10, 30)), list(range(100, 112)), [5, 9, 5, 9, 5, 9, 5]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("qpair")
    config = tiny_target_config()
    save_random_target(root / "target", config, seed=8)
    save_random_drafter(root / "drafter", drafter_config_for(config, block_size=4), seed=9)
    return root


def run(target_dir, drafter_dir, max_tokens=24):
    target = GptOssTarget(load_hf_gpt_oss(target_dir))
    runtime = ReferenceRuntime(target, DFlashProposer(load_drafter(drafter_dir), target))
    return runtime, [r.output_token_ids for r in runtime.generate(PROMPTS, SamplingParams(max_tokens=max_tokens), 3)]


def test_hooks_record_the_largest_input_of_each_layer(pair):
    runtime, _ = run(pair / "target", pair / "drafter", max_tokens=6)
    target, drafter = runtime.target, runtime.proposer.drafter
    amax = calibrate([target.hf, drafter], lambda: runtime.generate(PROMPTS, SamplingParams(max_tokens=6), 3))
    # Layer 0's q_proj input is the input-normed embedding of every token the target saw.
    with torch.no_grad():
        seen = torch.tensor(sorted({t for p in PROMPTS for t in p} | set(range(target.vocab_size))))
        normed = target.hf.model.layers[0].input_layernorm(target.embed(seen))
    assert amax["model.layers.0.self_attn.q_proj.weight"] <= float(normed.abs().max()) + 1e-6
    assert amax["model.layers.0.self_attn.q_proj.weight"] > 0
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj",
                 "fc.weight", "layers.0.mlp.down_proj.weight"):
        assert amax[name] > 0, name
    fp8 = for_recipe(amax, "fp8")
    assert "model.lm_head.weight" not in fp8 and "lm_head.weight" not in fp8  # excluded by every recipe
    assert "model.layers.0.mlp.router.weight" not in fp8


# Teacher-forced top-1 agreement with the unquantized target, and relative logit error (Frobenius),
# on 4 x 40 random tokens. Random tiny targets amplify weight noise (MoE routing flips), so these
# bounds are loose next to a trained model's; they still catch a wrong scale or layout.
BOUNDS = {"fp8": (0.85, 0.12), "nvfp4": (0.65, 0.22)}


@pytest.mark.parametrize("recipe", sorted(BOUNDS))
def test_quantized_pair_round_trips_into_the_runtime(pair, tmp_path, recipe):
    runtime, _ = run(pair / "target", pair / "drafter", max_tokens=6)
    amax = calibrate([runtime.target.hf, runtime.proposer.drafter],
                     lambda: runtime.generate(PROMPTS, SamplingParams(max_tokens=6), 3))
    # the target gets the recipe's gpt-oss variant (nvfp4: NVFP4 experts, which need input amax)
    target_amax = {k: v for k, v in for_recipe(amax, recipe, model_type="gpt_oss").items() if k.startswith("model.")}
    drafter_amax = {k: v for k, v in for_recipe(amax, recipe).items() if not k.startswith("model.")}
    if recipe == "nvfp4":
        assert target_amax and all(".mlp.experts." in k for k in target_amax)
    convert_checkpoint(pair / "target", tmp_path / "target", recipe, input_amax=target_amax, progress=False)
    convert_checkpoint(pair / "drafter", tmp_path / "drafter", recipe, input_amax=drafter_amax, progress=False)
    quant_config = json.loads((tmp_path / "target" / "hf_quant_config.json").read_text())
    assert quant_config["quantization"]["quant_algo"] == {"fp8": "FP8", "nvfp4": "NVFP4"}[recipe]

    tokens = torch.randint(0, 256, (4, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = runtime.target.hf(tokens).logits
        quantized_runtime, outputs = run(tmp_path / "target", tmp_path / "drafter")
        logits = quantized_runtime.target.hf(tokens).logits
    agreement = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    error = ((logits - reference).norm() / reference.norm()).item()
    min_agreement, max_error = BOUNDS[recipe]
    assert agreement >= min_agreement and error <= max_error, (agreement, error)
    baseline = ReferenceRuntime(quantized_runtime.target, None).generate(PROMPTS, SamplingParams(max_tokens=24), 3)
    assert outputs == [r.output_token_ids for r in baseline]  # lossless on the quantized pair itself
