"""Load-aware draft length: is the cost-model schedule at least as fast as every fixed draft length?

    python benchmarks/bench_schedule.py [--concurrency 1,2,4,8,16] [--draft-lengths 1,2,4,7] ...

Per case: (1) a calibration sweep (AR + each fixed draft length) fits the cost model and picks a
draft_len_schedule; (2) a second sweep runs AR, every fixed length and the scheduled runtime side by
side, repeats interleaved, and compares them at every concurrency.

Cases, on a random pair at the embedded default's scale (bench_reference_runtime.random_pair):
  random        the real DFlash drafter; random weights accept almost nothing, so the right answer
                is "never speculate" and the schedule must find it.
  oracle p=...  SYNTHETIC acceptance: the real drafter runs (its full cost is paid), then its drafts
                are replaced by the target's own greedy continuation (precomputed by an AR run), each
                position kept with probability p and a chain broken at the first miss, so
                P(first j accepted) = p^j. Verification is the real one (TensorRT-LLM offers the same
                idea for perf modelling: TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from bench_reference_runtime import random_pair

from trtllm_dflash.bench.load import LoadShape
from trtllm_dflash.bench.points import CONCURRENCY
from trtllm_dflash.bench.report import analyse
from trtllm_dflash.bench.sweep import InProcessRunner, run_sweep
from trtllm_dflash.checkpoints.gpt_oss import load_hf_gpt_oss
from trtllm_dflash.models.drafter import load_drafter
from trtllm_dflash.models.target import GptOssTarget
from trtllm_dflash.runtime.proposers import DFlashProposer, verify_block
from trtllm_dflash.runtime.reference import ReferenceRuntime
from trtllm_dflash.runtime.sampling import SamplingParams


class OracleProposer:
    """SYNTHETIC: a real proposer's cost with drafts that are right with probability p per position."""

    needs_history = True

    def __init__(self, inner: DFlashProposer, truth: dict[tuple[int, ...], list[int]], prompt_len: int, p: float,
                 vocab_size: int, seed: int = 0):
        self.inner, self.truth, self.prompt_len, self.p, self.vocab_size = inner, truth, prompt_len, p, vocab_size
        self.num_drafts, self.feature_layers = inner.num_drafts, inner.feature_layers
        # One fixed coin per (prompt, output position, draft slot): every runtime sees the same
        # acceptance in the same state, so runs differ in speed only.
        gen = torch.Generator().manual_seed(seed)
        longest = max(len(t) for t in truth.values()) + 1
        self.coins = {prompt: torch.rand(longest, inner.num_drafts, generator=gen) < p for prompt in truth}

    def start(self, features, prompt_lens, capacity):
        self.inner.start(features, prompt_lens, capacity)

    def propose(self, anchors, anchor_positions, history, num_drafts, params, generator):
        self.inner.propose(anchors, anchor_positions, history, num_drafts, params, generator)
        rows, kept = [], []
        for sequence in history:  # prompt, outputs so far (anchor last)
            prompt, done = tuple(sequence[: self.prompt_len]), len(sequence) - self.prompt_len
            future = self.truth[prompt][done: done + num_drafts]
            rows.append(future + [0] * (num_drafts - len(future)))
            kept.append(self.coins[prompt][min(done, len(self.coins[prompt]) - 1), :num_drafts])
        truth = torch.tensor(rows, dtype=anchors.dtype).view(len(anchors), num_drafts)
        kept = torch.stack(kept) if kept else torch.zeros(truth.shape, dtype=torch.bool)
        drafts = torch.where(kept, truth, (truth + 1) % self.vocab_size).to(anchors.device)
        return verify_block(anchors, drafts), None

    def commit(self, features, num_accepted):
        self.inner.commit(features, num_accepted)

    def keep_rows(self, rows):
        self.inner.keep_rows(rows)


def compare(points, concurrency: list[int]) -> list[str]:
    """Markdown rows: each runtime's tokens/s per concurrency, best/worst fixed and the scheduled ratio."""
    rows = []
    for c in concurrency:
        at = {(p.method, p.draft_len): p.tokens_per_s for p in points if p.concurrency == c}
        fixed = {k: v for (m, k), v in at.items() if m != "scheduled"}
        best, worst = max(fixed, key=fixed.get), min(fixed, key=fixed.get)
        scheduled = next(v for (m, _), v in at.items() if m == "scheduled")
        cells = " | ".join(f"{fixed[k]:.0f}" for k in sorted(fixed))
        rows.append(f"| {c} | {cells} | {scheduled:.0f} | K={best} | {scheduled / fixed[best]:.2f} | "
                    f"K={worst} | {scheduled / fixed[worst]:.2f} |")
    return rows


