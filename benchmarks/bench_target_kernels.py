"""The target's steps through its compiled CPU kernels (MoE, attention, add + RMSNorm) against its torch
formulations, side by side.

    python benchmarks/bench_target_kernels.py [--target DIR] [--prompts 16] [--max-tokens 128] [--repeats 5]
                                          [--threads 1] [--context 200] [--rounds 200]

Two measurements, each interleaved so that machine drift hits every variant alike:
1. Target steps: an AR step and a verify of 8 tokens over a `--context`-token history, on fresh random
   tokens every round (as decoding's tokens route to other experts than the last step's), per expert
   storage (`GptOssTarget.expert_storages`) with the kernels (`use_cpu_kernels`; the MoE kernel takes
   the float32 and bf16 storages, not fbgemm's float16 copies) and in torch; median and min..max over
   `--rounds` rounds, and the verify / AR ratio.
2. Autoregressive decoding end to end (the reference runtime, greedy) on the held-out prompts, kernels
   against torch, each with the storage `--expert-dtype auto` picks for it, alternating per repeat:
   tokens/s with min..max, and whether both decode the same tokens.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from trtllm_dflash.bench.local_pair import add_pair_arguments, load_local_pair
from trtllm_dflash.runtime.reference import ReferenceRuntime
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.runtime.tuning import choose_expert_storage, interleaved_times


def spread(values: list[float], scale: float = 1.0) -> str:
    return f"{statistics.median(values) * scale:.3f} ({min(values) * scale:.3f}..{max(values) * scale:.3f})"


def step_costs(target, context: int, rounds: int) -> None:
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.vocab_size, (1, context), generator=generator)
    tokens = torch.randint(0, target.vocab_size, (rounds + 20, 1, 8), generator=generator)
    positions = torch.arange(context + 8).expand(1, -1)
    cache = target.new_cache(1, context + 8)
    target(prompt, positions[:, :context], cache, [])
    variants = [(storage, kernel) for storage in target.expert_storages for kernel in (True, False)]

    draws = itertools.count()

    def step(storage: str, kernel: bool, width: int):
        def run():
            target.use_expert_storage(storage)
            target.use_cpu_kernels = kernel
            target(tokens[next(draws) % len(tokens)][:, :width], positions[:, context: context + width], cache, [])
        return run

    times = interleaved_times([step(s, k, w) for s, k in variants for w in (1, 8)], rounds, warm_up=20)
    print(f"\ntarget steps at context {context}, ms, median (min..max) over {rounds} interleaved rounds")
    print(f"{'experts':<10}{'compiled':<28}{'AR step':>24}{'verify (8 tokens)':>24}{'verify / AR':>13}")
    for (storage, kernel), ar, verify in zip(variants, times[0::2], times[1::2]):
        target.use_cpu_kernels = kernel
        print(f"{storage:<10}{', '.join(target.compiled_parts(storage)) or 'none':<28}{spread(ar, 1e3):>24}{spread(verify, 1e3):>24}"
              f"{statistics.median(v / a for v, a in zip(verify, ar)):>12.2f}x")


def end_to_end(target, prompts, max_tokens: int, repeats: int) -> None:
    params = SamplingParams(max_tokens=max_tokens)
    runtime = ReferenceRuntime(target, None)
    storages = {}
    for kernel in (True, False):
        target.use_cpu_kernels = kernel
        choose_expert_storage(target, "auto", 1, 8)
        storages[kernel] = target.expert_storage
    runtime.warm_up(prompts[0])
    rates: dict[bool, list[float]] = {True: [], False: []}
    outputs: dict[bool, list] = {}
    for repeat in range(repeats):
        for kernel in ((True, False) if repeat % 2 == 0 else (False, True)):
            target.use_cpu_kernels = kernel
            target.use_expert_storage(storages[kernel])
            start = time.perf_counter()
            results = runtime.generate(prompts, params, 1)
            seconds = time.perf_counter() - start
            rates[kernel].append(sum(len(r.output_token_ids) for r in results) / seconds)
            outputs[kernel] = [r.output_token_ids for r in results]
    same = sum(a == b for a, b in zip(outputs[True], outputs[False]))
    print(f"\nautoregressive decoding, {len(prompts)} prompts x {max_tokens} tokens, batch 1, {repeats} repeats "
          f"alternating; same tokens: {same}/{len(prompts)}")
    for kernel in (True, False):
        print(f"{'kernels' if kernel else 'torch':<8}experts {storages[kernel]:<10}tok/s {spread(rates[kernel])}")
    ratios = [k / t for k, t in zip(rates[True], rates[False])]
    print(f"kernels / torch: {spread(ratios)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(parser)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    pair = load_local_pair(args)
    target = pair.target
    if not target.compiled_parts():
        raise SystemExit("the compiled CPU kernels do not serve this target here (see the warning above)")
    print(f"threads={args.threads} prompts={len(pair.prompts)} max_tokens={args.max_tokens}")
    with torch.inference_mode():
        step_costs(target, args.context, args.rounds)
    end_to_end(target, pair.prompts, args.max_tokens, args.repeats)


if __name__ == "__main__":
    main()
