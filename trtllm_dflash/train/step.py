"""One training step of the DFlash drafter: what a batch of sequences and anchors computes.

Attention (`training_mask`): a block sees context strictly before its anchor (within the drafter's
context window), its own block bidirectionally, and never another block. Block slot k predicts
x_{anchor+k}; the loss weights slot k by exp(-(k-1)/gamma). `RecordingProposer` records what the
runtime's own proposer drafts, to compare the two (the training forward equals the runtime's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.drafter import DFlashDrafter
from ..models.target import GptOssTarget
from ..plugins.draft_block.reference import context_visibility
from ..runtime.proposers import DFlashProposer
from .anchors import walk_anchors
from .data import target_features, target_outputs


def training_mask(anchors: torch.Tensor, block_size: int, seq_len: int,
                  sliding_window: int | None = None) -> torch.Tensor:
    """Visibility [N, A*B, L + A*B] for queries = all blocks, keys = [context | all blocks]:
    context position p is visible to block j iff p < anchor_j (and, with a window W, slot k sees only
    p > anchor_j + k - W, as at runtime); block keys only within their block."""
    n, a = anchors.shape
    block_of_query = torch.arange(a).repeat_interleave(block_size)  # [A*B]
    # the runtime's per-slot visibility, with each block's anchor as its context length
    context = context_visibility(anchors.flatten(), block_size, seq_len, sliding_window).reshape(n, a * block_size, -1)
    same_block = block_of_query[:, None] == block_of_query[None, :]  # [A*B, A*B]
    return torch.cat([context, same_block.expand(n, -1, -1)], dim=-1)


def block_inputs(sequences: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """Block tokens [N, A*B] (anchor then masks), their positions, and labels x_{anchor+k}."""
    offsets = torch.arange(block_size)
    positions = (anchors[:, :, None] + offsets).flatten(1)
    tokens = torch.full_like(positions, mask_token_id)
    tokens[:, ::block_size] = sequences.gather(1, anchors)
    labels = sequences.gather(1, positions)
    return tokens, positions, labels


def drafter_hidden(drafter: DFlashDrafter, target: GptOssTarget, sequences: torch.Tensor,
                   anchors: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
    """The training forward: final-normed drafter hidden states [n, A*B, H] of the blocks anchored
    at `anchors` [n, A] (the frozen target runs the clean sequences once for the features, unless
    they are given, e.g. precomputed by `--cache-features`)."""
    cfg = drafter.config
    b = cfg.block_size
    n, seq_len = sequences.shape
    with torch.no_grad():
        positions = torch.arange(seq_len, device=sequences.device).expand(n, -1)
        if features is None:
            features = target_features(target, sequences, cfg.target_layer_ids)
        tokens, block_positions, _ = block_inputs(sequences, anchors, b, cfg.mask_token_id)
        embeds = target.embed(tokens)
    mask = training_mask(anchors.cpu(), b, seq_len, cfg.sliding_window).to(sequences.device)
    return drafter.forward_train(features.clone(), positions, embeds.clone(), block_positions, mask)


def drafter_block_logits(drafter: DFlashDrafter, target: GptOssTarget, sequences: torch.Tensor,
                         anchors: torch.Tensor) -> torch.Tensor:
    """Training-mode logits of slots 1..B-1 [n, A, B-1, V]; slot k predicts x_{anchor+k}. The
    runtime's DFlashProposer yields the same logits for the same anchor (tested)."""
    b = drafter.config.block_size
    with torch.no_grad():
        hidden = drafter_hidden(drafter, target, sequences, anchors)
        hidden = hidden.view(*anchors.shape, b, -1)[:, :, 1:]
        return target.lm_head(hidden.to(target.dtype))


class _LogitTap:
    """Stands in for the target inside a DFlashProposer and keeps every block's drafter logits."""

    def __init__(self, target: GptOssTarget):
        self.target, self.logits = target, []

    @property
    def dtype(self) -> torch.dtype:
        return self.target.dtype

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.target.embed(tokens)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.target.lm_head(hidden)
        self.logits.append(logits.clone())
        return logits


class RecordingProposer(DFlashProposer):
    """The runtime's DFlashProposer, unchanged, plus a record of every drafted block: the anchor
    positions [b] (`positions`) and the drafter's logits [b, B-1, V] (`logits`), step by step. What
    `drafter_block_logits` is compared with (tests/test_train_drafter.py, benchmarks/diag_*)."""

    def __init__(self, drafter: DFlashDrafter, target: GptOssTarget):
        self.tap = _LogitTap(target)
        super().__init__(drafter, self.tap)
        self.positions: list[torch.Tensor] = []

    @property
    def logits(self) -> list[torch.Tensor]:
        return self.tap.logits

    def propose(self, anchors, anchor_positions, history, num_drafts, params, generator):
        self.positions.append(anchor_positions.clone())
        return super().propose(anchors, anchor_positions, history, num_drafts, params, generator)


def drafter_loss(drafter: DFlashDrafter, target: GptOssTarget, sequences: torch.Tensor, anchors: torch.Tensor,
                 gamma: float, features: torch.Tensor | None = None, walk: bool = False,
                 distill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weighted block loss and, with `walk`, where the runtime would draft after each block
    ([n, A], :func:`walk_anchors` of this forward's greedy drafts; no gradient), else None.

    Per drafted slot the loss is cross-entropy on the sequence's token, or with `distill` = a in (0, 1]
    (1 - a) times that plus a times KL(target || drafter): the divergence of the drafter's distribution
    from the target's own next-token distribution at that position (knowledge distillation, as
    DistillSpec does for draft models). The target's logits come from the forward that gives its
    features, so `distill` needs `features` None."""
    b = drafter.config.block_size
    n = sequences.shape[0]
    teacher = None
    if distill:
        if features is not None:
            raise ValueError("distillation needs the target's logits: run its forward, not cached features")
        with torch.no_grad():
            teacher, features = target_outputs(target, sequences, drafter.config.target_layer_ids)
    hidden = drafter_hidden(drafter, target, sequences, anchors, features)
    _, block_positions, labels = block_inputs(sequences, anchors, b, drafter.config.mask_token_id)
    slots = torch.arange(hidden.shape[1], device=hidden.device) % b != 0  # slot 0 (anchor) has no loss
    logits = target.lm_head(hidden[:, slots].to(target.dtype))
    k = (torch.arange(1, b, device=hidden.device)).repeat(anchors.shape[1])
    weights = torch.exp(-(k - 1) / gamma).expand(n, -1)
    losses = F.cross_entropy(logits.flatten(0, 1), labels[:, slots].flatten(), reduction="none").view(n, -1)
    if teacher is not None:  # the target's logits at position p - 1 predict the token at p
        previous = (block_positions[:, slots] - 1)[..., None].expand(-1, -1, teacher.shape[-1])
        log_target = torch.log_softmax(teacher.gather(1, previous).float(), dim=-1)
        divergence = F.kl_div(torch.log_softmax(logits.float(), dim=-1), log_target, reduction="none",
                              log_target=True).sum(-1)
        losses = (1 - distill) * losses + distill * divergence
    loss = (losses * weights).sum() / weights.sum()
    if not walk:
        return loss, None
    with torch.no_grad():
        correct = (logits.argmax(dim=-1) == labels[:, slots]).view(n, anchors.shape[1], b - 1)
    return loss, walk_anchors(anchors, correct)
