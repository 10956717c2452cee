"""The drafter's GEMMs at its step's row counts: the compiled dot GEMMs (`plugins/draft_block/dot_gemm.h`: bf16
"dot", and int8 "dot-int8" where the CPU has AVX512-VNNI or AVX2, the same int8 GEMM on AMX tiles "dot-int8-amx" where
it has AMX-INT8, which `dot_linear` takes from 4 rows) beside fbgemm's float16-weight GEMM and oneDNN's prepacked bf16
one, interleaved per repeat, with the FLOP rate. The ratio column compares bf16 "dot" with the best of the
others (int8 excluded: it changes the numbers more).

    python benchmarks/bench_dot_gemm.py [--rows 1,8,11,56] [--repeats 5] [--calls 2000] [--threads 1]

Shapes: the embedded drafter's (hidden 256, intermediate 512, 4 query and 2 KV heads of 64, a 4096-word head), so
[out, in] = q/k/v 512 x 256, o_proj 256 x 256, gate/up 1024 x 256, down 256 x 512, the first layer's q plus every
layer's context K/V 768 x 256, the LM head 4096 x 256. Hot caches: the weights stay in L2 across calls, so this is
the GEMM's own cost; inside the loop other weights evict them (bench_step_costs.py times the step there).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from trtllm_dflash.models.linear import fbgemm_fp16, onednn_packs, packed_linear, prepack
from trtllm_dflash.plugins.draft_block import cpu

SHAPES = {"qkv": (512, 256), "o_proj": (256, 256), "gate_up": (1024, 256), "down": (256, 512),
          "first_qkv_ctx": (768, 256), "lm_head": (4096, 256)}


def per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,11,56")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if cpu.dot_kernel() is None:
        raise SystemExit("the AVX512-BF16 GEMM does not run here (a CPU without avx512_bf16, or no compiler)")
    int8 = cpu.dot_kernel(torch.int8)
    amx = int8 is not None and int8.dot_int8_tiles_available()
    cpu_device = torch.device("cpu")
    print(f"threads={args.threads} repeats={args.repeats} calls={args.calls}; us per call, median (min..max), "
          "and GFLOP/s at the median")
    for rows in (int(r) for r in args.rows.split(",")):
        for name, (out, inputs) in SHAPES.items():
            gen = torch.Generator().manual_seed(0)
            weight, bias = torch.randn(out, inputs, generator=gen) * 0.05, torch.randn(out, generator=gen)
            x = torch.randn(rows, inputs, generator=gen)
            variants = {"dot": (lambda p=cpu.dot_pack(weight)[0]: cpu.dot_linear_cpu(x, p, bias))}
            if int8 is not None:
                packed8, scales8 = cpu.dot_pack(weight, torch.int8)
                variants["dot-int8"] = lambda: cpu.dot_linear_cpu(x, packed8, bias, scales8)
                if amx:
                    variants["dot-int8-amx"] = variants["dot-int8"]  # the same call, with the tiles allowed
            if fbgemm_fp16():
                packed16 = torch.ops.quantized.linear_prepack_fp16(weight, bias)
                variants["fbgemm-fp16"] = lambda: torch.ops.quantized.linear_dynamic_fp16(x, packed16)
            if onednn_packs(torch.bfloat16, cpu_device):
                packed_bf16, x_bf16, bias_bf16 = prepack(weight.bfloat16()), x.bfloat16(), bias.bfloat16()
                variants["onednn-bf16"] = lambda: packed_linear(x_bf16, packed_bf16, bias_bf16)
            times: dict[str, list[float]] = {v: [] for v in variants}
            for _ in range(args.repeats + 1):  # the first round warms up
                for variant, fn in variants.items():
                    if int8 is not None:
                        int8.set_int8_tiles(variant == "dot-int8-amx")
                    times[variant].append(per_call_us(fn, args.calls))
            if int8 is not None:
                int8.set_int8_tiles(amx)
            times = {v: t[1:] for v, t in times.items()}
            flops = 2 * rows * inputs * out
            medians = {v: statistics.median(t) for v, t in times.items()}
            cells = [f"{v} {medians[v]:6.1f} ({min(t):.1f}..{max(t):.1f}) {flops / medians[v] / 1e3:5.0f} GF"
                     for v, t in times.items()]
            others = [m for v, m in medians.items() if not v.startswith("dot")]
            ratio = f" | dot/best other {medians['dot'] / min(others):.2f}" if others else ""
            print(f"rows {rows:3d} {name:<14} {out:4d}x{inputs:<4d} " + " | ".join(cells) + ratio)


if __name__ == "__main__":
    main()
