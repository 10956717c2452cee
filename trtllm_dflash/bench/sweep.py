"""Measuring the sweep: every (runtime, concurrency) point, repeats interleaved so that machine
drift hits all points alike, reduced to one BenchPoint per point (medians over repeats)."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..models.drafter import DFlashDrafter
from ..models.target import GptOssTarget
from ..runtime.proposers import DEFAULT_SA_THRESHOLD, DFlashProposer, SuffixDFlashProposer
from ..runtime.reference import ReferenceRuntime
from ..runtime.sampling import SamplingParams
from ..runtime.stats import GenerationResult, total_stats
from .points import AR, BenchPoint


@dataclass(frozen=True)
class Entry:
    """One curve of the sweep: a runtime and the draft length it is labelled with (0 = AR)."""

    method: str
    draft_len: int
    runtime: ReferenceRuntime


SUFFIX_HYBRID = "dflash-sa"  # measured beside DFlash; not TensorRT-LLM's, so outside its cost model and schedule


def dflash_entries(target: GptOssTarget, drafter: DFlashDrafter, draft_lens: Sequence[int],
                   sa_threshold: int = DEFAULT_SA_THRESHOLD) -> list[Entry]:
    """The autoregressive baseline, one fixed-draft-length DFlash runtime per length, and dflash-sa
    (suffix-automaton drafts, else DFlash's) at the longest length."""
    entries = [Entry(AR, 0, ReferenceRuntime(target, None))]
    entries += [Entry("dflash", k, ReferenceRuntime(target, DFlashProposer(drafter, target, k + 1))) for k in draft_lens]
    longest = max(draft_lens)
    hybrid = SuffixDFlashProposer(DFlashProposer(drafter, target, longest + 1), sa_threshold)
    return entries + [Entry(SUFFIX_HYBRID, longest, ReferenceRuntime(target, hybrid))]


def batch_prompts(prompts: Sequence[Sequence[int]], concurrency: int, requests: int) -> list[Sequence[int]]:
    """At least `requests` requests in full batches of `concurrency` (at least one batch), cycling
    through the prompts when there are too few: small batches get more requests, so less noise."""
    batches = max(1, -(-requests // concurrency))
    return list(itertools.islice(itertools.cycle(prompts), concurrency * batches))


def one_repeat(results: list[GenerationResult], step_times: dict[str, float], concurrency: int) -> dict:
    """Figures of one run: decode only (prefill excluded), per batch step. Decode tokens are summed
    per request (each request's first token comes from its prefill), not taken from the total's
    num_decode_tokens, which subtracts that first token once for the whole run."""
    total = total_stats(results, concurrency)
    decode_tokens = sum(r.stats.num_decode_tokens for r in results)
    batch_steps = sum(max(r.stats.steps for r in results[i: i + concurrency])
                      for i in range(0, len(results), concurrency))
    request_steps = sum(r.stats.steps for r in results)
    return {"tokens_per_s_user": statistics.mean(r.stats.decode_tokens_per_s for r in results),
            "tokens_per_s": decode_tokens / total.decode_time, "tau": total.acceptance_length,
            "draft_s": step_times["draft"] / batch_steps, "verify_s": step_times["verify"] / batch_steps,
            "step_s": total.decode_time / batch_steps, "mean_batch": request_steps / batch_steps,
            "steps": batch_steps, "decode_tokens": decode_tokens,
            "per_position_acceptance": total.per_position_acceptance}


def reduce_repeats(entry: Entry, concurrency: int, repeats: list[dict]) -> BenchPoint:
    """Median of every timing over repeats; counts and acceptance from the first (greedy runs repeat exactly)."""
    first = repeats[0]
    medians = {key: statistics.median(r[key] for r in repeats)
               for key in ("tokens_per_s_user", "tokens_per_s", "draft_s", "verify_s", "step_s")}
    acceptance = first["per_position_acceptance"][: entry.draft_len]
    return BenchPoint(method=entry.method, draft_len=entry.draft_len, concurrency=concurrency, tau=first["tau"],
                      mean_batch=first["mean_batch"], steps=first["steps"], decode_tokens=first["decode_tokens"],
                      repeats=len(repeats), per_position_acceptance=acceptance, **medians)


def run_sweep(entries: Sequence[Entry], prompts: Sequence[Sequence[int]], params: SamplingParams,
              concurrencies: Sequence[int], repeats: int = 1, requests: int = 0,
              on_point: Callable[[Entry, int], None] | None = None) -> list[BenchPoint]:
    """Every entry at every concurrency, `repeats` times; warm-up first so no point pays one-time costs."""
    for entry in entries:
        entry.runtime.warm_up(prompts[0])
    samples: dict[tuple[int, int], list[dict]] = {}
    for _ in range(repeats):
        for concurrency in concurrencies:
            chunk = batch_prompts(prompts, concurrency, requests)
            for index, entry in enumerate(entries):
                results = entry.runtime.generate(chunk, params, concurrency)
                samples.setdefault((index, concurrency), []).append(
                    one_repeat(results, entry.runtime.step_times, concurrency))
                if on_point is not None:
                    on_point(entry, concurrency)
    return [reduce_repeats(entries[index], concurrency, runs) for (index, concurrency), runs in samples.items()]
