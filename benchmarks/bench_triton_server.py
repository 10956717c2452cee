"""Tokens/s and time per output token through a real Triton server (dflash-serve): DFlash vs n-gram vs AR.

Starts one dflash-serve process on loopback ports per `--methods` entry (default: dflash-sa, the served default;
ngram, prompt lookup, the strongest simple baseline; ar, --autoregressive; dflash, DFlash alone, on request), each
with every `--batching` asked for (`dflash-serve --batching`; rows named method-batching when there are several),
then, interleaved round by round, sends `--requests` (16) streaming greedy requests of distinct held-out prompts
(HTTP generate_stream) at each concurrency to each. Per level: aggregate output tokens/s (median and range over rounds),
p50/p99 time per output token, per request: (last event - first event) / (tokens after the first
event), and p50/p99 time to the first event, as the client sees them. Run it in the serve venv
(pip install -e '.[serve]'):

    OMP_NUM_THREADS=1 python benchmarks/bench_triton_server.py [ENGINE_DIR] --rounds 3 [--batching inflight,static]
        [--methods dflash-sa,ngram,ar]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from trtllm_dflash.embedded import heldout_prompts
from trtllm_dflash.triton.server import free_port


def start(engine: str | None, method: str, batching: str,
          stream_interval: int | None = None) -> tuple[subprocess.Popen, str]:
    """dflash-serve with `method`: "ar" (--autoregressive) or a --draft-method."""
    http, grpc = free_port(), free_port()
    command = [str(Path(sys.executable).parent / "dflash-serve"), *([engine] if engine else []),
               "--http-port", str(http), "--grpc-port", str(grpc), "--backend", "reference", "--device", "cpu",
               "--batching", batching, "--log", "error",
               *(["--autoregressive"] if method == "ar" else ["--draft-method", method]),
               *(["--stream-interval", str(stream_interval)] if stream_interval else [])]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    for line in process.stderr:
        if line.startswith("ready:"):
            threading.Thread(target=lambda: [None for _ in process.stderr], daemon=True).start()
            return process, f"http://127.0.0.1:{http}"
    raise SystemExit(f"dflash-serve exited with {process.wait()}")


def stream(url: str, prompt: str, max_tokens: int) -> tuple[int, float | None, float]:
    """-> (output tokens, time per output token after the first event, time to the first event)."""
    body = json.dumps({"text_input": prompt, "sampling_param_max_tokens": max_tokens, "streaming": True}).encode()
    times, tokens, first = [], 0, 0
    sent = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(f"{url}/v2/models/dflash/generate_stream", body),
                                timeout=600) as response:
        for line in response:
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            ids = event.get("output_ids", [])
            count = len(ids) if isinstance(ids, list) else 1
            if count:
                times.append(time.perf_counter())
                tokens += count
                first = first or count
    after = tokens - first
    return tokens, (times[-1] - times[0]) / after if after > 0 else None, times[0] - sent


def level(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> tuple[float, list[float], list[float]]:
    """All prompts with `concurrency` in flight -> (aggregate tokens/s, per-request TPOTs, per-request TTFTs)."""
    pending, lock, totals, tpots, ttfts = list(prompts), threading.Lock(), [0], [], []

    def worker():
        while True:
            with lock:
                if not pending:
                    return
                prompt = pending.pop(0)
            tokens, tpot, ttft = stream(url, prompt, max_tokens)
            with lock:
                totals[0] += tokens
                ttfts.append(ttft)
                if tpot is not None:
                    tpots.append(tpot)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    begin = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return totals[0] / (time.perf_counter() - begin), tpots, ttfts


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("engine", nargs="?", help="Engine directory (default: the embedded engine).")
    parser.add_argument("--concurrency", default="1,4,8,16")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batching", default="inflight", help="dflash-serve --batching values, comma-separated")
    parser.add_argument("--methods", default="dflash-sa,ngram,ar",
                        help="servers to compare, comma-separated: ar (--autoregressive) or --draft-method values")
    parser.add_argument("--stream-interval", type=int, help="dflash-serve --stream-interval for every server.")
    parser.add_argument("--json", type=Path, help="Also write the results here.")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the servers inherit a fixed thread count
    levels = [int(c) for c in args.concurrency.split(",")]
    # distinct prompts (the first --requests held-out ones, 64 at most): with 4 repeated, requests decoding one prompt
    # in the same steps were identical rows of a batch, which touch fewer experts than distinct requests do
    prompts = (heldout_prompts(args.requests) * args.requests)[: args.requests]
    batchings = args.batching.split(",")
    servers = {method if len(batchings) == 1 else f"{method}-{batching}": start(args.engine, method, batching,
                                                                                 args.stream_interval)
               for batching in batchings for method in args.methods.split(",")}
    try:
        for _, url in servers.values():  # warm-up: first calls pay one-time costs
            level(url, prompts[:2], 2, 8)
        rates = {(m, c): [] for m in servers for c in levels}
        tpots = {(m, c): [] for m in servers for c in levels}
        ttfts = {(m, c): [] for m in servers for c in levels}
        for _ in range(args.rounds):
            for concurrency in levels:
                for mode, (_, url) in servers.items():  # interleaved: all see the same machine load
                    rate, per_request, first_events = level(url, prompts, concurrency, args.max_tokens)
                    rates[mode, concurrency].append(rate)
                    tpots[mode, concurrency] += per_request
                    ttfts[mode, concurrency] += first_events
    finally:
        for process, _ in servers.values():
            process.send_signal(signal.SIGTERM)
            process.wait(30)
    rows = []
    print("| mode | concurrency | tokens/s median (min-max) | TPOT p50 ms | TPOT p99 ms | TTFT p50 ms | TTFT p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for (mode, concurrency), values in rates.items():
        row = {"mode": mode, "concurrency": concurrency, "tokens_per_s": values,
               "tpot_p50_ms": 1e3 * percentile(tpots[mode, concurrency], 0.5),
               "tpot_p99_ms": 1e3 * percentile(tpots[mode, concurrency], 0.99),
               "ttft_p50_ms": 1e3 * percentile(ttfts[mode, concurrency], 0.5),
               "ttft_p99_ms": 1e3 * percentile(ttfts[mode, concurrency], 0.99)}
        rows.append(row)
        print(f"| {mode} | {concurrency} | {statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f}) "
              f"| {row['tpot_p50_ms']:.2f} | {row['tpot_p99_ms']:.2f} | {row['ttft_p50_ms']:.1f} "
              f"| {row['ttft_p99_ms']:.1f} |")
    for baseline in [m for m in ("ar", "ngram") if m in servers]:  # per-round ratios: the rounds are interleaved
        for mode in [m for m in servers if m != baseline]:
            ratios = {c: [a / b for a, b in zip(rates[mode, c], rates[baseline, c])] for c in levels}
            print(f"{mode} / {baseline}: " + ", ".join(
                f"c={c} {statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})" for c, r in ratios.items()))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
