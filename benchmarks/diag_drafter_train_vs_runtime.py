"""Train/inference consistency of a DFlash drafter: training-mode accuracy vs runtime acceptance.

    python benchmarks/diag_drafter_train_vs_runtime.py [--target DIR --drafter DIR] [--prompts N]
                                                       [--max-tokens N] [--threads N]

1. Greedy generation with the runtime's DFlashProposer on held-out prompts, recording every
   block's anchor position and the drafter logits the proposer produced.
2. The same committed sequences (prompt + output) through the training forward
   (`trtllm_dflash.train.step.drafter_block_logits`) with the recorded anchors: the block logits
   must equal the runtime's (max |diff| printed), else training and inference disagree.
3. Training-mode accuracy over EVERY response position as anchor: P(slots 1..k all correct),
   the quantity the runtime's per-position acceptance measures, next to the runtime's own.
4. With ``--responses RUN/responses.pt``: the same training-mode tau on the first ``--responses-count``
   training sequences of a dflash-train run; next to (3) it shows how much the drafter over-fits.
"""

from __future__ import annotations

import argparse
import json

import torch

from trtllm_dflash.bench.local_pair import add_pair_arguments, load_local_pair
from trtllm_dflash.runtime.accept import accepted_prefix_length
from trtllm_dflash.runtime.reference import ReferenceRuntime
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.train.step import RecordingProposer, drafter_block_logits


def block_verdicts(drafter, target, sequence: torch.Tensor, first: int) -> torch.Tensor:
    """Training-mode greedy verdicts [A, B-1] for every anchor from `first` whose block fits in `sequence` [1, L]."""
    b = drafter.config.block_size
    every = torch.arange(first, sequence.shape[1] - b + 1)[None]
    logits = drafter_block_logits(drafter, target, sequence, every)[0]
    return logits.argmax(-1) == sequence[0, every[0, :, None] + torch.arange(1, b)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(parser)
    parser.add_argument("--responses", type=str, help="a dflash-train run's responses.pt (training sequences)")
    parser.add_argument("--responses-count", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length of those sequences")
    parser.add_argument("--json", type=str, help="write the numbers here")
    args = parser.parse_args()
    pair = load_local_pair(args)
    target, drafter, prompts = pair.target, pair.drafter, pair.prompts
    b = drafter.config.block_size
    params = SamplingParams(max_tokens=args.max_tokens)

    runtime_hist = [0] * b
    max_diff, agree, total_slots = 0.0, 0, 0
    train_correct = torch.zeros(b - 1)  # P(slots 1..k all correct), every response position as anchor
    train_slot = torch.zeros(b - 1)  # P(slot k correct) alone
    train_blocks = 0
    walk_hist = [0] * b
    for prompt in prompts:
        proposer = RecordingProposer(drafter, target)
        result = ReferenceRuntime(target, proposer).generate([prompt], params)[0]
        for a, n in enumerate(result.stats.accepted_histogram):
            runtime_hist[a] += n
        sequence = torch.tensor([prompt + result.output_token_ids])
        # (2) the runtime's anchors through the training forward
        anchors = torch.tensor([[int(p[0]) for p in proposer.positions]])
        padded = torch.cat([sequence, sequence.new_zeros(1, b)], dim=1)  # a late block may run past the end
        train_logits = drafter_block_logits(drafter, target, padded, anchors)[0]  # [A, B-1, V]
        runtime_logits = torch.stack([logits[0] for logits in proposer.logits])
        max_diff = max(max_diff, float((train_logits - runtime_logits).abs().max()))
        agree += int((train_logits.argmax(-1) == runtime_logits.argmax(-1)).sum())
        total_slots += runtime_logits.shape[0] * runtime_logits.shape[1]
        # (3) every position whose whole block lies in the committed sequence
        correct = block_verdicts(drafter, target, sequence, len(prompt))  # [A, B-1]
        train_slot += correct.float().sum(0)
        train_correct += correct.long().cumprod(-1).float().sum(0)
        train_blocks += correct.shape[0]
        # the runtime's walk replayed on the training-mode verdicts: anchor s keeps a drafts, the
        # next anchor is s + a + 1. Blocks land densely where drafting fails, sparsely where it works.
        accepted = accepted_prefix_length(correct).tolist()
        s, limit = 0, len(prompt) + args.max_tokens - 1
        while len(prompt) + s < limit and s < len(accepted):
            walk_hist[accepted[s]] += 1
            s += accepted[s] + 1

    steps = sum(runtime_hist)
    runtime_pos = [sum(runtime_hist[k:]) / steps for k in range(1, b)]
    runtime_tau = sum((a + 1) * n for a, n in enumerate(runtime_hist)) / steps
    train_pos = (train_correct / train_blocks).tolist()
    walk_steps = sum(walk_hist)
    walk_pos = [sum(walk_hist[k:]) / walk_steps for k in range(1, b)]
    walk_tau = sum((a + 1) * n for a, n in enumerate(walk_hist)) / walk_steps
    out = {
        "train_mode_walk_per_position": walk_pos, "train_mode_walk_tau": walk_tau,
        "runtime_per_position": runtime_pos, "runtime_tau": runtime_tau,
        "train_mode_prefix_correct": train_pos, "train_mode_tau": 1 + sum(train_pos),
        "train_mode_slot_accuracy": (train_slot / train_blocks).tolist(),
        "max_abs_logit_diff_train_vs_runtime": max_diff, "argmax_agreement": agree / total_slots,
        "runtime_blocks": steps, "train_mode_blocks": train_blocks,
    }
    if args.responses:
        seen, seen_blocks = torch.zeros(b - 1), 0
        for sequence in torch.load(args.responses)[: args.responses_count]:
            correct = block_verdicts(drafter, target, sequence[None], args.prompt_tokens)
            seen += correct.long().cumprod(-1).float().sum(0)
            seen_blocks += correct.shape[0]
        out["train_mode_tau_on_training_sequences"] = 1 + float((seen / seen_blocks).sum())
    fmt = lambda xs: " ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    print(f"drafter={pair.drafter_dir} prompts={len(prompts)} max_tokens={args.max_tokens}")
    print(f"runtime     per-position acceptance {fmt(runtime_pos)}  tau {runtime_tau:.2f} ({steps} blocks)")
    print(f"train-mode  P(slots 1..k correct)   {fmt(train_pos)}  tau {1 + sum(train_pos):.2f} ({train_blocks} blocks)")
    print(f"train-mode  replayed walk           {fmt(walk_pos)}  tau {walk_tau:.2f} ({walk_steps} blocks)")
    print(f"train-mode  P(slot k correct)       {fmt(out['train_mode_slot_accuracy'])}")
    if args.responses:
        print(f"train-mode  tau on {args.responses_count} training sequences {out['train_mode_tau_on_training_sequences']:.2f}")
    print(f"runtime anchors through the training forward: max |logit diff| {max_diff:.2e}, "
          f"argmax agreement {agree / total_slots:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
