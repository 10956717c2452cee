"""The drafter's context window (`sliding_window`): config spellings, runtime, kernel reference, training."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from trtllm_dflash.checkpoints.gpt_oss import load_hf_gpt_oss
from trtllm_dflash.errors import InputError
from trtllm_dflash.models.drafter import DFlashDrafter, load_drafter, save_drafter
from trtllm_dflash.models.drafter_config import DFlashConfig
from trtllm_dflash.models.random_pair import (drafter_config_for, random_drafter, save_random_target,
                                             tiny_target_config)
from trtllm_dflash.models.target import GptOssTarget
from trtllm_dflash.plugins.draft_block.reference import draft_block_attention_reference
from trtllm_dflash.runtime.reference import ReferenceRuntime
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.train.step import RecordingProposer, drafter_block_logits


def windowed(drafter: DFlashDrafter, window: int | None) -> DFlashDrafter:
    """The same weights with another context window."""
    out = DFlashDrafter(dataclasses.replace(drafter.config, sliding_window=window))
    out.load_state_dict(drafter.state_dict())
    return out.eval()


def block_inputs(drafter: DFlashDrafter, lens: list[int], seed: int = 0):
    """Random context K/V for ragged requests and a block per request: (cache, q, k, v, lens)."""
    cfg, b = drafter.config, drafter.config.block_size
    gen = torch.Generator().manual_seed(seed)
    cache = drafter.new_cache(len(lens), max(lens) + 4)
    features = torch.randn(len(lens), max(lens), len(cfg.target_layer_ids) * cfg.hidden_size, generator=gen)
    drafter.write_context(features, torch.arange(max(lens)).expand(len(lens), -1), cache)
    shape = (len(lens), cfg.num_attention_heads, b, cfg.head_dim)
    q = torch.randn(shape, generator=gen)
    k, v = (torch.randn(shape[0], cfg.num_key_value_heads, b, cfg.head_dim, generator=gen) for _ in range(2))
    return cache, q, k, v, torch.tensor(lens)


def windowed_attention_float64(q, k, v, ctx_k, ctx_v, lens, window, scale):
    """Slot j of request i over context p in (len_i + j - W, len_i) and its whole block, one query at a time."""
    b, hq, width, d = q.shape
    group = hq // ctx_k.shape[1]
    out = torch.zeros(b, width, hq, d, dtype=torch.float64)
    for i in range(b):
        for h in range(hq):
            for j in range(width):
                lo = max(0, int(lens[i]) + j - window + 1)
                keys = torch.cat([ctx_k[i, h // group, lo: lens[i]], k[i, h // group]]).double()
                values = torch.cat([ctx_v[i, h // group, lo: lens[i]], v[i, h // group]]).double()
                weights = (keys @ q[i, h, j].double() * scale).softmax(0)
                out[i, j, h] = weights @ values
    return out.reshape(b, width, hq * d)


def attend(drafter: DFlashDrafter, layer: int, q, k, v, cache, lens):
    """`block_attention` as the drafter's forward calls it (block k/v as [b, B, Hkv, D], its step layout)."""
    block = drafter.block_layout(lens, q.shape[2], q.dtype)
    return drafter.block_attention(layer, q, k.transpose(1, 2), v.transpose(1, 2), cache, lens, block)


@pytest.fixture(scope="module")
def drafter() -> DFlashDrafter:
    return random_drafter(drafter_config_for(tiny_target_config(), num_layers=2, block_size=4), seed=3)


def test_a_window_longer_than_every_context_changes_nothing(drafter):
    cache, q, k, v, lens = block_inputs(drafter, [5, 17, 0])
    plain = attend(drafter, 0, q, k, v, cache, lens)
    for window in (21, 64):  # 17 + 3 slots + 1: the last slot still sees position 0
        torch.testing.assert_close(attend(windowed(drafter, window), 0, q, k, v, cache, lens), plain)
    assert not torch.allclose(attend(windowed(drafter, 8), 0, q, k, v, cache, lens), plain)


def test_long_contexts_match_a_float64_reference_and_the_kernel_reference(drafter):
    small = windowed(drafter, 6)
    cache, q, k, v, lens = block_inputs(small, [40, 3, 23], seed=1)
    got = attend(small, 1, q, k, v, cache, lens)
    ctx_k, ctx_v = cache.k[1], cache.v[1]
    expected = windowed_attention_float64(q, k, v, ctx_k, ctx_v, lens, 6, small.scale)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    b, hq, width, d = q.shape

    def packed(x):
        return x.transpose(1, 2).reshape(b * width, x.shape[1], d)

    kernel = draft_block_attention_reference(*(packed(x.double()) for x in (q, k, v)), ctx_k.double(), ctx_v.double(),
                                             lens, small.scale, 6)
    torch.testing.assert_close(kernel.reshape(b, width, hq * d), expected, rtol=1e-9, atol=1e-9)
    small.use_plugin = True  # the drafter's plugin path (the custom op) passes its window on
    torch.testing.assert_close(attend(small, 1, q, k, v, cache, lens), got, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 23, 22])
