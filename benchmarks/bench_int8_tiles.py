"""The drafter's int8 GEMM on AMX tiles or on AVX512-VNNI inside the DFlash loop, side by side in one process
(round 26).

`dot_linear` takes AMX tiles for its int8 GEMMs of 4 rows or more where the CPU has AMX-INT8 (`dot_gemm.h`
`tile_multiply`, the same numbers bit for bit); `set_int8_tiles(False)` sends them to the AVX512 path. Per repeat and
batch size, three runs on the same prompts in turn: autoregressive, DFlash with the tiles, DFlash without (greedy, no
stop ids). Prints tok/s and the drafter and verify step per request-step (the loop's own timers), median (min..max)
over repeats after one warm-up round, and whether all three gave the same tokens. bench_dot_gemm.py times the GEMMs
alone, with hot caches.

    python benchmarks/bench_int8_tiles.py [--batch-sizes 1,8] [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_step_costs import spread

from trtllm_dflash.bench.local_pair import add_pair_arguments, load_local_pair
from trtllm_dflash.models.linear import drafter_gemm_dtype
from trtllm_dflash.plugins.draft_block import cpu
from trtllm_dflash.runtime.proposers import DFlashProposer
from trtllm_dflash.runtime.reference import ReferenceRuntime
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.runtime.tuning import choose_expert_storage

VARIANTS = ("ar", "dflash, int8 tiles", "dflash, avx512")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(parser)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    module = cpu.dot_kernel(torch.int8)
    if module is None or not module.dot_int8_tiles_available():
        raise SystemExit("the int8 GEMM has no AMX tiles here (no AMX-INT8, or TRTLLM_DFLASH_AMX=0): nothing to compare")
    pair = load_local_pair(args)
    target, prompts, params = pair.target, pair.prompts, SamplingParams(max_tokens=args.max_tokens)
    gemm = drafter_gemm_dtype("auto", torch.float32, torch.device("cpu"))
    if gemm != torch.int8:
        raise SystemExit(f"the drafter's GEMMs run in {gemm} here, not int8: nothing to compare")
    choose_expert_storage(target, "auto", 1, pair.drafter.config.block_size)
    ar = ReferenceRuntime(target, None)
    dflash = ReferenceRuntime(target, DFlashProposer(pair.drafter, target, matmul_dtype=gemm))
    runtimes = dict(zip(VARIANTS, (ar, dflash, dflash)))
    ar.warm_up(prompts[0])
    dflash.warm_up(prompts[0])
    print(f"threads={args.threads} prompts={len(prompts)} max_tokens={args.max_tokens} repeats={args.repeats}")
    try:
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            record: dict[str, list[tuple[float, float, float]]] = {v: [] for v in VARIANTS}
            outputs = {}
            for repeat in range(args.repeats + 1):
                for variant, runtime in runtimes.items():
                    module.set_int8_tiles(variant != "dflash, avx512")
                    start = time.perf_counter()
                    results = runtime.generate(prompts, params, batch)
                    seconds = time.perf_counter() - start
                    steps = sum(r.stats.steps for r in results)
                    outputs[variant] = [r.output_token_ids for r in results]
                    if repeat:
                        record[variant].append((sum(len(o) for o in outputs[variant]) / seconds,
                                                runtime.step_times["draft"] / steps * 1e3,
                                                runtime.step_times["verify"] / steps * 1e3))
            same = all(outputs[v] == outputs["ar"] for v in VARIANTS)
            print(f"\nbatch {batch}: same tokens in all three: {same}")
            print(f"{'variant':<22}{'tok/s':>24}{'drafter step ms':>24}{'verify step ms':>24}")
            for variant, rows in record.items():
                tok_s, draft, verify = zip(*rows)
                print(f"{variant:<22}{spread(list(tok_s), '{:.0f}'):>24}{spread(list(draft), '{:.3f}'):>24}"
                      f"{spread(list(verify), '{:.3f}'):>24}")
    finally:
        module.set_int8_tiles(True)


if __name__ == "__main__":
    main()
