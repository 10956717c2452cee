"""Backend choice, and the reference runtime on a target stored exactly as gpt-oss ships (MXFP4)."""

from __future__ import annotations

import pytest
import torch

from trtllm_dflash.errors import InputError
from trtllm_dflash.runtime.interface import check_request, choose_backend


@pytest.mark.parametrize("requested,importable,capability,expected", [
    ("auto", True, (10, 0), "trtllm"),
    ("auto", True, (9, 0), "trtllm"),
    ("auto", True, (8, 9), "reference"),
    ("auto", True, None, "reference"),
    ("auto", False, (10, 0), "reference"),
    ("reference", True, (10, 0), "reference"),
    ("trtllm", False, None, "trtllm"),  # asked for explicitly: its own error explains what is missing
])
def test_backend_choice(requested, importable, capability, expected):
    chosen, reason = choose_backend(requested, trtllm_importable=importable, capability=capability)
    assert chosen == expected and reason


def test_backend_choice_rejects_unknown_and_bad_requests():
    with pytest.raises(InputError, match="--backend"):
        choose_backend("vllm")
    with pytest.raises(InputError, match="batch_size"):
        check_request([[1]], 0)
    with pytest.raises(InputError, match="empty"):
        check_request([[]], 1)
    with pytest.raises(InputError, match="outside"):
        check_request([[5, 300]], 1, vocab_size=258)
    with pytest.raises(InputError, match="outside"):
        check_request([[5, -1]], 1, vocab_size=258)
    check_request([[1, 2]], 1, max_tokens=4094, max_positions=4096)
    with pytest.raises(InputError, match="max_position_embeddings"):
        check_request([[1, 2]], 1, max_tokens=4095, max_positions=4096)


def test_mxfp4_target_is_lossless(tmp_path):
    """A target exported with MXFP4 experts (gpt-oss layout) loads through transformers' dequantizer,
    and speculative greedy output equals transformers' own generate on the loaded model."""
    from trtllm_dflash.checkpoints.gpt_oss import load_hf_gpt_oss
    from trtllm_dflash.models.random_pair import (
        drafter_config_for, random_drafter, random_target, save_byte_tokenizer, tiny_target_config)
    from trtllm_dflash.models.target import GptOssTarget
    from trtllm_dflash.runtime.proposers import DFlashProposer
    from trtllm_dflash.runtime.reference import ReferenceRuntime
    from trtllm_dflash.runtime.sampling import SamplingParams
    from trtllm_dflash.train.target import export

    config = tiny_target_config(hidden_size=64, intermediate_size=64)
    save_byte_tokenizer(tmp_path / "tok")
    export(random_target(config, seed=3), tmp_path / "tok", tmp_path / "target")
    hf = load_hf_gpt_oss(tmp_path / "target")
    assert "gate_up_proj_blocks" in (tmp_path / "target" / "model.safetensors").read_bytes()[:20000].decode("latin1")
    target = GptOssTarget(hf)
    drafter = random_drafter(drafter_config_for(config), seed=4)
    prompts = [list(range(5, 5 + n)) for n in (3, 11, 30)]
    results = ReferenceRuntime(target, DFlashProposer(drafter, target)).generate(
        prompts, SamplingParams(max_tokens=20), batch_size=3)
    with torch.no_grad():
        for prompt, result in zip(prompts, results):
            expected = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                   max_new_tokens=20, do_sample=False, eos_token_id=None,
                                   pad_token_id=config.pad_token_id)[0, len(prompt):].tolist()
            assert result.output_token_ids == expected
