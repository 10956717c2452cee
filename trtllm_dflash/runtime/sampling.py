"""Turning logits into the distribution a request samples from (temperature, top-k, top-p).

The same function shapes the target's and the drafter's distributions, so speculative sampling
verifies against exactly the distribution plain sampling would use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    seed: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self):
        checks = [
            (self.max_tokens >= 1, "max_tokens", "at least 1"),
            (0 <= self.temperature < math.inf, "temperature", "finite and >= 0"),
            (0 < self.top_p <= 1, "top_p", "in (0, 1]"),
            (self.top_k >= 0, "top_k", ">= 0"),
        ]
        for ok, name, expected in checks:
            if not ok:
                raise InputError(f"expected {expected}, got {getattr(self, name)!r}.", field=name)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> the first index of each row's maximum [...]: argmax's answer, read off
    `max(dim)` because on CPU argmax along a 4096-wide row takes 2.5x as long (50 us against 20 for a
    block of 7 rows, docs/benchmarks.md round 7), as long as an AR step's attention."""
    return logits.max(dim=-1).indices


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] after temperature, top-k, then top-p (HF's order)."""
    logits = logits.float()
    # shifted first, so a tiny temperature gives 0 / T = 0 at the top and -inf below it (a one-hot),
    # where logits / T would overflow to inf and the softmax to NaN
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)
