"""The drafter's math against transformers' Qwen3 layer and the §2.5 formula; loading conventions."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

from draft_block_cases import drafter_plain_and_plugin

from trtllm_dflash.errors import InputError
from trtllm_dflash.models.drafter import load_drafter, save_drafter
from trtllm_dflash.models.drafter_config import DFlashConfig, default_target_layer_ids
from trtllm_dflash.models.random_pair import drafter_config_for, random_drafter, random_target, tiny_target_config
from trtllm_dflash.models.target import GptOssTarget


@pytest.fixture(scope="module")
def drafter():
    return random_drafter(drafter_config_for(tiny_target_config(), num_layers=2, block_size=5), seed=3, std=0.1)


def test_layer_matches_transformers_qwen3_without_context(drafter):
    """With no context the drafter layer is a Qwen3 decoder layer with bidirectional attention
    (checks YaRN RoPE, QK-norm, biases, SwiGLU)."""
    cfg = drafter.config
    qcfg = Qwen3Config(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                       num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                       head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, attention_bias=True,
                       rope_theta=cfg.rope_theta, rope_scaling=cfg.rope_scaling, num_hidden_layers=1,
                       max_position_embeddings=cfg.max_position_embeddings)
    qcfg._attn_implementation = "eager"
    layer = Qwen3DecoderLayer(qcfg, 0).eval()
    layer.load_state_dict(drafter.layers[0].state_dict())
    x = torch.randn(2, 5, cfg.hidden_size)
    positions = torch.tensor([[7, 8, 9, 10, 11], [300, 301, 302, 303, 304]])
    with torch.no_grad():
        expected = layer(x, attention_mask=None, position_ids=positions,
                         position_embeddings=Qwen3RotaryEmbedding(qcfg)(x, positions))
    # Run only layer 0 through our forward by wrapping it in a one-layer drafter.
    one = random_drafter(DFlashConfig(**{**cfg.__dict__, "num_hidden_layers": 1}), seed=0)
    one.layers[0].load_state_dict(drafter.layers[0].state_dict())
    cache = one.new_cache(2, 16)
    got = one(x, positions, cache, torch.zeros(2, dtype=torch.long))  # the layer, then the final norm
    expected = expected[0] if isinstance(expected, tuple) else expected
    torch.testing.assert_close(got, one.norm(expected), rtol=1e-5, atol=1e-5)


def test_cached_context_equals_kv_injection_formula(drafter):
    """Context K/V written once and read from the cache == recomputing K/V over concat(T, x)."""
    cfg = drafter.config
    n, width = 6, cfg.block_size
    features = torch.randn(1, n, len(cfg.target_layer_ids) * cfg.hidden_size)
    block = torch.randn(1, width, cfg.hidden_size)
    ctx_pos, blk_pos = torch.arange(n)[None], torch.arange(n, n + width)[None]
    cache = drafter.new_cache(1, n + width)
    drafter.write_context(features[:, :4], ctx_pos[:, :4], cache)  # two separate commits
    drafter.write_context(features[:, 4:], ctx_pos[:, 4:], cache)
    got = drafter(block, blk_pos, cache, torch.tensor([n]))

    with torch.no_grad():
        fused = drafter.hidden_norm(drafter.fc(features))
        all_pos = torch.cat([ctx_pos, blk_pos], dim=1)
        cos, sin = drafter.rotary(all_pos, fused.dtype)
        x = block
        for layer in drafter.layers:
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            both = torch.cat([fused, h], dim=1)
            k, v = attn.keys_values(both, cos, sin)
            q = attn.query(h, cos[:, n:], sin[:, n:])
            k = k.repeat_interleave(cfg.num_attention_heads // cfg.num_key_value_heads, dim=1)
            v = v.repeat_interleave(cfg.num_attention_heads // cfg.num_key_value_heads, dim=1)
            out = torch.softmax(q @ k.transpose(-1, -2) * cfg.head_dim ** -0.5, dim=-1) @ v
            x = x + attn.o_proj(out.transpose(1, 2).flatten(2))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        expected = drafter.norm(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_target_features_are_layer_outputs():
    """Target layer id i = output of decoder layer i = transformers' hidden_states[i + 1]."""
    hf = random_target(tiny_target_config(), seed=4).float()
    target = GptOssTarget(hf)
    tokens = torch.randint(0, 256, (1, 12))
    _, features = target(tokens, torch.arange(12)[None], target.new_cache(1, 12), [2, 0])
    with torch.no_grad():
        hidden = hf(tokens, output_hidden_states=True).hidden_states
    torch.testing.assert_close(features, torch.cat([hidden[3], hidden[1]], dim=-1), rtol=1e-5, atol=1e-5)


def test_target_adapter_lives_on_the_models_device():
    """Everything the adapter adds (RoPE tables) follows the model's device: on the meta device
    here, so a CPU-only run catches what would be a CPU/CUDA mismatch on a GPU."""
    target = GptOssTarget(random_target(tiny_target_config(), 0).to("meta"))
    assert {t.device.type for t in (*target.parameters(), *target.buffers())} == {"meta"}


def test_default_target_layer_ids_match_published_drafters():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(24, 5) == [1, 6, 11, 16, 21]
    assert default_target_layer_ids(36, 1) == [18]


def test_zlab_layout_round_trip_with_model_prefix(drafter, tmp_path):
    save_drafter(drafter, tmp_path / "plain")
    raw = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert raw["block_size"] == 5 and raw["dflash_config"]["target_layer_ids"] == drafter.config.target_layer_ids
    assert DFlashConfig.from_dict(raw) == drafter.config
    prefixed = tmp_path / "prefixed"
    prefixed.mkdir()
    (prefixed / "config.json").write_text(json.dumps(raw))
    save_file({"model." + k: v.contiguous() for k, v in drafter.state_dict().items()}, prefixed / "model.safetensors")
    loaded = load_drafter(prefixed)
    for name, value in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value)


def test_published_gpt_oss_120b_config_parses():
    raw = {"architectures": ["DFlashDraftModel"], "hidden_size": 2880, "num_hidden_layers": 8,
           "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 7680,
           "attention_bias": True, "rms_norm_eps": 1e-5, "block_size": 10, "num_target_layers": 36,
           "dflash_config": {"mask_token_id": 200000, "target_layer_ids": [1, 9, 17, 25, 33]},
           "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0,
                                                  "original_max_position_embeddings": 4096},
           "vocab_size": 201088, "model_type": "qwen3"}
    cfg = DFlashConfig.from_dict(raw)
    assert cfg.mask_token_id == 200000 and cfg.block_size == 10
    assert cfg.to_dict()["dflash_config"] == raw["dflash_config"]
    with pytest.raises(InputError, match="dflash_config.mask_token_id"):
        DFlashConfig.from_dict({k: v for k, v in raw.items() if k != "dflash_config"})


@pytest.mark.parametrize("context_lens", [[12, 0, 7], [9]])
def test_plugin_switch_matches_plain_path(drafter, context_lens):
    """The drafter's block attention through the draft-block custom op equals the plain path,
    with ragged contexts (including an empty one) in one batch, and for a single request (whose
    op output is a non-contiguous view on CPU)."""
    plain, plugged = drafter_plain_and_plugin(drafter, context_lens, context=12)
    torch.testing.assert_close(plugged, plain, rtol=1e-5, atol=1e-5)
