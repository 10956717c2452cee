"""Step costs of the reference runtime inside the loop, beside their FLOP floors, and its
autoregressive decoding against transformers' `generate` on the same target.

    python benchmarks/bench_step_costs.py [--target DIR --drafter DIR] [--prompts 16] [--max-tokens 128]
                                          [--batch-sizes 1,4,8] [--repeats 3] [--threads 1]
                                          [--drafter-gemm-dtype auto|float32|bfloat16|float16]
                                          [--expert-dtype auto|float32|bfloat16|float16|int8|amx]

Per repeat and batch size, three runs interleaved on the same prompts (greedy, no stop ids, so every
run decodes the same length): our autoregressive loop, the DFlash loop, and `GptOssForCausalLM.generate`
(left-padded batches). Step costs come from the loop's own timers: an AR step and a DFlash verify step
are the time of `target(...)` plus acceptance per loop iteration, a drafter step the time of
`DFlashProposer.propose` per iteration (its GEMMs in the dtype `dflash-run` would pick). Each figure is
the median over repeats, with min..max.

FLOP floors: 2 x the multiply-adds a step needs at the run's mean context (the drafter's context
projection at the run's mean tokens committed per step), at the GEMM rate this core sustains on a
[64, H] x [H, V] product, measured here first. They are the time a step would take if it were pure
arithmetic at that rate.

Byte floors: the bytes a step must read (every weight it multiplies -- for the target's MoE only the
experts its tokens route to, counted by a hook on each router in an untimed run of the same loops -- the LM
head, and the K/V its attention reads at the mean context) at the rate this core streams a 64 MB fp32 tensor,
measured here first. They are the time a step would take if it only had to read its operands once from
memory. Above both floors, the rest is per-op and Python overhead.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch

from trtllm_dflash.bench.local_pair import add_pair_arguments, load_local_pair
from trtllm_dflash.models.drafter_config import DFlashConfig
from trtllm_dflash.models.linear import (DRAFTER_GEMM_DTYPES, NARROW_MIN_ROWS, drafter_gemm_dtype, gemm_dtype,
                                         half_or, onednn_packs)
from trtllm_dflash.models.target import GptOssTarget
from trtllm_dflash.runtime.proposers import DFlashProposer
from trtllm_dflash.runtime.reference import ReferenceRuntime
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.runtime.tuning import EXPERT_DTYPES, choose_expert_storage, expert_storage_note


def gemm_rate(hidden: int, vocab: int, calls: int = 50) -> float:
    """FLOP/s of one [64, hidden] x [hidden, vocab] fp32 GEMM, best of `calls`."""
    a, b = torch.randn(64, hidden), torch.randn(hidden, vocab)
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * 64 * hidden * vocab / best


def stream_rate(megabytes: int = 64, calls: int = 5) -> float:
    """Bytes/s this core reads from memory: summing a tensor well past the last-level cache, best of `calls`."""
    data = torch.ones(megabytes * 2**20 // 4)
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def nbytes(*modules: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


class ExpertsTouched:
    """Per router call with n routed tokens, how many distinct experts they reach; `mean(n, layers)` is the mean
    over such calls times `layers`. Counted in an untimed run of its own (`count`): a hooked router sends the
    target's lean forward down its hook-aware path (`models.target.hooked`, the router as a module, the experts
    outside their compiled call), which took 1.5x the time of a lone token's forward on an AVX2 VM (0.98 against
    0.66 ms, round 24), so no timed run may carry the hooks."""

    def __init__(self, target: GptOssTarget):
        self.routers = [layer.mlp.router for layer in target.hf.model.layers]
        self.counts: dict[int, list[int]] = {}

    def count(self, run) -> None:
        """Call `run()` with a forward hook on every router, removed afterwards."""
        handles = [router.register_forward_hook(self.record) for router in self.routers]
        try:
            run()
        finally:
            for handle in handles:
                handle.remove()

    def record(self, module, inputs, output) -> None:
        indices = output[-1]
        self.counts.setdefault(indices.shape[0], []).append(int(indices.unique().numel()))

    def mean(self, tokens: int, layers: int) -> float:
        calls = self.counts.get(tokens, [])
        return layers * sum(calls) / len(calls) if calls else float("nan")


def target_bytes(target: GptOssTarget, experts_touched: float, batch: int, context: float) -> float:
    """Bytes a target step reads: attention, router and norm weights of every layer, `experts_touched`
    experts in all (summed over layers) in the storage the lean path reads (`GptOssTarget.expert_storage`),
    the LM head in its copy's dtype, and the K/V of `batch` rows at `context`."""
    cfg, layers = target.config, target.hf.model.layers
    experts = layers[0].mlp.experts
    per_expert = (target.expert_bytes() / len(layers)
                  + nbytes(experts) - experts.gate_up_proj.nbytes - experts.down_proj.nbytes) / cfg.num_local_experts
    dense = sum(nbytes(layer.self_attn, layer.mlp.router, layer.input_layernorm, layer.post_attention_layernorm)
                for layer in layers)
    kv = sum(batch * 2 * cfg.num_key_value_heads * cfg.head_dim * 4 *
             (min(context, cfg.sliding_window) if kind == "sliding_attention" else context) for kind in cfg.layer_types)
    head = target.hf.lm_head.weight.numel() * target.head.dtype.itemsize
    return dense + experts_touched * per_expert + head + nbytes(target.hf.model.norm) + kv


