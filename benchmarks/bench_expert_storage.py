"""The target's MoE reading its experts as float32 originals, as exact bf16 copies cast back per GEMM or
as fbgemm's float16 copies (`GptOssTarget.use_expert_storage`, chosen at start-up by `dflash-run
--expert-dtype auto`): each side by side in one process, on the embedded pair (or --target/--drafter).

    python benchmarks/bench_expert_storage.py [--target DIR --drafter DIR] [--prompts 16] [--max-tokens 128]
                                              [--repeats 3] [--threads 1]

Per repeat and prompt, each storage in turn (the order alternating by prompt, so drift hits both alike)
runs autoregressive decoding, DFlash (fixed block, drafter GEMMs float32) and n-gram prompt lookup on
that prompt. Reported per storage, totals over all runs: the AR step and the DFlash verify and drafter
steps from the loop's own timers, each method's decode tokens/s, and DFlash's and n-gram's speed-up
over the AR run of the same storage. Every storage gives the same tokens (checked). Then the same loops
once more with the storage switched at every target step, round-robin (per-step alternation: drift
over seconds, which whole runs are exposed to, hits every storage alike): each storage's mean and
median AR step and verify. After that, the start-up timing `--expert-dtype auto` makes, five times,
and which storage it picked each time.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import statistics
import time


from trtllm_dflash.bench.local_pair import add_pair_arguments, load_local_pair
from trtllm_dflash.models.target import GptOssTarget
from trtllm_dflash.runtime.proposers import DFlashProposer, NGramProposer
from trtllm_dflash.runtime.reference import ReferenceRuntime
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.runtime.tuning import time_expert_storages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(parser)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    pair = load_local_pair(args)
    target, drafter, prompts = pair.target, pair.drafter, pair.prompts
    storages = list(target.expert_storages)
    if len(storages) < 2:
        raise SystemExit(f"{pair.target_dir}: the experts have one storage here ({storages[0]}): nothing to compare")
    params = SamplingParams(max_tokens=args.max_tokens)
    block = drafter.config.block_size
    runtimes = {"ar": ReferenceRuntime(target, None),
                "dflash": ReferenceRuntime(target, DFlashProposer(drafter, target)),
                "ngram": ReferenceRuntime(target, NGramProposer(block - 1))}
    for runtime in runtimes.values():
        runtime.warm_up(prompts[0])

    totals = {name: collections.defaultdict(float) for name in storages}
    outputs: dict[tuple[str, str, int], list[int]] = {}
    for repeat in range(args.repeats):
        for i, prompt in enumerate(prompts):
            for storage in storages if (i + repeat) % 2 == 0 else storages[::-1]:
                target.use_expert_storage(storage)
                for method, runtime in runtimes.items():
                    start = time.perf_counter()
                    (result,) = runtime.generate([prompt], params, 1)
                    total = totals[storage]
                    total[f"{method} s"] += time.perf_counter() - start
                    total[f"{method} steps"] += result.stats.steps
                    total[f"{method} tokens"] += len(result.output_token_ids)
                    total[f"{method} verify s"] += runtime.step_times["verify"]
                    total[f"{method} draft s"] += runtime.step_times["draft"]
                    outputs[(storage, method, i)] = result.output_token_ids
    identical = all(outputs[(s, m, i)] == outputs[(storages[0], "ar", i)]
                    for s in storages for m in runtimes for i in range(len(prompts)))

    print(f"threads={args.threads} prompts={len(prompts)} max_tokens={args.max_tokens} repeats={args.repeats} "
          f"block={block}; outputs identical across storages and methods: {identical}")
    print(f"{'experts':<10}{'AR step ms':>11}{'verify ms':>10}{'x AR':>6}{'drafter ms':>11}{'x AR':>6}"
          f"{'AR tok/s':>10}{'DFlash tok/s':>13}{'speed-up':>9}{'n-gram tok/s':>13}{'speed-up':>9}")
    for storage, total in totals.items():
        ar_step = total["ar verify s"] / total["ar steps"]
        verify, draft = (total[f"dflash {k} s"] / total["dflash steps"] for k in ("verify", "draft"))
        rate = {m: total[f"{m} tokens"] / total[f"{m} s"] for m in runtimes}
        print(f"{storage:<10}{ar_step * 1e3:>11.3f}{verify * 1e3:>10.3f}{verify / ar_step:>6.2f}{draft * 1e3:>11.3f}"
              f"{draft / ar_step:>6.2f}{rate['ar']:>10.1f}{rate['dflash']:>13.1f}{rate['dflash'] / rate['ar']:>8.2f}x"
              f"{rate['ngram']:>13.1f}{rate['ngram'] / rate['ar']:>8.2f}x")
    per_step_alternation(target, storages, runtimes, prompts, params, block)
    for _ in range(5):
        relative = time_expert_storages(target, 1, block)
        timings = ", ".join(f"{s} {r:.3f}" for s, r in relative.items())
        print(f"start-up timing (AR step + verify of {block} tokens, time relative to {storages[0]}): {timings} "
              f"-> {min(relative, key=relative.get)}")


def per_step_alternation(target: GptOssTarget, storages: list[str], runtimes: dict, prompts, params,
                         block: int) -> None:
    """The AR and DFlash loops on every prompt, each decode step of the target reading the next storage in
    turn; the target reads its experts as before afterwards."""
    kept, turn = target.expert_storage, itertools.cycle(storages)
    times: dict[tuple[str, int], list[float]] = collections.defaultdict(list)
    started: list[tuple[str, float]] = []

    def before(module, args):
        if args[0].shape[1] <= block:  # a decode step, not a prefill
            module.use_expert_storage(next(turn))
            started.append((module.expert_storage, time.perf_counter()))

    def after(module, args, output):
        if started:
            storage, start = started.pop()
            times[storage, args[0].shape[1]].append(time.perf_counter() - start)

    hooks = [target.register_forward_pre_hook(before), target.register_forward_hook(after)]
    for method in ("ar", "dflash"):
        runtimes[method].generate(prompts, params, 1)
    for hook in hooks:
        hook.remove()
    target.use_expert_storage(kept)
    print("\nper-step alternation (AR and DFlash loops, the storage switched at every target step):")
    print(f"{'experts':<10}{'AR step ms mean/median':>24}{'x':>7}{f'verify {block} ms mean/median':>26}{'x':>7}")
    first = storages[0]
    for storage in storages:
        cells = []
        for width in (1, block):
            record = times[storage, width]
            cells.append(f"{statistics.mean(record) * 1e3:>15.3f} / {statistics.median(record) * 1e3:.3f}"
                         f"{statistics.mean(record) / statistics.mean(times[first, width]):>7.3f}")
        print(f"{storage:<10}{cells[0]}{cells[1]:>33}")


if __name__ == "__main__":
    main()
