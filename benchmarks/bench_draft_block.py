"""Benchmark the draft-block Triton kernel against torch SDPA at the gpt-oss-120b drafter's shapes.

One drafter layer: Hq 64, Hkv 8, D 64, B 10, bf16, every request at the full context length.
Reports per (batch, context): latency of the Triton op (split-K plan chosen as in production),
latency of torch SDPA on the same problem (keys pre-concatenated [context | block], GQA, no mask:
SDPA gets its best case and the concatenation is not timed), the bytes floor (every context K/V byte
read once, plus q / block K/V / output), the kernel's achieved bandwidth against that floor, and a
measured device copy of the same number of bytes (read + write, i.e. what HBM actually sustains).

Usage (GPU host, < 5 minutes on an H200):  python benchmarks/bench_draft_block.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

HQ, HKV, D, BLOCK = 64, 8, 64, 10
CONTEXTS = (1024, 4096, 16384, 32768)
BATCHES = (1, 8, 32, 64)
DTYPE = torch.bfloat16


def make_problem(batch: int, context: int) -> tuple[torch.Tensor, ...]:
    rows = batch * BLOCK
    q = torch.randn(rows, HQ, D, device="cuda", dtype=DTYPE)
    k_blk, v_blk = torch.randn(2, rows, HKV, D, device="cuda", dtype=DTYPE)
    ctx_k, ctx_v = torch.randn(2, batch, HKV, context, D, device="cuda", dtype=DTYPE)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    return q, k_blk, v_blk, ctx_k, ctx_v, lens


def floor_bytes(batch: int, context: int) -> int:
    """Bytes any implementation must move: context K/V once, q + block K/V in, output out."""
    elem = torch.finfo(DTYPE).bits // 8
    return elem * (2 * batch * HKV * context * D + 2 * batch * BLOCK * HQ * D + 2 * batch * BLOCK * HKV * D)


def sdpa_inputs(q, k_blk, v_blk, ctx_k, ctx_v):
    batch = ctx_k.shape[0]
    q4 = q.view(batch, BLOCK, HQ, D).transpose(1, 2)
    keys = torch.cat([ctx_k, k_blk.view(batch, BLOCK, HKV, D).transpose(1, 2)], dim=2)
    values = torch.cat([ctx_v, v_blk.view(batch, BLOCK, HKV, D).transpose(1, 2)], dim=2)
    return q4, keys, values


def bench(batch: int, context: int, do_bench) -> dict:
    from trtllm_dflash.plugins.draft_block.triton_kernels import draft_block_attention_triton

    problem = make_problem(batch, context)
    scale = D**-0.5
    q4, keys, values = sdpa_inputs(*problem[:5])
    ours = draft_block_attention_triton(*problem, scale)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q4, keys, values, scale=scale, enable_gqa=True)
    max_err = (ours.view(batch, BLOCK, HQ, D).transpose(1, 2).float() - sdpa.float()).abs().max().item()
    t_ours = do_bench(lambda: draft_block_attention_triton(*problem, scale))
    t_sdpa = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
        q4, keys, values, scale=scale, enable_gqa=True))
    nbytes = floor_bytes(batch, context)
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t_copy = do_bench(lambda: dst.copy_(src))
    return {
        "batch": batch, "context": context, "triton_ms": t_ours, "sdpa_ms": t_sdpa, "max_abs_err": max_err,
        "floor_MB": nbytes / 1e6, "triton_GBps": nbytes / t_ours / 1e6, "copy_GBps": 2 * nbytes / t_copy / 1e6,
        "floor_ms_at_copy_bw": t_copy / 2,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_draft_block: no CUDA device; this benchmark needs an NVIDIA GPU (e.g. H200).", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    print(f"{torch.cuda.get_device_name()}  Hq {HQ}  Hkv {HKV}  D {D}  B {BLOCK}  {DTYPE}")
    print(f"{'batch':>5} {'ctx':>6} {'triton ms':>10} {'sdpa ms':>9} {'floor MB':>9} {'triton GB/s':>12} "
          f"{'copy GB/s':>10} {'% of copy':>9} {'max err':>8}")
    rows = []
    for context in CONTEXTS:
        for batch in BATCHES:
            row = bench(batch, context, do_bench)
            rows.append(row)
            print(f"{batch:>5} {context:>6} {row['triton_ms']:>10.4f} {row['sdpa_ms']:>9.4f} {row['floor_MB']:>9.1f} "
                  f"{row['triton_GBps']:>12.0f} {row['copy_GBps']:>10.0f} "
                  f"{100 * row['triton_GBps'] / row['copy_GBps']:>8.0f}% {row['max_abs_err']:>8.1e}")
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
