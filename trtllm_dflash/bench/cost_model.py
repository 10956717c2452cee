"""A calibrated cost model of draft-verify decoding: predicts throughput and latency at any
(batch, draft length) from a few measured points.

Three measured ingredients, each fitted by least squares on the sweep:
  verify_time(b, w) = a0 + a1*b + a2*b*w   one target pass over b requests of w = k+1 tokens,
                                           plus the loop's bookkeeping (everything outside drafting)
  draft_time(b, k)  = c0 + c1*b + c2*b*k   one drafter pass producing k drafts per request (0 if k = 0)
  P(first j drafts accepted), j = 1..      pooled over every point that drafted at least j tokens
A step commits 1 + sum_{j<=k} P(first j accepted) tokens per request (the bonus token plus the
expected accepted prefix), so per-user speed = that / step time and throughput = b times it.
The linear forms hold while a pass is dominated by fixed launch cost plus per-token work; they
miss kernel shape cliffs, which is why the model reports its error on points it was not fitted on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from .points import BenchPoint


@dataclass(frozen=True)
class CostModel:
    verify: tuple[float, float, float]  # a0, a1, a2 (seconds)
    draft: tuple[float, float, float]  # c0, c1, c2 (seconds)
    acceptance: tuple[float, ...]  # P(first j drafts accepted), j = 1..len

    @property
    def max_draft_len(self) -> int:
        return len(self.acceptance)

    def verify_time(self, batch: float, width: int) -> float:
        a0, a1, a2 = self.verify
        return a0 + a1 * batch + a2 * batch * width

    def draft_time(self, batch: float, draft_len: int) -> float:
        c0, c1, c2 = self.draft
        return 0.0 if draft_len == 0 else c0 + c1 * batch + c2 * batch * draft_len

    def step_time(self, batch: float, draft_len: int) -> float:
        return self.verify_time(batch, draft_len + 1) + self.draft_time(batch, draft_len)

    def tokens_per_step(self, draft_len: int) -> float:
        if not 0 <= draft_len <= self.max_draft_len:
            raise InputError(f"the model knows acceptance for draft lengths 0..{self.max_draft_len}, "
                             f"not {draft_len}.", field="draft_len")
        return 1.0 + sum(self.acceptance[:draft_len])

    def tokens_per_s_user(self, batch: float, draft_len: int) -> float:
        return self.tokens_per_step(draft_len) / self.step_time(batch, draft_len)

    def tokens_per_s(self, batch: float, draft_len: int) -> float:
        return batch * self.tokens_per_s_user(batch, draft_len)

    def to_dict(self) -> dict:
        return {"verify_s": dict(zip(("a0", "a1_per_request", "a2_per_token"), self.verify)),
                "draft_s": dict(zip(("c0", "c1_per_request", "c2_per_draft_token"), self.draft)),
                "acceptance": list(self.acceptance)}

    @classmethod
    def from_dict(cls, raw: dict) -> "CostModel":
        return cls(tuple(raw["verify_s"].values()), tuple(raw["draft_s"].values()), tuple(raw["acceptance"]))


def least_squares(rows: list[list[float]], targets: list[float], width: int = 3) -> tuple[float, ...]:
    """Coefficients minimising the squared error of rows @ x - targets; zeros without rows."""
    if not rows:
        return (0.0,) * width
    solution, *_ = np.linalg.lstsq(np.array(rows, dtype=float), np.array(targets, dtype=float), rcond=None)
    return tuple(float(v) for v in solution)


def pooled_acceptance(points: Sequence[BenchPoint]) -> tuple[float, ...]:
    """P(first j accepted) per position, averaged over points weighted by their request-steps."""
    most = max((p.draft_len for p in points), default=0)
    pooled = []
    for j in range(most):
        weighted = [(p.per_position_acceptance[j], p.steps * p.mean_batch) for p in points
                    if p.draft_len > j and p.per_position_acceptance and len(p.per_position_acceptance) > j]
        total = sum(w for _, w in weighted)
        pooled.append(sum(v * w for v, w in weighted) / total if total else 0.0)
    return tuple(pooled)


def fit_cost_model(points: Sequence[BenchPoint]) -> CostModel:
    """Least-squares fit on fixed-draft-length points (AR included: it pins the verify cost at w = 1).
    Needs the runtime's step times, so in-process points only."""
    if not points:
        raise InputError("no measured points to fit the cost model on.", field="points")
    if any(p.step_s is None for p in points):
        raise InputError("the cost model needs step times, which only the in-process runtime measures.",
                         field="points")
    verify_rows = [[1.0, p.mean_batch, p.mean_batch * (p.draft_len + 1)] for p in points]
    verify = least_squares(verify_rows, [p.step_s - p.draft_s for p in points])
    drafting = [p for p in points if p.draft_len > 0]
    draft = least_squares([[1.0, p.mean_batch, p.mean_batch * p.draft_len] for p in drafting],
                          [p.draft_s for p in drafting])
    return CostModel(verify, draft, pooled_acceptance(drafting))


def predict(model: CostModel, point: BenchPoint) -> tuple[float, float]:
    """(tokens/s per user, tokens/s) the model expects for a measured point's batch and draft length."""
    return model.tokens_per_s_user(point.mean_batch, point.draft_len), model.tokens_per_s(point.mean_batch, point.draft_len)


def holdout_split(points: Sequence[BenchPoint]) -> tuple[list[BenchPoint], list[BenchPoint]] | None:
    """(fit, held out): every other interior concurrency is held out, so the smallest and largest stay
    in the fit and each prediction interpolates. None with fewer than three concurrencies."""
    levels = sorted({p.concurrency for p in points})
    if len(levels) < 3:
        return None
    held = {c for i, c in enumerate(levels[:-1]) if i % 2 == 1}
    return [p for p in points if p.concurrency not in held], [p for p in points if p.concurrency in held]


def holdout_error(points: Sequence[BenchPoint]) -> dict | None:
    """Fit on part of the sweep, predict the rest: per-point and summary relative errors of decode
    throughput (the quantity the model predicts; serving throughput adds prefill and queueing)."""
    split = holdout_split(points)
    if split is None:
        return None
    fit_on, held_out = split
    model = fit_cost_model(fit_on)
    rows, errors = [], []
    for point in held_out:
        user, total = predict(model, point)
        measured = point.decode_tokens_per_s
        error = (total - measured) / measured if measured else float("nan")
        errors.append(abs(error))
        rows.append({"method": point.method, "draft_len": point.draft_len, "concurrency": point.concurrency,
                     "measured_decode_tokens_per_s": measured, "predicted_decode_tokens_per_s": total,
                     "measured_tokens_per_s_user": point.tokens_per_s_user, "predicted_tokens_per_s_user": user,
                     "relative_error": error})
    return {"fit_concurrency": sorted({p.concurrency for p in fit_on}),
            "heldout_concurrency": sorted({p.concurrency for p in held_out}),
            "mean_abs_relative_error": float(np.mean(errors)), "max_abs_relative_error": float(np.max(errors)),
            "points": rows}
