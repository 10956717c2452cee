"""One measured sweep point and its JSON/CSV form: the record every other bench module reads.

Kept free of torch so the cost model, the schedule and the projection work on bench files alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from .metrics import LATENCIES, PERCENTILES

AR = "ar"  # the autoregressive baseline's method name (draft length 0)
SUFFIX_HYBRID = "dflash-sa"  # measured beside DFlash; not TensorRT-LLM's, so outside its cost model and schedule
CONCURRENCY, RATE = "concurrency", "rate"  # closed loop (users) or open loop (Poisson requests/s)


@dataclass(frozen=True)
class BenchPoint:
    """One (method, draft length, load) point: medians over repeats, with each repeat's value kept
    so the spread and bootstrap intervals can be computed.

    Serving figures (from request timelines, `metrics.py`): `tokens_per_s` = output tokens / wall
    time of the run (throughput), `tokens_per_s_user` = mean per-request decode speed, 1/TPOT
    (interactivity); latency distributions pool every repeat's requests.
    Runtime figures (in-process only, None from a server), per batch step (one draft + one verify
    for the whole batch): `step_s` is the decode wall time per step, `mean_batch` the average number
    of live requests per step, `decode_tokens_per_s` decode tokens / decode time; the cost model
    is fitted on these.
    """

    method: str
    draft_len: int
    concurrency: int  # closed loop: users; open loop: the most requests batched together
    tokens_per_s_user: float
    tokens_per_s: float
    tau: float | None
    draft_s: float | None
    verify_s: float | None
    step_s: float | None
    mean_batch: float | None
    steps: int | None
    decode_tokens: int | None
    repeats: int
    per_position_acceptance: list[float] | None = field(default_factory=list)
    decode_tokens_per_s: float | None = None
    load: str = CONCURRENCY
    rate: float | None = None  # requests/s of an open-loop point
    requests: int = 0  # completed requests per repeat (median)
    failed: int = 0  # failed requests over all repeats
    requests_per_s: float = 0.0
    tokens_per_s_repeats: list[float] = field(default_factory=list)
    tokens_per_s_user_repeats: list[float] = field(default_factory=list)
    latency: dict = field(default_factory=dict)  # metric -> {mean, p50, p90, p99} seconds, or None
    samples: dict = field(default_factory=dict)  # ttft_s / tpot_s / e2e_s -> per-request seconds (CDF plot)

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.load == CONCURRENCY else f"rate={self.rate:g}/s"

    @property
    def level(self) -> float:
        """The load's own axis: users (closed loop) or requests/s (open loop)."""
        return self.concurrency if self.load == CONCURRENCY else self.rate

    def spread(self, name: str = "tokens_per_s") -> float | None:
        """(max - min) / median of a figure over repeats; None with fewer than two repeats."""
        values = getattr(self, f"{name}_repeats")
        median = getattr(self, name)
        return (max(values) - min(values)) / median if len(values) > 1 and median else None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> "BenchPoint":
        return cls(**{f.name: raw[f.name] for f in fields(cls) if f.name in raw})


SCALAR_COLUMNS = [f.name for f in fields(BenchPoint) if f.name not in ("latency", "samples")]
LATENCY_COLUMNS = [f"{name.removesuffix('_s')}_{stat}_s" for name in LATENCIES
                   for stat in ("mean", *(f"p{q}" for q in PERCENTILES))]
CSV_COLUMNS = SCALAR_COLUMNS + LATENCY_COLUMNS


def format_cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, list):  # per-position acceptance and repeats: `v1;v2;...`, one point per row
        return ";".join(f"{v:.4g}" for v in value)
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def csv_row(point: BenchPoint) -> list[str]:
    """Flat CSV cells: list fields joined by ';', each latency statistic its own column."""
    cells = [format_cell(getattr(point, name)) for name in SCALAR_COLUMNS]
    for name in LATENCIES:
        stats = point.latency.get(name) or {}
        cells += [format_cell(stats.get(stat)) for stat in ("mean", *(f"p{q}" for q in PERCENTILES))]
    return cells
