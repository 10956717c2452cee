"""What a served request's text costs a step as it grows: `RequestStream.add` (incremental decoding, stop strings
searched in the new text) against decoding the whole text every step (what it did before round 32).

    python benchmarks/bench_stream_text.py [--lengths 128,1024,4096] [--repeats 5] [--tokens-per-step 3]

The embedded tokenizer, the held-out prompts repeated as the output, one request, no model: per length, the mean
time a step over the last 50 steps (median over repeats, interleaved with the baseline), streaming with and without a
stop string, and non-streaming with one. The baseline is one whole-text decode a step (streaming), or one a token
(stop strings: the text is searched after every token), so it is a floor of the old per-step cost.
"""

from __future__ import annotations

import argparse
import statistics
import time

from trtllm_dflash.embedded import TARGET_DIR, heldout_prompts
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.triton.llmapi import RequestSpec
from trtllm_dflash.triton.service import Job, RequestStream

CASES = (("streaming", True, ()), ("stop string", False, ("<|never|>",)), ("streaming + stop string", True, ("<|never|>",)))


class Discarded:
    """Responses dropped where the server would send them (what is timed here is the stream's own work)."""

    def emit(self, job, outputs, final) -> None:
        pass


def incremental(decode, ids: list[int], length: int, per_step: int, streaming: bool,
                stops: tuple[str, ...]) -> tuple[float, bool]:
    """-> (mean time a step over the last 50, whether the stream's text is the whole decode)"""
    spec = RequestSpec(None, ids[:8], SamplingParams(max_tokens=length + 1), streaming=streaming, stop_strings=stops)
    stream = RequestStream(Job(spec, ids[:8], lambda outputs, final: None, lambda message, cancelled=False: None),
                           decode, frozenset(), 8, time.time_ns(), Discarded())
    times = []
    for at in range(0, length, per_step):
        start = time.perf_counter()
        stream.add(ids[at: at + per_step])
        times.append(time.perf_counter() - start)
    return statistics.mean(times[-50:]), stream.text() == decode(stream.tokens)


def whole_decodes(decode, ids: list[int], length: int, per_step: int, per_token: bool) -> float:
    times = []
    for at in range(max(0, length - 50 * per_step), length, per_step):
        start = time.perf_counter()
        for end in (range(at + 1, at + per_step + 1) if per_token else (at + per_step,)):
            decode(ids[:end])
        times.append(time.perf_counter() - start)
    return statistics.mean(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="128,1024,4096")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens-per-step", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TARGET_DIR)
    lengths = [int(n) for n in args.lengths.split(",")]
    ids = tokenizer.encode("\n".join(heldout_prompts(64)) * (1 + max(lengths) // 2000))
    per_step = args.tokens_per_step
    print(f"| output tokens | case | incremental us/step | whole-text decodes us/step |")
    print("|---|---|---|---|")
    identical = True
    for length in lengths:
        for name, streaming, stops in CASES:
            mine, floor = [], []
            for _ in range(args.repeats):
                seconds, same = incremental(tokenizer.decode, ids, length, per_step, streaming, stops)
                mine.append(seconds)
                identical &= same
                floor.append(whole_decodes(tokenizer.decode, ids, length, per_step, per_token=bool(stops)))
            print(f"| {length} | {name} | {1e6 * statistics.median(mine):.0f} ({1e6 * min(mine):.0f}..{1e6 * max(mine):.0f}) "
                  f"| {1e6 * statistics.median(floor):.0f} ({1e6 * min(floor):.0f}..{1e6 * max(floor):.0f}) |")
    print(f"every stream's text identical to the whole decode: {identical}")


if __name__ == "__main__":
    main()
