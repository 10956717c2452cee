"""One measured sweep point and its JSON/CSV form: the record every other bench module reads.

Kept free of torch so the cost model, the schedule and the projection work on bench files alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

AR = "ar"  # the autoregressive baseline's method name (draft length 0)


@dataclass(frozen=True)
class BenchPoint:
    """Decode-only figures of one (method, draft length, concurrency) run, medians over repeats.

    Times are per batch step (one draft + one verify for the whole batch): `step_s` is the decode
    wall time per step, so `step_s - draft_s - verify_s` is the loop's own bookkeeping. `mean_batch`
    is the average number of live requests per step (requests that finish early leave the batch).
    """

    method: str
    draft_len: int
    concurrency: int
    tokens_per_s_user: float  # mean over requests of decode tokens / decode time (interactivity)
    tokens_per_s: float  # all decode tokens / decode time of the run (throughput)
    tau: float
    draft_s: float
    verify_s: float
    step_s: float
    mean_batch: float
    steps: int
    decode_tokens: int
    repeats: int
    per_position_acceptance: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> "BenchPoint":
        return cls(**{f.name: raw[f.name] for f in fields(cls)})


CSV_COLUMNS = [f.name for f in fields(BenchPoint)]


def csv_row(point: BenchPoint) -> list[str]:
    """Flat CSV cells; per-position acceptance becomes `p1;p2;...` so one point stays one row."""
    cells = []
    for name in CSV_COLUMNS:
        value = getattr(point, name)
        cells.append(";".join(f"{v:.4f}" for v in value) if isinstance(value, list) else
                     f"{value:.6g}" if isinstance(value, float) else str(value))
    return cells
