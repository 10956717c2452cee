"""Shared fixtures: tiny random gpt-oss targets and DFlash drafters saved in their real layouts."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from trtllm_dflash.models.random_pair import (  # noqa: E402
    drafter_config_for,
    save_byte_tokenizer,
    save_random_drafter,
    save_random_target,
    tiny_target_config,
)

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
