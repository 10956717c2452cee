"""Drafter quantization vs acceptance: tau with the drafter in bf16, FP8 and NVFP4, target as stored.

    python benchmarks/bench_drafter_quant.py [--target DIR --drafter DIR] [--prompts N] [--max-tokens N]

Default pair: the embedded one, on its held-out prompts. FP8 / NVFP4 drafters get static input
scales from calibration on other held-out prompts than the measured ones, then are converted with
the same recipes `dflash-build --drafter-quant` uses and loaded back (dequantized) into the
reference runtime. Greedy decoding; the table also checks the output stayed lossless.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from trtllm_dflash.checkpoints.gpt_oss import load_hf_gpt_oss
from trtllm_dflash.models.drafter import load_drafter
from trtllm_dflash.models.target import GptOssTarget
from trtllm_dflash.prompts import load_tokenizer, read_prompts_file
from trtllm_dflash.quant.calibrate import calibrate, for_recipe
from trtllm_dflash.quant.convert import convert_checkpoint
from trtllm_dflash.runtime.proposers import DFlashProposer
from trtllm_dflash.runtime.reference import ReferenceRuntime
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.runtime.stats import total_stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path)
    parser.add_argument("--drafter", type=Path)
    parser.add_argument("--prompts-file", type=Path)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--calibration-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.target is None:
        from trtllm_dflash.embedded import PROMPTS_FILE, pair_paths

        args.target, args.drafter = pair_paths()
        args.prompts_file = args.prompts_file or PROMPTS_FILE
    tokenizer = load_tokenizer(args.target)
    texts = read_prompts_file(args.prompts_file)
    encoded = [tokenizer.encode(p) if isinstance(p, str) else p for p in texts]
    measured = encoded[: args.prompts]
    calibration = encoded[args.prompts: args.prompts + args.calibration_prompts]
    target = GptOssTarget(load_hf_gpt_oss(args.target))
    params = SamplingParams(max_tokens=args.max_tokens)
    reference = [r.output_token_ids for r in ReferenceRuntime(target, None).generate(measured, params)]

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        drafter = load_drafter(args.drafter)
        runtime = ReferenceRuntime(target, DFlashProposer(drafter, target))
        amax = calibrate([drafter], lambda: runtime.generate(calibration, SamplingParams(max_tokens=32)))
        for recipe in ("bf16", "fp8", "nvfp4"):
            directory = args.drafter
            if recipe != "bf16":
                directory = Path(tmp) / recipe
                convert_checkpoint(args.drafter, directory, recipe, input_amax=for_recipe(amax, recipe),
                                   progress=False)
            quantized = load_drafter(directory)
            results = ReferenceRuntime(target, DFlashProposer(quantized, target)).generate(measured, params)
            total = total_stats(results, 1)
            lossless = sum(r.output_token_ids == ref for r, ref in zip(results, reference))
            rows.append((recipe, total.acceptance_length, total.per_position_acceptance, lossless))
    print(f"target={args.target} drafter={args.drafter} prompts={len(measured)} max_tokens={args.max_tokens} "
          f"calibration_prompts={len(calibration)}")
    print(f"{'drafter':<8}{'tau':>7}  per-position acceptance{'':<20}lossless")
    for recipe, tau, positions, lossless in rows:
        print(f"{recipe:<8}{tau:>7.3f}  {' '.join(f'{p:.2f}' for p in positions):<43}{lossless}/{len(measured)}")


if __name__ == "__main__":
    main()