def drafter_bytes(drafter, target: GptOssTarget, batch: int, context: float, wanted: torch.dtype | None) -> float:
    """Bytes a drafter step reads: all its weights and the target's LM head, each in the dtype its GEMM
    runs in when `wanted` is asked (`gemm_dtype`; below `NARROW_MIN_ROWS` draft rows a oneDNN-packed GEMM
    runs its copy for few rows, `CastLinear.few_rows`: fbgemm's float16 where it runs, else float32), its
    context K/V at `context`."""
    cfg = drafter.config
    few_rows = batch * (cfg.block_size - 1) < NARROW_MIN_ROWS

    def dtype(p: torch.Tensor) -> torch.dtype:
        chosen = gemm_dtype(p, wanted)
        if few_rows and onednn_packs(chosen, p.device) and chosen.itemsize < p.dtype.itemsize:
            return half_or(p.dtype, p.device)
        return chosen

    window = min(context, cfg.sliding_window or context)
    kv = batch * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4 * window
    params = [p for m in (drafter, target.hf.lm_head) for p in m.parameters()]
    return sum(p.numel() * dtype(p).itemsize for p in params) + kv


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
    add_pair_arguments(parser)
    parser.add_argument("--batch-sizes", default="1,4,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--expert-dtype", choices=EXPERT_DTYPES, default="auto",
                        help="as dflash-run's option of that name (auto: timed at the first batch size)")
    parser.add_argument("--drafter-gemm-dtype", choices=DRAFTER_GEMM_DTYPES, default="auto",
                        help="as dflash-run's option of that name")
    args = parser.parse_args()
    pair = load_local_pair(args)
    target, drafter, prompts = pair.target, pair.drafter, pair.prompts
    params = SamplingParams(max_tokens=args.max_tokens)
    gemm = drafter_gemm_dtype(args.drafter_gemm_dtype, torch.float32, torch.device("cpu"))
    first_batch, block = int(args.batch_sizes.split(",")[0]), drafter.config.block_size
    print(expert_storage_note(target, choose_expert_storage(target, args.expert_dtype, first_batch, block),
                              first_batch, block))
    ar = ReferenceRuntime(target, None)
    dflash = ReferenceRuntime(target, DFlashProposer(drafter, target, matmul_dtype=gemm))
    pad_id = target.config.pad_token_id if target.config.pad_token_id is not None else 0
    for runtime in (ar, dflash):
        runtime.warm_up(prompts[0])
    run_generate(target.hf, prompts[:1], 3, 1, pad_id)
    rate, bandwidth = gemm_rate(target.hidden_size, target.vocab_size), stream_rate()
    context = statistics.mean(len(p) for p in prompts) + args.max_tokens / 2
    touched = ExpertsTouched(target)

    print(f"threads={args.threads} prompts={len(prompts)} max_tokens={args.max_tokens} repeats={args.repeats} "
          f"block={drafter.config.block_size} gemm_rate={rate / 1e9:.1f} GFLOP/s stream={bandwidth / 1e9:.1f} GB/s "
          f"mean_context={context:.0f} drafter_gemm_dtype={str(gemm or torch.float32).removeprefix('torch.')}")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        runs: dict[str, list[Run]] = {"ar": [], "dflash": [], "generate": []}
        touched.count(lambda: [run_loop(runtime, prompts, params, batch) for runtime in (ar, dflash)])
        for _ in range(args.repeats):
            for name, runtime in (("ar", ar), ("dflash", dflash)):
                runs[name].append(run_loop(runtime, prompts, params, batch))
            runs["generate"].append(run_generate(target.hf, prompts, args.max_tokens, batch, pad_id))
        reference = run_loop(ar, prompts, params, 1).outputs if batch > 1 else runs["ar"][0].outputs
        tau = statistics.median(r.tau for r in runs["dflash"])
        ar_step = [r.verify_s / r.steps * 1e3 for r in runs["ar"]]
        verify = [r.verify_s / r.steps * 1e3 for r in runs["dflash"]]
        draft = [r.draft_s / r.steps * 1e3 for r in runs["dflash"]]
        block, layers = drafter.config.block_size, target.num_layers
        floors = {"ar": target_flops(target.config, batch, context),
                  "verify": target_flops(target.config, batch * block, context),
                  "draft": batch * drafter_flops(drafter.config, target.vocab_size, tau, context)}
        byte_floors = {"ar": target_bytes(target, touched.mean(batch, layers), batch, context),
                       "verify": target_bytes(target, touched.mean(batch * block, layers), batch, context),
                       "draft": drafter_bytes(drafter, target, batch, context, gemm)}
        print(f"\nbatch {batch}: DFlash tau {tau:.2f}; lossless vs batch-1 AR: "
              f"DFlash {sum(o == e for o, e in zip(runs['dflash'][-1].outputs, reference))}/{len(prompts)}, "
              f"AR {sum(o == e for o, e in zip(runs['ar'][-1].outputs, reference))}/{len(prompts)}, "
              f"generate {sum(o == e for o, e in zip(runs['generate'][-1].outputs, reference))}/{len(prompts)}")
        print(f"experts touched per layer: AR step {touched.mean(batch, 1):.2f}, "
              f"verify {touched.mean(batch * block, 1):.2f} of {target.config.num_local_experts}")
        print(f"{'step':<24}{'ms, median (min..max)':>26}{'x AR step':>11}{'FLOP floor ms':>15}"
              f"{'MB read':>9}{'byte floor ms':>15}")
        for name, values, key in (("AR step", ar_step, "ar"), (f"verify ({block} tokens)", verify, "verify"),
                                  ("drafter step", draft, "draft")):
            ratios = [v / a for v, a in zip(values, ar_step)]
            print(f"{name:<24}{spread(values):>26}{statistics.median(ratios):>10.2f}x{floors[key] / rate * 1e3:>15.3f}"
                  f"{byte_floors[key] / 2**20:>9.1f}{byte_floors[key] / bandwidth * 1e3:>15.3f}")
        rates = {name: [r.tokens / r.seconds for r in rs] for name, rs in runs.items()}
        print(f"{'end to end tok/s':<24}{'median (min..max)':>26}{'x generate':>11}")
        for name in ("ar", "dflash", "generate"):
            ratios = [r / g for r, g in zip(rates[name], rates["generate"])]
            print(f"{name:<24}{spread(rates[name], '{:.1f}'):>26}{statistics.median(ratios):>10.2f}x")


if __name__ == "__main__":
    main()
