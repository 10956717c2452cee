"""Reference runtime: DFlash vs autoregressive decoding on the same prompts, in one process.

    python benchmarks/bench_reference_runtime.py [--target DIR --drafter DIR] [--batch-size N] ...

Without a pair it builds a random one at the embedded default's scale (gpt-oss architecture,
hidden 256, 4 layers, 8 experts; 1-layer drafter, block 8). Random weights accept almost nothing,
so that number is the loop's overhead (draft cost + wider verify), not a DFlash speed-up.
Both runs are interleaved per repeat and the ratio is taken per repeat, so machine noise cancels.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from trtllm_dflash.checkpoints.gpt_oss import load_hf_gpt_oss
from trtllm_dflash.models.drafter import load_drafter
from trtllm_dflash.models.random_pair import drafter_config_for, save_random_drafter, save_random_target, tiny_target_config
from trtllm_dflash.models.target import GptOssTarget
from trtllm_dflash.runtime.proposers import DFlashProposer
from trtllm_dflash.runtime.reference import ReferenceRuntime
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.runtime.stats import total_stats


def random_pair(root: Path) -> tuple[Path, Path]:
    config = tiny_target_config(vocab_size=4096, hidden_size=256, num_layers=4, heads=4, kv_heads=2, head_dim=64,
                                experts=8, top_k=2, intermediate_size=256, sliding_window=64, eos_token_id=4095)
    save_random_target(root / "target", config)
    save_random_drafter(root / "drafter", drafter_config_for(config, num_layers=1, block_size=8,
                                                             target_layer_ids=[0, 1, 2]))
    return root / "target", root / "drafter"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path)
    parser.add_argument("--drafter", type=Path)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        target_dir, drafter_dir = (args.target, args.drafter) if args.target else random_pair(Path(tmp))
        dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
        target = GptOssTarget(load_hf_gpt_oss(target_dir, args.device, dtype))
        drafter = load_drafter(drafter_dir, args.device, dtype)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.vocab_size - 2, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.max_tokens)
    runtimes = {"dflash": ReferenceRuntime(target, DFlashProposer(drafter, target)), "ar": ReferenceRuntime(target, None)}
    for runtime in runtimes.values():
        runtime.warm_up(prompts[0])
    rates: dict[str, list[float]] = {name: [] for name in runtimes}
    for _ in range(args.repeats):
        for name, runtime in runtimes.items():
            results = runtime.generate(prompts, params, args.batch_size)
            total = total_stats(results, args.batch_size)
            rates[name].append(total.decode_tokens_per_s)
            if name == "dflash":
                tau, share = total.acceptance_length, runtime.step_times["draft"] / sum(runtime.step_times.values())
    ratios = [d / a for d, a in zip(rates["dflash"], rates["ar"])]
    print(f"device={args.device} threads={args.threads} prompts={args.prompts} batch={args.batch_size} "
          f"max_tokens={args.max_tokens} pair={'given' if args.target else 'random'}")
    print(f"autoregressive decode tokens/s: {statistics.median(rates['ar']):.1f}")
    print(f"dflash decode tokens/s:         {statistics.median(rates['dflash']):.1f}  (tau {tau:.2f}, "
          f"draft share of step time {share:.0%})")
    print(f"speed-up (median of per-repeat ratios): {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    sys.exit(main())
