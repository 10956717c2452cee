"""Acceptance and speed statistics, shared by every runtime backend.

Per verify step a request keeps `a` drafts (0..block_size-1) and commits `a + 1` tokens.
acceptance length (tau) = mean of a + 1 over steps; per-position acceptance k = fraction of steps
whose draft k (1-based) was kept (steps that drafted fewer than k count as not kept); the histogram
counts steps by `a`. These measure the verifier's
verdicts, the usual definition: a request's last step counts every draft it kept, also those past
a stop token or max_tokens that are never returned (so tau can exceed returned tokens / steps by up
to (block_size - 1) / steps). Token rates count returned tokens only.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class RequestStats:
    block_size: int
    accepted_histogram: list[int] = field(default_factory=list)
    accepted_per_step: list[int] = field(default_factory=list)
    num_output_tokens: int = 0
    prefill_time: float = 0.0
    requests: int = 1  # > 1 for totals: each request's first token comes from prefill
    decode_time: float = 0.0
    suffix_steps: int = 0  # steps whose drafts came from the suffix index (dflash-sa), not the drafter
    draftless_steps: int = 0  # steps that verified no draft (an adaptive or scheduled draft length of 0)
    decode_started: float | None = None  # `time.perf_counter()` when its prefill ended (None: the backend does not say)

    def __post_init__(self):
        if not self.accepted_histogram:
            self.accepted_histogram = [0] * self.block_size

    def record_step(self, num_accepted: int, from_suffix: bool = False, drafted: bool = True) -> None:
        self.accepted_histogram[num_accepted] += 1
        self.accepted_per_step.append(num_accepted)
        self.suffix_steps += from_suffix
        self.draftless_steps += not drafted

    @property
    def steps(self) -> int:
        return sum(self.accepted_histogram)

    @property
    def acceptance_length(self) -> float:
        steps = self.steps
        return sum((a + 1) * n for a, n in enumerate(self.accepted_histogram)) / steps if steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        steps = self.steps
        if not steps:
            return [0.0] * (self.block_size - 1)
        return [sum(self.accepted_histogram[k:]) / steps for k in range(1, self.block_size)]

    @property
    def num_decode_tokens(self) -> int:
        """Tokens committed by decode steps (each request's first output token comes from prefill)."""
        return max(self.num_output_tokens - self.requests, 0)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.num_decode_tokens / self.decode_time if self.decode_time > 0 else 0.0

    def add_counts(self, other: "RequestStats") -> None:
        """Accumulate another request's histogram and token count (times are combined by the caller)."""
        for a, n in enumerate(other.accepted_histogram):
            self.accepted_histogram[a] += n
        self.num_output_tokens += other.num_output_tokens
        self.requests += other.requests
        self.suffix_steps += other.suffix_steps
        self.draftless_steps += other.draftless_steps

    def to_dict(self) -> dict:
        return {
            "steps": self.steps,
            "acceptance_length": self.acceptance_length if self.steps else None,  # no verify step: no tau
            "acceptance_histogram": list(self.accepted_histogram),
            "per_position_acceptance": self.per_position_acceptance,
            "num_output_tokens": self.num_output_tokens,
            "prefill_time_s": self.prefill_time,
            "decode_time_s": self.decode_time,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "suffix_steps": self.suffix_steps,
            "draftless_steps": self.draftless_steps,
        }


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "interrupted"
    stats: RequestStats


def total_stats(results: list[GenerationResult], batch_size: int) -> RequestStats:
    """Totals over a run whose requests were decoded `batch_size` at a time, in order.

    Where every request says when its decode began (the reference runtime), the run's prefill time is the time during
    which any prefill ran (the union of their spans) and its decode time the time during which any request was
    decoding and no prefill ran: in static batches the sum of each batch's slowest request, in flight (newcomers are
    prefilled between the others' steps) the run's wall time less its prefills and idle gaps. Otherwise (TensorRT-LLM's
    totals) requests of one batch share the clock, so a batch's time is its slowest request's and batches add up.
    Either way, decode tokens/s of the total is the run's decode throughput.
    """
    # The first result's stats class, so backends that report totals only (TensorRT-LLM) add up too.
    total = type(results[0].stats)(max(r.stats.block_size for r in results), requests=0)
    stats = [r.stats for r in results]
    for request in stats:
        total.add_counts(request)
    if all(s.decode_started is not None for s in stats):
        prefills = [(s.decode_started - s.prefill_time, s.decode_started) for s in stats]
        decodes = [(s.decode_started, s.decode_started + s.decode_time) for s in stats]
        total.prefill_time = covered(prefills)
        total.decode_time = covered(prefills + decodes) - total.prefill_time
        return total
    for first in range(0, len(stats), batch_size):
        batch = stats[first: first + batch_size]
        total.prefill_time += max(s.prefill_time for s in batch)
        total.decode_time += max(s.decode_time for s in batch)
    return total


def covered(spans: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) spans."""
    length, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            length += end - max(start, reach)
            reach = end
    return length


@dataclass(frozen=True)
class Spread:
    """A speed-up measured over interleaved repeats: the median and its min..max."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: list[float]) -> "Spread":
        return cls(statistics.median(values), min(values), max(values))

    @property
    def wider_than_effect(self) -> bool:
        """The repeats disagree by more than the speed-up differs from 1.0x: noise, not a result."""
        return self.high - self.low > abs(self.median - 1.0)


class GenerationInterrupted(Exception):
    """Ctrl-C during generation; carries every request's result so far (finished or partial)."""

    def __init__(self, results: list[GenerationResult]):
        super().__init__("generation interrupted")
        self.results = results
