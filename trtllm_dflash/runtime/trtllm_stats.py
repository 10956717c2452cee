"""Request statistics from TensorRT-LLM's per-request metrics (split from `trtllm.py`).

TensorRT-LLM reports per-request *totals* (accepted drafts, drafted tokens), not a per-step
histogram, so `request_stats_from_metrics` returns `TotalsRequestStats`: exact step count and
acceptance length where they can be derived, no histogram and no per-position acceptance
(reported as unknown, never invented). Pure functions over plain objects: tested without
TensorRT-LLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .stats import RequestStats


@dataclass
class TotalsRequestStats(RequestStats):
    """`RequestStats` for a backend that reports totals, not a per-step histogram.

    `steps` and `acceptance_length` come from the totals; `accepted_histogram` stays all zeros
    and `per_position_acceptance` is empty (unknown). `source` says where `total_steps` came from.
    """

    total_steps: int = 0
    total_accepted_drafts: int = 0
    total_draft_tokens: int = 0
    source: str = "none"

    def record_step(self, num_accepted: int) -> None:
        raise TypeError("TotalsRequestStats holds totals only; it has no per-step record.")

    @property
    def steps(self) -> int:
        return self.total_steps

    @property
    def acceptance_length(self) -> float:
        return (self.total_accepted_drafts + self.total_steps) / self.total_steps if self.total_steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return []

    @property
    def draft_acceptance_rate(self) -> float | None:
        """accepted drafts / drafted tokens, TensorRT-LLM's `acceptance_rate`."""
        return self.total_accepted_drafts / self.total_draft_tokens if self.total_draft_tokens else None

    def add_counts(self, other: RequestStats) -> None:
        if isinstance(other, TotalsRequestStats):
            self.total_steps += other.total_steps
            self.total_accepted_drafts += other.total_accepted_drafts
            self.total_draft_tokens += other.total_draft_tokens
            self.source = other.source if self.source in ("none", other.source) else "mixed"
        else:
            self.total_steps += other.steps
            self.total_accepted_drafts += sum(a * n for a, n in enumerate(other.accepted_histogram))
        self.num_output_tokens += other.num_output_tokens
        self.requests += other.requests

    def to_dict(self) -> dict:
        record = super().to_dict()
        record.update({
            "acceptance_histogram": None,  # not reported by TensorRT-LLM
            "per_position_acceptance": None,
            "accepted_drafts": self.total_accepted_drafts,
            "draft_tokens": self.total_draft_tokens,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "steps_source": self.source,
        })
        return record


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if obj is None:
        return default
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _seconds(value: Any) -> float | None:
    """A timing-metrics field (timedelta, or plain seconds) -> seconds; None when unset (0)."""
    if value is None:
        return None
    seconds = value.total_seconds() if hasattr(value, "total_seconds") else float(value)
    return seconds if seconds > 0 else None


def request_stats_from_metrics(metrics: Any, num_output_tokens: int, block_size: int, *,
                               decoding_iter: int | None = None,
                               wall_times: tuple[float, float] | None = None) -> TotalsRequestStats:
    """Our `RequestStats` from TensorRT-LLM's per-request metrics.

    metrics: a `RequestPerfMetrics`-like object or dict (`speculative_decoding`, `timing_metrics`)
    or None. block_size: max_draft_len + 1 (drafts per step K = block_size - 1).
    decoding_iter: `RequestOutput.decoding_iter`, used only when the speculative section is empty.
    wall_times: (prefill_s, decode_s) measured by the caller, used when timing metrics are absent.

    Convention (as in stats.py): the first output token comes from prefill; each verify step keeps
    `a` drafts and commits a + 1 tokens. With A accepted drafts and D drafted tokens in total:
      steps S = D / K            when D > 0 and K divides D (every step drafted K tokens: no
                                 draft_len_schedule / max_concurrency cut-back) -> source "draft_tokens";
      steps S = N - 1 - A        otherwise, from N output tokens (exact unless the final step was
                                 trimmed by max_tokens or a stop token) -> source "output_tokens";
      when D == 0 (older PyTorch-backend builds leave the section zeroed, see TensorRT-LLM's
      `_maybe_fill_spec_dec_perf_metrics` backfill) and `decoding_iter` is known:
      S = decoding_iter - 1 (the context iteration excluded), A = N - 1 - S -> source
      "decoding_iter" (semantics of decoding_iter not verified on a GPU);
      otherwise no steps are reported (source "none").
    acceptance_length = (A + S) / S. No histogram, no per-position acceptance: unknown.
    Times: prefill = first_token_time - first_scheduled_time (arrival_time when not scheduled),
    decode = last_token_time - first_token_time; else the caller's wall-clock times.
    """
    stats = TotalsRequestStats(block_size=block_size, num_output_tokens=num_output_tokens)
    drafts_per_step = block_size - 1
    spec = _get(metrics, "speculative_decoding")
    accepted = int(_get(spec, "total_accepted_draft_tokens", 0) or 0)
    drafted = int(_get(spec, "total_draft_tokens", 0) or 0)
    committed_after_prefill = max(num_output_tokens - 1, 0)
    if drafted > 0:
        stats.total_accepted_drafts, stats.total_draft_tokens = accepted, drafted
        if drafts_per_step > 0 and drafted % drafts_per_step == 0:
            stats.total_steps, stats.source = drafted // drafts_per_step, "draft_tokens"
        else:
            stats.total_steps, stats.source = max(committed_after_prefill - accepted, 0), "output_tokens"
    elif decoding_iter is not None and decoding_iter > 1 and committed_after_prefill > 0:
        steps = min(int(decoding_iter) - 1, committed_after_prefill)
        stats.total_steps, stats.source = steps, "decoding_iter"
        stats.total_accepted_drafts = committed_after_prefill - steps

    timing = _get(metrics, "timing_metrics")
    first_token = _seconds(_get(timing, "first_token_time"))
    start = _seconds(_get(timing, "first_scheduled_time")) or _seconds(_get(timing, "arrival_time"))
    last_token = _seconds(_get(timing, "last_token_time"))
    if first_token is not None and start is not None and last_token is not None:
        stats.prefill_time = max(first_token - start, 0.0)
        stats.decode_time = max(last_token - first_token, 0.0)
    elif wall_times is not None:
        stats.prefill_time, stats.decode_time = wall_times
    return stats


def finish_reason_of(reason: Any, num_tokens: int, max_tokens: int) -> str:
    """TensorRT-LLM finish reasons ('stop', 'length', 'timeout', 'cancelled', None) -> ours."""
    if reason in ("stop", "length"):
        return reason
    if reason is None:
        return "length" if num_tokens >= max_tokens else "stop"
    raise RuntimeError(f"TensorRT-LLM finished a request with reason {reason!r}.")
