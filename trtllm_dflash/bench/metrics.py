"""Serving metrics from request timelines: what trtllm-bench, genai-perf and vLLM's and SGLang's
serving benchmarks report, computed the same way for the in-process runtime and for a server.

A request's timeline is its send time, the arrival time and token count of every streamed chunk,
and its end. Definitions (vLLM `benchmarks/serve.py` conventions):
  TTFT  = first chunk - send (queueing and prefill included)
  TPOT  = (last chunk - first chunk) / (output tokens - 1), per request (decode time per token)
  ITL   = gaps between consecutive chunks; a speculative step streams several tokens in one chunk,
          so one ITL sample covers a whole accepted block (ITL >= TPOT when blocks are accepted)
  E2E   = end - send
Percentiles are numpy's linear interpolation between order statistics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft_s", "tpot_s", "itl_s", "e2e_s")


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds on one monotonic clock."""

    prompt_tokens: int
    send: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens in the chunk)
    end: float | None = None
    error: str | None = None
    tau: float | None = None  # acceptance length, when the runtime or server reports it
    accepted_drafts: int | None = None
    drafted: int | None = None
    per_position_acceptance: list[float] | None = None
    reported_output_tokens: int | None = None  # a server's own count, when chunks do not carry one


    def add_chunk(self, when: float, tokens: int) -> None:
        self.chunks.append((when, tokens))

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and bool(self.chunks)

    @property
    def output_tokens(self) -> int:
        if self.reported_output_tokens is not None:
            return self.reported_output_tokens
        return sum(n for _, n in self.chunks)

    @property
    def ttft(self) -> float:
        return self.chunks[0][0] - self.send

    @property
    def e2e(self) -> float:
        return self.end - self.send

    @property
    def decode_time(self) -> float:
        return self.chunks[-1][0] - self.chunks[0][0]

    @property
    def tpot(self) -> float | None:
        """None for a one-token output (there is no decode time to divide)."""
        return self.decode_time / (self.output_tokens - 1) if self.output_tokens > 1 else None

    @property
    def itls(self) -> list[float]:
        return [b[0] - a[0] for a, b in zip(self.chunks, self.chunks[1:])]


def distribution(values: Sequence[float]) -> dict | None:
    """mean and p50/p90/p99 of a sample, None when it is empty."""
    if not len(values):
        return None
    array = np.asarray(values, dtype=float)
    return {"mean": float(array.mean()), **{f"p{q}": float(np.percentile(array, q)) for q in PERCENTILES}}


def latency_samples(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Per-metric samples over the successful requests (ITL pooled over every chunk gap)."""
    done = [r for r in records if r.ok]
    return {"ttft_s": [r.ttft for r in done], "tpot_s": [r.tpot for r in done if r.tpot is not None],
            "itl_s": [gap for r in done for gap in r.itls], "e2e_s": [r.e2e for r in done]}


def reported_acceptance(records: Sequence[RequestRecord]) -> tuple[float | None, list[float] | None]:
    """(tau, per-position acceptance) over requests that reported them, weighted by their output
    tokens; (None, None) when none did (a server that does not return DFlash statistics)."""
    reported = [r for r in records if r.ok and r.tau is not None]
    tau = None
    if reported:
        weights = [max(r.output_tokens, 1) for r in reported]
        tau = float(np.average([r.tau for r in reported], weights=weights))
    positions = [r for r in reported if r.per_position_acceptance is not None]
    per_position = None
    if positions:
        width = min(len(r.per_position_acceptance) for r in positions)
        weights = [max(r.output_tokens, 1) for r in positions]
        per_position = [float(np.average([r.per_position_acceptance[j] for r in positions], weights=weights))
                        for j in range(width)]
    return tau, per_position


def run_figures(records: Sequence[RequestRecord]) -> dict:
    """One run's (one repeat of one point's) figures: throughput over the run's wall time, per-user
    decode speed, latency distributions, and how many requests failed."""
    done = [r for r in records if r.ok]
    if not done:
        return {"completed": 0, "failed": len(records)}
    start, stop = min(r.send for r in done), max(r.end for r in done)
    duration = stop - start
    tokens = sum(r.output_tokens for r in done)
    per_user = [(r.output_tokens - 1) / r.decode_time for r in done if r.output_tokens > 1 and r.decode_time > 0]
    return {"completed": len(done), "failed": len(records) - len(done), "duration_s": duration,
            "output_tokens": tokens, "output_tokens_per_s": tokens / duration if duration > 0 else 0.0,
            "requests_per_s": len(done) / duration if duration > 0 else 0.0,
            "tokens_per_s_user": float(np.mean(per_user)) if per_user else 0.0,
            "latency": {name: distribution(values) for name, values in latency_samples(done).items()}}
