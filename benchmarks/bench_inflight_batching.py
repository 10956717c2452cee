"""In-flight against static batching in the reference runtime: the same prompts, one process, interleaved.

    python benchmarks/bench_inflight_batching.py [--target DIR --drafter DIR] [--prompts 16] [--max-tokens 128]
                                                 [--batch-sizes 4,8] [--repeats 5] [--threads 1]

Per batch size, five runtimes decode all prompts (greedy, no stop ids): autoregressive and the reference runtime's
default (dflash-sa, threshold 2, suffix drafts up to 2 x block - 1, the adaptive draft length from step costs measured
here at that batch size), each with static batches (`ReferenceRuntime`'s default: a batch's rows wait for its slowest
request) and in-flight (`inflight=True`: a finished request's row goes to the next prompt at the next step), and
n-gram prompt lookup in flight (a block of drafts every step: the strongest simple baseline, as `dflash-serve
--draft-method ngram` serves it). Every repeat runs the five in a rotating order; a run's rate is its output tokens over the wall time of its whole
`generate` call (prefills included: in-flight prefills land between other requests' steps). Speed-ups are per repeat,
over the static autoregressive run of that repeat: median (min..max). Outputs are checked against batch-1
autoregressive decoding.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from trtllm_dflash.bench.local_pair import add_pair_arguments, load_local_pair
from trtllm_dflash.models.linear import drafter_gemm_dtype
from trtllm_dflash.runtime.draft_length import adaptive_draft_length, measure_step_costs
from trtllm_dflash.runtime.proposers import (DEFAULT_SA_THRESHOLD, DFlashProposer, NGramProposer,
                                             SuffixDFlashProposer, default_sa_max_drafts)
from trtllm_dflash.runtime.reference import ReferenceRuntime
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.runtime.tuning import choose_expert_storage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(parser)
    parser.add_argument("--batch-sizes", default="4,8")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    pair = load_local_pair(args)
    target, drafter, prompts = pair.target, pair.drafter, pair.prompts
    params = SamplingParams(max_tokens=args.max_tokens)
    gemm = drafter_gemm_dtype("auto", torch.float32, torch.device("cpu"))
    block = drafter.config.block_size
    longest = default_sa_max_drafts(block)
    reference = [r.output_token_ids for r in ReferenceRuntime(target, None).generate(prompts, params, 1)]
    print(f"threads={args.threads} prompts={len(prompts)} max_tokens={args.max_tokens} repeats={args.repeats}")
    print(f"{'batch':>5}  {'runtime':<22}{'tok/s':>9}{'x static AR':>14}{'min..max':>14}{'lossless':>10}")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        choose_expert_storage(target, "auto", batch, block)

        def dflash() -> DFlashProposer:
            return DFlashProposer(drafter, target, matmul_dtype=gemm)

        costs = measure_step_costs(target, dflash, batch, block - 1, suffix_most=longest)

        def default() -> SuffixDFlashProposer:
            return SuffixDFlashProposer(dflash(), DEFAULT_SA_THRESHOLD, policy=adaptive_draft_length(costs),
                                        max_suffix_drafts=longest)

        runtimes = {"autoregressive static": ReferenceRuntime(target, None),
                    "autoregressive inflight": ReferenceRuntime(target, None, inflight=True),
                    "default static": ReferenceRuntime(target, default()),
                    "default inflight": ReferenceRuntime(target, default(), inflight=True),
                    "ngram inflight": ReferenceRuntime(target, NGramProposer(num_drafts=block - 1), inflight=True)}
        for runtime in runtimes.values():
            runtime.warm_up(prompts[0])
        rates: dict[str, list[float]] = {name: [] for name in runtimes}
        lossless: dict[str, int] = {}
        names = list(runtimes)
        for repeat in range(args.repeats):
            for name in names[repeat % len(names):] + names[: repeat % len(names)]:
                start = time.perf_counter()
                results = runtimes[name].generate(prompts, params, batch)
                seconds = time.perf_counter() - start
                rates[name].append(sum(len(r.output_token_ids) for r in results) / seconds)
                lossless[name] = sum(r.output_token_ids == e for r, e in zip(results, reference))
        for name in runtimes:
            ratios = [r / a for r, a in zip(rates[name], rates["autoregressive static"])]
            print(f"{batch:>5}  {name:<22}{statistics.median(rates[name]):>9.0f}{statistics.median(ratios):>13.2f}x"
                  f"{min(ratios):>8.2f}..{max(ratios):.2f}x{lossless[name]:>6}/{len(prompts)}")


if __name__ == "__main__":
    main()
