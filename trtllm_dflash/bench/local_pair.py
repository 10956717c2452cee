"""The pair a benchmark script measures in this process: the embedded one where `--target` or
`--drafter` name no other, loaded float32 on the CPU for the reference runtime, with the embedded
held-out prompts tokenized (the first `--prompts` of them)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoints.gpt_oss import load_hf_gpt_oss
from ..models.drafter import DFlashDrafter, load_drafter
from ..models.target import GptOssTarget


def add_pair_arguments(parser: argparse.ArgumentParser, prompts: int = 16, max_tokens: int = 128) -> None:
    """--target/--drafter (default: the embedded pair), --prompts, --max-tokens and --threads (torch's intra-op)."""
    parser.add_argument("--target", type=Path, help="gpt-oss checkpoint directory (default: the embedded target)")
    parser.add_argument("--drafter", type=Path, help="DFlash drafter directory (default: the embedded drafter)")
    parser.add_argument("--prompts", type=int, default=prompts, help="how many held-out prompts")
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--threads", type=int, default=1)


@dataclass
class LocalPair:
    target_dir: Path
    drafter_dir: Path
    target: GptOssTarget
    drafter: DFlashDrafter
    prompts: list[list[int]]  # token ids


def load_local_pair(args: argparse.Namespace) -> LocalPair:
    """Sets torch's thread count to --threads, then loads what `add_pair_arguments` names."""
    from ..embedded import PROMPTS_FILE, pair_paths
    from ..prompts import prompt_token_ids, read_prompts_file

    torch.set_num_threads(args.threads)
    target_dir, drafter_dir = args.target, args.drafter
    if target_dir is None or drafter_dir is None:
        embedded = pair_paths()
        target_dir, drafter_dir = target_dir or embedded[0], drafter_dir or embedded[1]
    prompts = prompt_token_ids(read_prompts_file(PROMPTS_FILE)[: args.prompts], target_dir)
    return LocalPair(target_dir, drafter_dir, GptOssTarget(load_hf_gpt_oss(target_dir, "cpu", torch.float32)),
                     load_drafter(drafter_dir, "cpu", torch.float32), prompts)
