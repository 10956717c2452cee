"""Shared fixtures: tiny random gpt-oss targets and DFlash drafters saved in their real layouts."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from trtllm_dflash.models.random_pair import (  # noqa: E402
    drafter_config_for,
    random_drafter,
    random_target,
    save_byte_tokenizer,
    save_random_drafter,
    save_random_target,
    tiny_target_config,
)
from trtllm_dflash.models.target import GptOssTarget  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target_dir, drafter_dir): 4-layer target (sliding window 8), 1-layer drafter, block 4, byte tokenizer."""
    root = tmp_path_factory.mktemp("tiny_pair")
    config = tiny_target_config()
    save_random_target(root / "target", config, seed=1)
    save_byte_tokenizer(root / "target")
    save_random_drafter(root / "drafter", drafter_config_for(config, block_size=4), seed=2)
    return root / "target", root / "drafter"


@pytest.fixture(scope="session")
def random_pair():
    """(target, drafter, 16 prompts of 2-29 tokens, transformers' greedy 24 tokens for each): vocabulary 24, block 4."""
    config = tiny_target_config(vocab_size=24, eos_token_id=23)
    hf = random_target(config, 31).float()
    drafter = random_drafter(drafter_config_for(config, block_size=4), 32)
    gen = torch.Generator().manual_seed(33)
    lengths = torch.randint(2, 30, (16,), generator=gen).tolist()
    prompts = [torch.randint(0, 23, (n,), generator=gen).tolist() for n in lengths]
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                max_new_tokens=24, do_sample=False, eos_token_id=None,
                                pad_token_id=config.pad_token_id)[0, len(p):].tolist() for p in prompts]
    return GptOssTarget(hf), drafter, prompts, expected


@pytest.fixture(scope="session")
def embedded_pair():
    """(target, drafter, 8 held-out prompts, transformers' greedy 32 tokens for each): the embedded pair, float32."""
    from trtllm_dflash.checkpoints.gpt_oss import load_hf_gpt_oss
    from trtllm_dflash.embedded import heldout_prompts, pair_paths
    from trtllm_dflash.models.drafter import load_drafter
    from trtllm_dflash.prompts import prompt_token_ids

    target_dir, drafter_dir = pair_paths()
    hf = load_hf_gpt_oss(target_dir, torch.device("cpu"), torch.float32)
    prompts = prompt_token_ids(heldout_prompts(8), target_dir)
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                max_new_tokens=32, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    return GptOssTarget(hf), load_drafter(drafter_dir, torch.device("cpu"), torch.float32), prompts, expected
