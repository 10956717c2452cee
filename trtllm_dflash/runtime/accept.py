"""Verification rules of the draft-verify loop: how many drafted tokens a request keeps.

Both rules are batched over requests and return, per request, the number of accepted drafts `a`
(0..K) and the bonus token the target adds after them, so a step commits `a + 1` tokens.

* Greedy: draft k is kept while it equals the target's argmax at the previous position.
* Sampling: standard speculative (rejection) sampling. Draft k is kept with probability
  min(1, p_k(d_k) / q_k(d_k)); the first rejected position resamples from norm(max(0, p_k - q_k));
  if every draft is kept the bonus is drawn from p_K. The committed tokens are then distributed
  exactly as the target's own samples (Leviathan et al. 2023, Chen et al. 2023).

Randomness comes in as explicit uniforms so results are reproducible and the rule can be checked
against the fused accept op of the draft-block plugin on identical inputs.
"""

from __future__ import annotations

import torch

from ..plugins.draft_block.cpu import greedy_verify_cpu, serves
from .sampling import greedy_tokens


def accepted_prefix_length(matches: torch.Tensor) -> torch.Tensor:
    """Number of leading True values per row of a [b, K] boolean tensor."""
    return matches.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def greedy_accept(draft_tokens: torch.Tensor, target_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """draft_tokens [b, K]; target_tokens [b, K+1] (target argmax after each verify position).

    Returns (num_accepted [b], bonus [b]): the bonus is the target's token at the first mismatch.
    """
    num_accepted = accepted_prefix_length(draft_tokens == target_tokens[:, :-1])
    bonus = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)
    return num_accepted, bonus


def greedy_verify_block(target, block: torch.Tensor, positions: torch.Tensor, cache, feature_layers: list[int],
                        drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The target's greedy verify of block [b, K+1] (anchors, then drafts [b, K]) at positions [b, K+1], writing its
    K/V -> (num_accepted [b], bonus [b], the features of `feature_layers`). Where the target has an exact greedy head
    (`GptOssTarget.greedy_head`: a float32 CPU target whose LM head the int8 dot GEMM takes), its argmaxes come from
    the head's int8 copy with the float32 logits recomputed only where the int8 ones leave a doubt (the same tokens;
    the 8-row head in ~0.3x fbgemm's float16 time, round 19); else from the logits."""
    if target.greedy_head is not None:
        hidden, features = target(block, positions, cache, feature_layers, head=False)
        return (*target.greedy_head(hidden, drafts), features)
    logits, features = target(block, positions, cache, feature_layers)
    return (*greedy_accept_logits(drafts, logits), features)


def greedy_accept_logits(draft_tokens: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`greedy_accept` on the target's logits [b, K+1, V] instead of their argmax: on float32 CPU logits one compiled
    pass that reads each request's rows only up to its first mismatch (`greedy_verify_cpu`; the argmax and the accept
    rule as torch ops took ~90 us a lone request's step on this project's CPUs, round 19), else argmax + the rule."""
    if serves(logits):
        return greedy_verify_cpu(logits, draft_tokens)
    return greedy_accept(draft_tokens, greedy_tokens(logits))


def sample_from_probs(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [..., V] (need not be normalised), uniform [...] in [0, 1)."""
    cdf = probs.cumsum(dim=-1)
    threshold = (uniform * cdf[..., -1]).unsqueeze(-1)
    index = torch.searchsorted(cdf, threshold, right=True).squeeze(-1)
    return index.clamp_(max=probs.shape[-1] - 1)


def rejection_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling over a chain of K drafts.

    draft_tokens [b, K]; draft_probs [b, K, V] (the distributions the drafts were sampled from);
    target_probs [b, K+1, V] (target distribution after each verify position, already filtered by
    temperature / top-k / top-p); uniforms [b, K+1] in [0, 1): column k < K decides draft k, column K
    draws the replacement or bonus token.
    """
    k_drafts = draft_tokens.shape[1]
    idx = draft_tokens.unsqueeze(-1)
    p_draft = target_probs[:, :k_drafts].gather(-1, idx).squeeze(-1)
    q_draft = draft_probs.gather(-1, idx).squeeze(-1)
    # u < p/q written without the division so q = 0 (never sampled) cannot produce NaN.
    keep = uniforms[:, :k_drafts] * q_draft < p_draft
    num_accepted = accepted_prefix_length(keep)

    rows = torch.arange(draft_tokens.shape[0], device=draft_tokens.device)
    p_next = target_probs[rows, num_accepted]
    q_padded = torch.cat([draft_probs, draft_probs.new_zeros(len(rows), 1, target_probs.shape[-1])], dim=1)
    residual = (p_next - q_padded[rows, num_accepted]).clamp_(min=0)
    # All drafts kept -> q row is zero and the residual is p itself (the bonus distribution).
    # A residual that vanishes numerically (p == q) falls back to p, which is then exact.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p_next, residual)
    bonus = sample_from_probs(residual, uniforms[:, k_drafts])
    return num_accepted, bonus
