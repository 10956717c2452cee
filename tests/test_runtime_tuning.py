"""Start-up choices of the reference runtime (`runtime/tuning.py`): the experts' storage."""

from __future__ import annotations

import pytest
import torch

from trtllm_dflash.errors import InputError
from trtllm_dflash.models.random_pair import random_target, tiny_target_config
from trtllm_dflash.models.target import GptOssTarget
from trtllm_dflash.runtime import tuning


@pytest.fixture
def two_storages() -> GptOssTarget:
    """A tiny target whose experts bf16 holds exactly, as MXFP4 ones: float32 originals, bf16 copies and,
    where fbgemm runs, float16 ones."""
    hf = random_target(tiny_target_config(num_layers=2, experts=4, top_k=2), seed=2).float()
    with torch.no_grad():
        for layer in hf.model.layers:
            for weight in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                weight.copy_(weight.bfloat16().float())
    return GptOssTarget(hf)


def test_timing_covers_each_storage_and_leaves_the_target_as_it_was(two_storages):
    two_storages.use_expert_storage("bfloat16")
    relative = tuning.time_expert_storages(two_storages, batch=2, block=4, context=16, rounds=3)
    assert list(relative) == list(two_storages.expert_storages) and relative["float32"] == 1.0
    assert all(r > 0 for r in relative.values()) and len(relative) >= 2
    assert two_storages.expert_storage == "bfloat16"


def test_timing_rounds_decode_fresh_tokens_the_same_for_every_storage(two_storages):
    """Each round's steps route other tokens (decoding's experts are not the last step's), and every
    storage in a round gets that round's tokens (the ratios stay paired)."""
    seen = []
    two_storages.register_forward_pre_hook(
        lambda module, args: seen.append((module.expert_storage, args[0].shape[1], args[0].clone())))
    tuning.time_expert_storages(two_storages, batch=1, block=4, context=16, rounds=3, warm_up=1)
    names, steps = list(two_storages.expert_storages), [s for s in seen if s[1] == 4]  # the verify blocks
    assert len(steps) == 4 * len(names)
    rounds = [steps[i: i + len(names)] for i in range(0, len(steps), len(names))]
    for steps_of_round in rounds:
        assert [name for name, _, _ in steps_of_round] == names
        assert all(torch.equal(tokens, steps_of_round[0][2]) for _, _, tokens in steps_of_round)
    assert len({tuple(r[0][2].flatten().tolist()) for r in rounds}) == len(rounds)


@pytest.mark.parametrize("faster", ["float32", "bfloat16", "float16"])
def test_auto_keeps_the_faster_storage(two_storages, monkeypatch, faster):
    if faster not in two_storages.expert_storages:
        pytest.skip("this torch build has no fbgemm (not x86): no float16 copies")
    timed = {name: 2.0 for name in two_storages.expert_storages} | {faster: 1.0}
    monkeypatch.setattr(tuning, "time_expert_storages", lambda target, batch, block: timed)
    assert tuning.choose_expert_storage(two_storages, "auto", 1, 8) == timed
    assert two_storages.expert_storage == faster


def test_a_named_storage_is_used_without_timing_and_a_missing_one_is_refused(two_storages, monkeypatch):
    monkeypatch.setattr(tuning, "time_expert_storages", lambda *args: pytest.fail("nothing to time"))
    for storage in reversed(two_storages.expert_storages):
        assert tuning.choose_expert_storage(two_storages, storage, 1, 8) is None
        assert two_storages.expert_storage == storage
    single = GptOssTarget(random_target(tiny_target_config(num_layers=2, experts=4, top_k=2)).float())
    assert tuning.choose_expert_storage(single, "auto", 1, 8) is None  # random float32 experts: one storage
    with pytest.raises(InputError) as refused:
        tuning.choose_expert_storage(single, "bfloat16", 1, 8)
    assert refused.value.field == "--expert-dtype" and "float32" in str(refused.value)
