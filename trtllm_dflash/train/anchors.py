"""Where a training step anchors its blocks: uniform draws, and the positions the runtime drafts from.

The runtime drafts from the bonus token after each verify, so its anchors sit densely where drafting
fails. `walk_anchors` is the one-visit approximation (`--walk-anchors` alone), `replay_walk` the exact
accept path of the current drafter on a training sequence (`--replay-every`), and `path_rows` puts a
share of each batch on those paths.
"""

from __future__ import annotations

import torch

from ..models.drafter import DFlashDrafter
from ..models.target import GptOssTarget
from ..runtime.accept import accepted_prefix_length
from ..runtime.sampling import greedy_tokens


def sample_anchors(num_sequences: int, anchors: int, first: int, last: int, gen: torch.Generator) -> torch.Tensor:
    """[N, A] distinct anchor positions per sequence in [first, last], sorted."""
    choices = torch.rand(num_sequences, last - first + 1, generator=gen).argsort(dim=1)[:, :anchors]
    return (choices + first).sort(dim=1).values


def walk_anchors(anchors: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
    """Where the runtime would draft next after each block: [N, A] anchors + accepted prefix + 1.

    `correct` [N, A, B-1]: did slot k's greedy draft equal x_{anchor+k}. The verify accepts the
    leading run of correct slots and the target's own token follows, which anchors the next block."""
    return anchors + accepted_prefix_length(correct) + 1


def mix_anchors(uniform: torch.Tensor, candidates: torch.Tensor, fraction: float, last: int) -> torch.Tensor:
    """[N, A] sorted distinct anchors: per row up to round(fraction * A) of the row's `candidates`
    (walk positions from its previous visit; -1 or past `last` = none), the rest from `uniform`
    (already distinct and in range) in their order."""
    a = uniform.shape[1]
    take = round(fraction * a)
    rows = []
    for row_uniform, row_candidates in zip(uniform.tolist(), candidates.tolist()):
        chosen = list(dict.fromkeys(c for c in row_candidates if 0 <= c <= last))[:take]
        seen = set(chosen)
        chosen += [u for u in row_uniform if u not in seen][: a - len(chosen)]
        rows.append(sorted(chosen))
    return torch.tensor(rows, dtype=uniform.dtype)


def replay_walk(drafter: DFlashDrafter, target: GptOssTarget, sequences: torch.Tensor, features: torch.Tensor,
                first: int) -> tuple[list[torch.Tensor], float]:
    """The anchors the runtime drafts from (greedy) when it decodes `sequences` [n, L] from position
    `first` on, and its tau there. The responses are the target's own greedy continuations, so the
    runtime commits exactly these tokens and its accept path is a walk over them: anchor a, accepted
    prefix m (the drafts that equal x_{a+1..}), next anchor a + m + 1, until a block would run past
    the sequence. Runs the drafter's inference path on the target's `features` [n, L, F]."""
    b, mask_id = drafter.config.block_size, drafter.config.mask_token_id
    n, seq_len = sequences.shape
    last = seq_len - b
    cache = drafter.new_cache(n, seq_len)
    drafter.write_context(features, torch.arange(seq_len, device=sequences.device).expand(n, -1), cache)
    anchors = torch.full((n,), first, dtype=torch.int64, device=sequences.device)
    paths: list[list[int]] = [[] for _ in range(n)]
    produced = 0
    while bool((live := anchors <= last).any()):
        at = anchors.clamp(max=last)
        positions = at[:, None] + torch.arange(b, device=at.device)
        tokens = torch.full_like(positions, mask_id)
        tokens[:, 0] = sequences.gather(1, at[:, None])[:, 0]
        with torch.inference_mode():
            hidden = drafter(target.embed(tokens), positions, cache, at)
            drafts = greedy_tokens(target.lm_head(hidden[:, 1:].to(target.dtype)))
            # the forward keeps the block's K/V in the slots just past each context, which here hold
            # context for later anchors: write those positions' context back
            block_features = features.gather(1, positions[..., None].expand(-1, -1, features.shape[-1]))
            drafter.write_context(block_features, positions, cache)
        advance = accepted_prefix_length(drafts == sequences.gather(1, positions[:, 1:])) + 1
        for row in live.nonzero()[:, 0].tolist():
            paths[row].append(int(at[row]))
        produced += int(advance[live].sum())
        anchors = torch.where(live, anchors + advance, anchors)
    blocks = sum(len(p) for p in paths)
    return [torch.tensor(p, dtype=torch.int64) for p in paths], produced / max(blocks, 1)


def path_rows(rows: torch.Tensor, paths: dict[int, torch.Tensor], fraction: float, count: int,
              gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace a share `fraction` of the batch `rows` [N] by replayed sequences (keys of `paths`), and
    give those up to `count` anchors drawn from their paths: (rows [N], candidates [N, count], -1 =
    none, for `mix_anchors`). The runtime drafts densely where drafting fails, so its path
    over-weights exactly the positions uniform anchors under-train."""
    pool = torch.tensor(sorted(paths), dtype=rows.dtype)
    pooled = torch.rand(len(rows), generator=gen) < fraction
    rows = torch.where(pooled, pool[torch.randint(0, len(pool), (len(rows),), generator=gen)], rows)
    candidates = torch.full((len(rows), count), -1, dtype=torch.int64)
    for i in pooled.nonzero()[:, 0].tolist():
        path = paths[int(rows[i])]
        picked = path[torch.randperm(len(path), generator=gen)[:count]]
        candidates[i, : len(picked)] = picked
    return rows, candidates
