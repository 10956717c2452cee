"""The target's steps with and without AMX tiles, side by side in one process (round 22).

Builds the embedded target twice, once with TRTLLM_DFLASH_AMX=0 (the AVX512 kernels) and once with AMX where the CPU
has it, and times greedy verifies of 1 (an AR step), 8 and 16 tokens over a 200-token history, every variant once per
round in turn on fresh tokens (so that they route to experts as decoding does), each variant with its attention
projections as built and its experts as int8 rows or AMX tiles. Prints the median and min..max per variant and width,
and each width's time relative to the same variant's AR step.

    python benchmarks/bench_amx.py --rounds 200 --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from trtllm_dflash.checkpoints.gpt_oss import load_hf_gpt_oss
from trtllm_dflash.embedded import pair_paths
from trtllm_dflash.models.target import GptOssTarget
from trtllm_dflash.plugins.compiled import AMX_VARIABLE
from trtllm_dflash.plugins.target import cpu as target_cpu
from trtllm_dflash.runtime.accept import greedy_verify_block

CONTEXT, WIDTHS = 200, (1, 8, 16)


def build(amx: bool) -> GptOssTarget:
    previous = os.environ.get(AMX_VARIABLE)
    os.environ[AMX_VARIABLE] = "1" if amx else "0"
    try:
        return GptOssTarget(load_hf_gpt_oss(pair_paths()[0], "cpu", torch.float32))
    finally:
        if previous is None:
            del os.environ[AMX_VARIABLE]
        else:
            os.environ[AMX_VARIABLE] = previous


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--warm-up", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not target_cpu.amx_available():
        raise SystemExit(f"no AMX here ({target_cpu.unavailable_reason() or 'the CPU lacks AMX-BF16'}): nothing to compare")
    plain, tiled = build(amx=False), build(amx=True)
    variants = {"avx512 projections, int8 experts": (plain, "int8"),
                "amx projections, int8 experts": (tiled, "int8"),
                "amx projections, amx experts": (tiled, "amx")}
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, plain.vocab_size, (1, CONTEXT), generator=generator)
    caches = {}
    with torch.inference_mode():
        for name, (target, _) in variants.items():
            caches[name] = target.new_cache(1, CONTEXT + max(WIDTHS))
            target(prompt, torch.arange(CONTEXT)[None], caches[name], [])
        times = {(name, width): [] for name in variants for width in WIDTHS}
        for round_ in range(args.warm_up + args.rounds):
            tokens = torch.randint(0, plain.vocab_size, (1, max(WIDTHS)), generator=generator)
            for name, (target, storage) in variants.items():
                target.use_expert_storage(storage)
                for width in WIDTHS:
                    start = time.perf_counter()
                    greedy_verify_block(target, tokens[:, :width], CONTEXT + torch.arange(width)[None], caches[name],
                                        [], tokens[:, 1:width])
                    if round_ >= args.warm_up:
                        times[name, width].append(time.perf_counter() - start)
    print(f"threads={args.threads} rounds={args.rounds} context={CONTEXT} (greedy verify of W tokens; W = 1: an AR step)")
    print(f"{'variant':<36}" + "".join(f"{f'W={w} ms (min..max)':>24}{'x AR':>7}" for w in WIDTHS))
    for name in variants:
        ar = statistics.median(times[name, 1])
        cells = []
        for width in WIDTHS:
            record = times[name, width]
            median = statistics.median(record)
            cells.append(f"{median * 1e3:>10.3f} ({min(record) * 1e3:.3f}..{max(record) * 1e3:.3f}){median / ar:>6.2f}x")
        print(f"{name:<36}" + "".join(f"{cell:>31}" for cell in cells))


if __name__ == "__main__":
    main()