def run_case(name: str, make_proposer, target, lengths, prompts, max_tokens, concurrency, repeats, requests) -> None:
    def runner(method, k, runtime):
        return InProcessRunner(method, k, runtime, max_tokens)

    shapes = [LoadShape(CONCURRENCY, c, -(-requests // c) * c) for c in concurrency]
    entries = [runner("ar", 0, ReferenceRuntime(target, None, inflight=True))]
    entries += [runner("dflash", k, ReferenceRuntime(target, make_proposer(k), inflight=True)) for k in lengths]
    calibration = run_sweep(entries, prompts, shapes, repeats)
    analysis = analyse(calibration, max(lengths))
    candidate = analysis["schedule"]["candidate_draft_len_schedule"]
    schedule = {int(k): v for k, v in candidate.items()}
    holdout = analysis["cost_model"]["holdout"]
    # {} means "build without speculation", so it runs as TensorRT-LLM would run it: plain AR.
    runtime = (ReferenceRuntime(target, make_proposer(max(lengths)), schedule, inflight=True) if schedule
               else ReferenceRuntime(target, None, inflight=True))
    scheduled = runner("scheduled", schedule[min(schedule)] if schedule else 0, runtime)
    points = run_sweep(entries + [scheduled], prompts, shapes, repeats)
    tau = {p.draft_len: p.tau for p in calibration if p.concurrency == concurrency[0]}
    print(f"\n### {name}\n")
    print(f"tau by draft length: {', '.join(f'K={k}: {t:.2f}' for k, t in sorted(tau.items()))}; "
          f"schedule {schedule or '{} (speculation off)'} (dflash-bench would "
          f"{'recommend it' if analysis['schedule']['recommended'] else 'not recommend it: ' + analysis['schedule']['reason']}); "
          f"cost-model held-out error {held_out_error(holdout)}; run-to-run spread "
          f"{'n/a (one repeat)' if analysis['spread'] is None else format(analysis['spread']['median'], '.1%') + ' median'}\n")
    print("| c | " + " | ".join("AR" if k == 0 else f"K={k}" for k in [0, *lengths])
          + " | scheduled | best fixed | sched/best | worst fixed | sched/worst |")
    print("|---" * (len(lengths) + 7) + "|")
    print("\n".join(compare(points, concurrency)))


def held_out_error(holdout: dict | None) -> str:
    """The cost model's error on held-out concurrency levels, or why there is none (too few levels)."""
    if holdout is None:
        return "n/a (too few concurrency levels to hold any out)"
    return f"mean {holdout['mean_abs_relative_error']:.1%} / max {holdout['max_abs_relative_error']:.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--draft-lengths", default="1,2,4,7")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8, help="at least this many requests per point")
    parser.add_argument("--oracle-p", type=float, default=0.8)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    lengths = [int(k) for k in args.draft_lengths.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        target_dir, drafter_dir = random_pair(Path(tmp))
        target = GptOssTarget(load_hf_gpt_oss(target_dir, "cpu", torch.float32))
        drafter = load_drafter(drafter_dir, "cpu", torch.float32)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.vocab_size - 2, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.prompts)]
    truth = {tuple(r.prompt_token_ids): r.output_token_ids for r in
             ReferenceRuntime(target, None).generate(prompts, SamplingParams(max_tokens=args.max_tokens), len(prompts))}
    print(f"threads={args.threads} prompts={args.prompts}x{args.prompt_len} tokens max_tokens={args.max_tokens} "
          f"repeats={args.repeats} concurrency={concurrency} draft_lengths={lengths}; tokens/s = output tokens / wall time")
    run_case("random pair (real DFlash drafter, random weights)",
             lambda k: DFlashProposer(drafter, target, k + 1), target, lengths, prompts, args.max_tokens, concurrency,
             args.repeats, args.requests)
    run_case(f"SYNTHETIC oracle acceptance p={args.oracle_p} per position (real drafter cost)",
             lambda k: OracleProposer(DFlashProposer(drafter, target, k + 1), truth, args.prompt_len, args.oracle_p,
                                      target.vocab_size), target, lengths, prompts, args.max_tokens, concurrency,
             args.repeats, args.requests)


if __name__ == "__main__":
    sys.exit(main())
