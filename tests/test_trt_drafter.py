"""The real drafter exported as one ONNX step with plugin nodes; numerics in onnxruntime (CPU)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from trtllm_dflash.models.drafter import DrafterStep, load_drafter

pytest.importorskip("onnxruntime_extensions")


@pytest.mark.parametrize("window", [None, 6])
def test_drafter_step_onnx_matches_the_drafter(tiny_pair, tmp_path, window):
    import dataclasses

    from trtllm_dflash.engine.trt_drafter import export_drafter_onnx, lm_head_weight
    from trtllm_dflash.models.drafter import DFlashDrafter, save_drafter
    from trtllm_dflash.plugins.draft_block.onnx_export import plugin_nodes, run_on_cpu

    target, drafter_dir = tiny_pair
    if window is not None:  # the same weights with a context window that binds below (contexts of 20)
        plain = load_drafter(drafter_dir)
        windowed = DFlashDrafter(dataclasses.replace(plain.config, sliding_window=window))
        windowed.load_state_dict(plain.state_dict())
        drafter_dir = save_drafter(windowed, tmp_path / "windowed")
    model_path = export_drafter_onnx(drafter_dir, target, tmp_path / "drafter.onnx")
    import onnx

    model = onnx.load(str(model_path))
    drafter = load_drafter(drafter_dir)
    cfg = drafter.config
    assert len(plugin_nodes(model)) == cfg.num_hidden_layers
    for node in plugin_nodes(model):
        assert {a.name: a for a in node.attribute}["sliding_window"].i == (window or 0)

    batch, capacity = 3, 24
    gen = torch.Generator().manual_seed(0)
    cache = drafter.new_cache(batch, capacity)
    features = torch.randn(batch, 20, len(cfg.target_layer_ids) * cfg.hidden_size, generator=gen)
    drafter.write_context(features, torch.arange(20).expand(batch, -1), cache)
    lens = torch.tensor([20, 0, 9], dtype=torch.int32)
    embeds = torch.randn(batch, cfg.block_size, cfg.hidden_size, generator=gen)
    positions = lens[:, None].long() + torch.arange(cfg.block_size)
    expected = torch.nn.functional.linear(drafter(embeds, positions, cache, lens.long())[:, 1:],
                                          lm_head_weight(target))
    feeds = {"block_embeds": embeds.numpy(), "ctx_lens": lens.numpy()}
    for layer in range(cfg.num_hidden_layers):
        feeds[f"ctx_k_{layer}"], feeds[f"ctx_v_{layer}"] = cache.k[layer].numpy(), cache.v[layer].numpy()
    (logits,) = run_on_cpu(model, feeds)
    np.testing.assert_allclose(logits, expected.numpy(), rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        step = DrafterStep(drafter, lm_head_weight(target))
        torch.testing.assert_close(step(embeds, lens, *[t for layer in range(cfg.num_hidden_layers)
                                                        for t in (cache.k[layer], cache.v[layer])]), expected,
                                   rtol=1e-5, atol=1e-5)


def test_build_trt_drafter_writes_onnx_and_says_why_no_engine(tiny_pair, tmp_path):
    from trtllm_dflash.cli.build import main as build_main

    target, drafter = tiny_pair
    engine = tmp_path / "engine"
    result = CliRunner().invoke(build_main, ["--target", str(target), "--drafter", str(drafter), "-o", str(engine),
                                             "--profile", "cpu-reference", "--trt-drafter", "--quiet"])
    assert result.exit_code == 0, result.output
    assert (engine / "drafter_trt" / "drafter.onnx").is_file()
    assert not (engine / "drafter_trt" / "drafter.engine").exists()
    assert "ONNX graph only" in result.output and "tensorrt" in result.output.lower()
    manifest = json.loads((engine / "manifest.json").read_text())
    assert "drafter_trt/drafter.onnx" in manifest["files"]
