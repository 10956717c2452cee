"""Step costs of the reference runtime inside the loop, beside their FLOP floors, and its
autoregressive decoding against transformers' `generate` on the same target.

    python benchmarks/bench_step_costs.py [--target DIR --drafter DIR] [--prompts 16] [--max-tokens 128]
                                          [--batch-sizes 1,4,8] [--repeats 3] [--threads 1]

Per repeat and batch size, three runs interleaved on the same prompts (greedy, no stop ids, so every
run decodes the same length): our autoregressive loop, the DFlash loop, and `GptOssForCausalLM.generate`
(left-padded batches). Step costs come from the loop's own timers: an AR step and a DFlash verify step
are the time of `target(...)` plus acceptance per loop iteration, a drafter step the time of
`DFlashProposer.propose` per iteration. Each figure is the median over repeats, with min..max.

FLOP floors: 2 x the multiply-adds a step needs at the run's mean context (the drafter's context
projection at the run's mean tokens committed per step), at the GEMM rate this core sustains on a
[64, H] x [H, V] product, measured here first. They are the time a step would take if it were pure
arithmetic at that rate; on a small model the gap to them is per-op overhead and weight traffic.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from trtllm_dflash.checkpoints.gpt_oss import load_hf_gpt_oss
from trtllm_dflash.models.drafter import DFlashConfig, load_drafter
from trtllm_dflash.models.target import GptOssTarget
from trtllm_dflash.prompts import load_tokenizer, read_prompts_file
from trtllm_dflash.runtime.proposers import DFlashProposer
from trtllm_dflash.runtime.reference import ReferenceRuntime
from trtllm_dflash.runtime.sampling import SamplingParams


def gemm_rate(hidden: int, vocab: int, calls: int = 50) -> float:
    """FLOP/s of one [64, hidden] x [hidden, vocab] fp32 GEMM, best of `calls`."""
    a, b = torch.randn(64, hidden), torch.randn(hidden, vocab)
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * 64 * hidden * vocab / best


def target_flops(cfg, tokens: int, context: float) -> float:
    """FLOPs of `tokens` new tokens through the target at a mean visible context of `context`."""
    h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    per_layer = (h * (hq + 2 * hkv) * d + hq * d * h + h * cfg.num_local_experts
                 + cfg.num_experts_per_tok * 3 * h * cfg.intermediate_size)
    attention = sum(2 * hq * d * (min(context, cfg.sliding_window) if kind == "sliding_attention" else context)
                    for kind in cfg.layer_types)
    return 2 * tokens * (cfg.num_hidden_layers * per_layer + attention + h * cfg.vocab_size)


def drafter_flops(cfg: DFlashConfig, vocab: int, committed: float, context: float) -> float:
    """FLOPs of one drafter step: `committed` new context positions projected into every layer,
    one block through the layers at a mean context of `context`, and the LM head on B - 1 slots."""
    h, d, hq, hkv, width = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.block_size
    layers = cfg.num_hidden_layers
    ctx = committed * (len(cfg.target_layer_ids) * h * h + layers * 2 * hkv * d * h)
    block = width * layers * (h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * cfg.intermediate_size
                              + 2 * hq * d * (context + width))
    return 2 * (ctx + block + (width - 1) * h * vocab)


@dataclass
class Run:
    seconds: float  # wall time of the whole call (prefill included)
    tokens: int
    outputs: list[list[int]]
    steps: int = 0  # loop iterations
    draft_s: float = 0.0
    verify_s: float = 0.0
    tau: float = 0.0


def run_loop(runtime: ReferenceRuntime, prompts, params, batch: int) -> Run:
    start = time.perf_counter()
    results = runtime.generate(prompts, params, batch)
    seconds = time.perf_counter() - start
    steps = sum(max(r.stats.steps for r in results[i: i + batch]) for i in range(0, len(results), batch))
    committed = sum(r.stats.num_decode_tokens for r in results)
    return Run(seconds, sum(len(r.output_token_ids) for r in results), [r.output_token_ids for r in results],
               steps, runtime.step_times["draft"], runtime.step_times["verify"],
               committed / max(sum(r.stats.steps for r in results), 1))


def run_generate(hf, prompts, max_tokens: int, batch: int, pad_id: int) -> Run:
    outputs = []
    start = time.perf_counter()
    for first in range(0, len(prompts), batch):
        chunk = prompts[first: first + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=pad_id)
        outputs.extend(out[:, width:].tolist())
    seconds = time.perf_counter() - start
    return Run(seconds, sum(len(o) for o in outputs), outputs)


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}..{fmt.format(max(values))})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=str)
    parser.add_argument("--drafter", type=str)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", default="1,4,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from trtllm_dflash.embedded import PROMPTS_FILE, pair_paths

    target_dir, drafter_dir = (args.target, args.drafter) if args.target else pair_paths()
    target = GptOssTarget(load_hf_gpt_oss(target_dir, "cpu", torch.float32))
    drafter = load_drafter(drafter_dir, "cpu", torch.float32)
    tokenizer = load_tokenizer(target_dir)
    prompts = [tokenizer.encode(p) if isinstance(p, str) else p for p in read_prompts_file(PROMPTS_FILE)[: args.prompts]]
    params = SamplingParams(max_tokens=args.max_tokens)
    ar, dflash = ReferenceRuntime(target, None), ReferenceRuntime(target, DFlashProposer(drafter, target))
    pad_id = target.config.pad_token_id if target.config.pad_token_id is not None else 0
    for runtime in (ar, dflash):
        runtime.warm_up(prompts[0])
    run_generate(target.hf, prompts[:1], 3, 1, pad_id)
    rate = gemm_rate(target.hidden_size, target.vocab_size)
    context = statistics.mean(len(p) for p in prompts) + args.max_tokens / 2

    print(f"threads={args.threads} prompts={len(prompts)} max_tokens={args.max_tokens} repeats={args.repeats} "
          f"block={drafter.config.block_size} gemm_rate={rate / 1e9:.1f} GFLOP/s mean_context={context:.0f}")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        runs: dict[str, list[Run]] = {"ar": [], "dflash": [], "generate": []}
        for _ in range(args.repeats):
            for name, runtime in (("ar", ar), ("dflash", dflash)):
                runs[name].append(run_loop(runtime, prompts, params, batch))
            runs["generate"].append(run_generate(target.hf, prompts, args.max_tokens, batch, pad_id))
        reference = run_loop(ar, prompts, params, 1).outputs if batch > 1 else runs["ar"][0].outputs
        tau = statistics.median(r.tau for r in runs["dflash"])
        ar_step = [r.verify_s / r.steps * 1e3 for r in runs["ar"]]
        verify = [r.verify_s / r.steps * 1e3 for r in runs["dflash"]]
        draft = [r.draft_s / r.steps * 1e3 for r in runs["dflash"]]
        floors = {"ar": target_flops(target.config, batch, context),
                  "verify": target_flops(target.config, batch * drafter.config.block_size, context),
                  "draft": batch * drafter_flops(drafter.config, target.vocab_size, tau, context)}
        print(f"\nbatch {batch}: DFlash tau {tau:.2f}; lossless vs batch-1 AR: "
              f"DFlash {sum(o == e for o, e in zip(runs['dflash'][-1].outputs, reference))}/{len(prompts)}, "
              f"AR {sum(o == e for o, e in zip(runs['ar'][-1].outputs, reference))}/{len(prompts)}, "
              f"generate {sum(o == e for o, e in zip(runs['generate'][-1].outputs, reference))}/{len(prompts)}")
        print(f"{'step':<24}{'ms, median (min..max)':>26}{'x AR step':>11}{'FLOP floor ms':>15}")
        for name, values, floor in (("AR step", ar_step, floors["ar"]),
                                    (f"verify ({drafter.config.block_size} tokens)", verify, floors["verify"]),
                                    ("drafter step", draft, floors["draft"])):
            ratios = [v / a for v, a in zip(values, ar_step)]
            print(f"{name:<24}{spread(values):>26}{statistics.median(ratios):>10.2f}x{floor / rate * 1e3:>15.3f}")
        rates = {name: [r.tokens / r.seconds for r in rs] for name, rs in runs.items()}
        print(f"{'end to end tok/s':<24}{'median (min..max)':>26}{'x generate':>11}")
        for name in ("ar", "dflash", "generate"):
            ratios = [r / g for r, g in zip(rates[name], rates["generate"])]
            print(f"{name:<24}{spread(rates[name], '{:.1f}'):>26}{statistics.median(ratios):>10.2f}x")


if __name__ == "__main__":
    main()
