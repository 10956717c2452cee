"""The same sweep in-process and through a real Triton server, side by side: the server's overhead.

    python benchmarks/bench_server_overhead.py --ar-url http://127.0.0.1:PORT_AR --dflash-url http://127.0.0.1:PORT \
        [--concurrency 1,2,4] [--requests 8] [--max-tokens 32] [--repeats 3] [--threads 1]

Run from the serve venv (`pip install -e '.[serve]'`), with two `dflash-serve` processes on the
embedded engine: one `--autoregressive`, one with DFlash (the engine's max_draft_len). The sweep
interleaves four runners at every concurrency and repeat -- in-process AR, in-process DFlash at the
engine's draft length, and the same two through the servers -- on the embedded held-out prompts
(token ids, so both sides decode the same prompts). The in-process runtime ignores stop tokens; the
server stops at the engine's, so its requests may be shorter: per-token figures (TPOT, tokens/s)
compare, request counts do not.
"""

from __future__ import annotations

import argparse

import torch

from trtllm_dflash.bench.endpoints import TritonEndpoint
from trtllm_dflash.bench.load import LoadShape
from trtllm_dflash.bench.points import CONCURRENCY
from trtllm_dflash.bench.sweep import EndpointRunner, InProcessRunner, run_sweep
from trtllm_dflash.checkpoints.gpt_oss import load_hf_gpt_oss
from trtllm_dflash.embedded import heldout_prompts, pair_paths
from trtllm_dflash.models.drafter import load_drafter
from trtllm_dflash.models.target import GptOssTarget
from trtllm_dflash.prompts import prompt_token_ids
from trtllm_dflash.runtime.proposers import DFlashProposer
from trtllm_dflash.runtime.reference import ReferenceRuntime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ar-url", required=True)
    parser.add_argument("--dflash-url", required=True)
    parser.add_argument("--draft-len", type=int, default=7, help="the DFlash engine's max_draft_len")
    parser.add_argument("--concurrency", default="1,2,4")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target_dir, drafter_dir = pair_paths()
    prompts = prompt_token_ids(heldout_prompts(limit=1024), target_dir)
    target = GptOssTarget(load_hf_gpt_oss(target_dir, "cpu", torch.float32))
    drafter = load_drafter(drafter_dir, "cpu", torch.float32)
    k = args.draft_len
    runners = [InProcessRunner("ar", 0, ReferenceRuntime(target, None, inflight=True), args.max_tokens),
               InProcessRunner("dflash", k, ReferenceRuntime(target, DFlashProposer(drafter, target, k + 1),
                                                             inflight=True), args.max_tokens)]
    for method, draft_len, url in (("ar", 0, args.ar_url), ("dflash", k, args.dflash_url)):
        endpoint = TritonEndpoint(url, "dflash", args.max_tokens)
        endpoint.check()
        runners.append(EndpointRunner(f"{method}@triton", draft_len, endpoint))  # its own label in the points
    levels = [int(c) for c in args.concurrency.split(",")]
    shapes = [LoadShape(CONCURRENCY, c, -(-args.requests // c) * c) for c in levels]
    points = run_sweep(runners, prompts, shapes, args.repeats)
    print(f"threads={args.threads} requests>={args.requests} max_tokens={args.max_tokens} repeats={args.repeats} "
          f"(medians; +/- half the min-max range over repeats)\n")
    print("| c | method | where | tok/s | tok/s/user | TTFT p50 ms | TPOT p50 ms | TPOT p99 ms | ITL p99 ms | "
          "tokens/request | tau |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    by_key = {(p.concurrency, "Triton server" if p.method.endswith("@triton") else "in-process",
               p.method.removesuffix("@triton")): p for p in points}
    for c in levels:
        for method in ("ar", "dflash"):
            for place in ("in-process", "Triton server"):
                p = by_key[(c, place, method)]
                lat = p.latency
                tokens = p.tokens_per_s / p.requests_per_s if p.requests_per_s else 0.0
                spread = p.spread()
                print(f"| {c} | {method if method == 'ar' else f'DFlash K={k}'} | {place} | {p.tokens_per_s:.0f} "
                      f"+/- {spread * 50:.0f}% | {p.tokens_per_s_user:.0f} | {lat['ttft_s']['p50'] * 1e3:.1f} | "
                      f"{lat['tpot_s']['p50'] * 1e3:.2f} | {lat['tpot_s']['p99'] * 1e3:.2f} | "
                      f"{lat['itl_s']['p99'] * 1e3:.1f} | {tokens:.1f} | {p.tau:.2f} |")
        for method in ("ar", "dflash"):
            local, served = by_key[(c, "in-process", method)], by_key[(c, "Triton server", method)]
            overhead = served.latency["tpot_s"]["p50"] - local.latency["tpot_s"]["p50"]
            print(f"|  | server overhead, {method} | c={c} | {served.tokens_per_s / local.tokens_per_s:.2f}x tok/s | "
                  f"| | {overhead * 1e3:+.2f} ms/token TPOT p50 | | | | |")


if __name__ == "__main__":
    main()