def test_a_lone_request_needs_no_mask_until_its_window_cuts(drafter, window):
    """Batch 1: no mask while every slot sees the whole context (19 + 4 slots <= window); once the
    window cuts it, the mask is back. The block goes to one span just past the context either way,
    and the float64 reference holds."""
    small = windowed(drafter, window)
    cache, q, k, v, lens = block_inputs(small, [19], seed=4)
    block = small.block_layout(lens, q.shape[2], q.dtype)
    assert block.length == 23 and (block.mask is None) == (window != 22) and block.slots == 19
    expected = windowed_attention_float64(q, k, v, cache.k[0], cache.v[0], lens, window or 10**6, small.scale)
    torch.testing.assert_close(attend(small, 0, q, k, v, cache, lens).double(), expected, rtol=1e-5, atol=1e-5)


def test_training_forward_gives_the_windowed_runtime_logits(tmp_path):
    """Contexts run well past the window: the training mask's window is the runtime's, slot by slot."""
    config = tiny_target_config()
    target = GptOssTarget(load_hf_gpt_oss(save_random_target(tmp_path / "target", config, seed=1)))
    drafter = windowed(random_drafter(drafter_config_for(config, num_layers=2, block_size=4), seed=2), 7)
    prompts = [torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (19, 30)]
    proposer = RecordingProposer(drafter, target)
    results = ReferenceRuntime(target, proposer).generate(prompts, SamplingParams(max_tokens=20), batch_size=2)
    for row, (prompt, result) in enumerate(zip(prompts, results)):
        sequence = torch.tensor([prompt + result.output_token_ids + [0] * 4])
        anchors = [int(p[row]) for p in proposer.positions if row < len(p)]
        runtime = torch.stack([logits[row] for p, logits in zip(proposer.positions, proposer.logits) if row < len(p)])
        trained = drafter_block_logits(drafter, target, sequence, torch.tensor([anchors]))[0]
        torch.testing.assert_close(trained, runtime, rtol=1e-4, atol=1e-4)
    plain = drafter_block_logits(windowed(drafter, None), target, sequence, torch.tensor([anchors]))[0]
    assert not torch.allclose(plain, runtime, atol=1e-3)  # the window did bind


def test_both_upstream_spellings_load_and_ours_writes_both(tmp_path, drafter):
    directory = save_drafter(windowed(drafter, 12), tmp_path / "ours")
    raw = json.loads((directory / "config.json").read_text())
    assert raw["sliding_window"] == 12 and raw["layer_types"] == ["sliding_attention"] * 2
    assert raw["is_causal"] is False  # z-lab's sliding layers are causal in the block unless told otherwise
    assert raw["dflash_config"]["use_swa"] is True and raw["dflash_config"]["swa_window_size"] == 12
    assert load_drafter(directory).config.sliding_window == 12
    plain = {k: v for k, v in raw.items() if k not in ("sliding_window", "layer_types", "is_causal",
                                                       "use_sliding_window", "max_window_layers")}
    plain["dflash_config"] = {k: raw["dflash_config"][k] for k in ("mask_token_id", "target_layer_ids")}
    assert DFlashConfig.from_dict(plain).sliding_window is None
    zlab = {**plain, "sliding_window": 12, "layer_types": ["sliding_attention"] * 2, "is_causal": False}
    trtllm = {**plain, "dflash_config": {**plain["dflash_config"], "use_swa": True, "swa_window_size": 12}}
    assert DFlashConfig.from_dict(zlab).sliding_window == DFlashConfig.from_dict(trtllm).sliding_window == 12
    assert DFlashConfig.from_dict({**plain, "sliding_window": 12}).sliding_window is None  # no sliding layers
    for bad, field in [
        ({**zlab, "is_causal": True}, "is_causal"),
        ({**zlab, "layer_types": ["sliding_attention"]}, "layer_types"),
        ({**zlab, "layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ({**zlab, "sliding_window": 0}, "sliding_window"),
        ({**zlab, "dflash_config": trtllm["dflash_config"] | {"swa_window_size": 9}}, "swa_window_size"),
    ]:
        with pytest.raises(InputError, match=field):
            DFlashConfig.from_dict(bad)
