"""Draft proposers: what fills a block before the target verifies it.

A proposer sees the batch through a few calls and keeps whatever per-request state it needs:
`start` after prefill, `propose` before each verify, `commit` after it, `keep_rows` when finished
requests leave the batch. The DFlash proposer is the product; test proposers reuse the interface.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..models.drafter import DFlashDrafter
from ..models.target import GptOssTarget
from .accept import sample_from_probs
from .sampling import SamplingParams, probabilities


class Proposer(Protocol):
    num_drafts: int  # drafts per block (block_size - 1)
    feature_layers: list[int]  # target layers whose outputs the proposer consumes

    def start(self, prompts: list[list[int]], features: torch.Tensor | None, prompt_lens: torch.Tensor,
              capacity: int) -> None: ...

    def propose(self, anchors: torch.Tensor, anchor_positions: torch.Tensor, params: SamplingParams,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> draft tokens [b, K] and, when sampling, the distributions they were drawn from [b, K, V]
        (None means the drafts are deterministic: q is one-hot)."""
        ...

    def commit(self, features: torch.Tensor | None, num_accepted: torch.Tensor) -> None: ...

    def keep_rows(self, rows: torch.Tensor) -> None: ...


class DFlashProposer:
    """Block diffusion drafting with KV injection (dflash-algorithm.md §3.1-3.2).

    Invariants: after `propose`, the draft cache holds context K/V for positions [0, s) of each
    request (s = anchor position); the anchor reaches the drafter only through its embedding;
    `commit` queues the verify features of the anchor and the accepted drafts for the next call.
    """

    def __init__(self, drafter: DFlashDrafter, target: GptOssTarget, block_size: int | None = None):
        cfg = drafter.config
        self.drafter, self.target = drafter, target
        self.block_size = block_size or cfg.block_size
        self.num_drafts = self.block_size - 1
        self.feature_layers = list(cfg.target_layer_ids)
        self.mask_token_id = cfg.mask_token_id

    def start(self, prompts, features, prompt_lens, capacity):
        self.cache = self.drafter.new_cache(len(prompt_lens), capacity)
        self.context_lens = torch.zeros_like(prompt_lens)
        self.pending, self.pending_lens = features, prompt_lens.clone()

    def propose(self, anchors, anchor_positions, params, generator):
        offsets = torch.arange(self.pending.shape[1], device=anchors.device)
        self.drafter.write_context(self.pending, self.context_lens[:, None] + offsets, self.cache)
        self.context_lens += self.pending_lens
        block = torch.full((len(anchors), self.block_size), self.mask_token_id, dtype=anchors.dtype,
                           device=anchors.device)
        block[:, 0] = anchors
        positions = anchor_positions[:, None] + torch.arange(self.block_size, device=anchors.device)
        hidden = self.drafter(self.target.embed(block), positions, self.cache, self.context_lens)
        logits = self.target.lm_head(hidden[:, 1:].to(self.target.dtype))
        if params.greedy:
            return logits.argmax(dim=-1), None
        q = probabilities(logits, params)
        uniforms = torch.rand(q.shape[:-1], generator=generator, device=q.device)
        return sample_from_probs(q, uniforms), q

    def commit(self, features, num_accepted):
        self.pending, self.pending_lens = features[:, : int(num_accepted.max()) + 1], num_accepted + 1

    def keep_rows(self, rows):
        self.cache.keep_rows(rows)
        self.context_lens, self.pending, self.pending_lens = self.context_lens[rows], self.pending[rows], self.pending_lens[rows]


class NGramProposer:
    """Prompt lookup (the draft-model-free baseline TensorRT-LLM ships as NGram): find the most
    recent earlier occurrence of the sequence's last n tokens (longest n first) and propose the
    tokens that followed it. No target features, no drafter forward: its cost is a list search.
    Without a match it proposes the anchor repeated, which the target simply rejects."""

    feature_layers: list[int] = []

    def __init__(self, num_drafts: int, max_ngram: int = 3):
        self.num_drafts, self.max_ngram = num_drafts, max_ngram

    def start(self, prompts, features, prompt_lens, capacity):
        self.sequences = [list(p) for p in prompts]

    def lookup(self, sequence: list[int]) -> list[int]:
        k = self.num_drafts
        for n in range(min(self.max_ngram, len(sequence) - 1), 0, -1):
            pattern = sequence[-n:]
            for start in range(len(sequence) - n - 1, -1, -1):
                if sequence[start: start + n] == pattern:
                    follow = sequence[start + n: start + n + k]
                    return follow + [follow[-1]] * (k - len(follow))
        return [sequence[-1]] * k

    def propose(self, anchors, anchor_positions, params, generator):
        for sequence, anchor in zip(self.sequences, anchors.tolist()):
            sequence.append(anchor)
        self.drafts = [self.lookup(sequence) for sequence in self.sequences]
        return torch.tensor(self.drafts, dtype=anchors.dtype, device=anchors.device).view(len(anchors), -1), None

    def commit(self, features, num_accepted):
        for sequence, drafts, a in zip(self.sequences, self.drafts, num_accepted.tolist()):
            sequence.extend(drafts[:a])

    def keep_rows(self, rows):
        self.sequences = [self.sequences[i] for i in rows.tolist()]
