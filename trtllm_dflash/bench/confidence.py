"""How far the bench's conclusions can be trusted: run-to-run spread, bootstrap confidence
intervals of the headline ratios, and whether the schedule's effect stands out of the noise.

Bootstrap: each point keeps its per-repeat (tokens/s per user, tokens/s) pairs; a resample draws
every point's repeats with replacement (pairs stay together: one repeat measured both), takes the
medians as the point, and recomputes the ratio; the interval is the 2.5th-97.5th percentile of the
resampled ratios (seeded, so a bench file is reproducible from its points).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from .points import AR, BenchPoint
from .schedule import Score

RESAMPLES = 1000
LEVEL = 0.95


def resample(points: Sequence[BenchPoint], rng: np.random.Generator) -> list[BenchPoint]:
    drawn = []
    for p in points:
        pairs = list(zip(p.tokens_per_s_user_repeats, p.tokens_per_s_repeats))
        picks = [pairs[i] for i in rng.integers(0, len(pairs), len(pairs))]
        drawn.append(dataclasses.replace(p, tokens_per_s_user=float(np.median([u for u, _ in picks])),
                                         tokens_per_s=float(np.median([t for _, t in picks]))))
    return drawn


def bootstrap_interval(points: Sequence[BenchPoint], ratio: Callable[[Sequence[BenchPoint]], float | None],
                       resamples: int = RESAMPLES, seed: int = 0) -> list[float] | None:
    """[low, high] of `ratio` over resampled points; None with one repeat (no spread to resample)
    or when under half of the resamples define the ratio (the curves barely overlap)."""
    if any(len(p.tokens_per_s_repeats) < 2 for p in points):
        return None
    rng = np.random.default_rng(seed)
    values = [v for v in (ratio(resample(points, rng)) for _ in range(resamples)) if v is not None]
    if len(values) < resamples / 2:
        return None
    tail = (1 - LEVEL) / 2 * 100
    return [float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))]


def spread_summary(points: Sequence[BenchPoint]) -> dict | None:
    """Median and largest relative spread ((max - min) / median over repeats) of throughput."""
    spreads = [s for s in (p.spread() for p in points) if s is not None]
    if not spreads:
        return None
    return {"median": float(np.median(spreads)), "max": float(np.max(spreads)), "points": len(spreads)}


def schedule_effect(score: Score, lengths: dict[int, int], most: int) -> dict:
    """The largest margin the schedule claims in any band over the other side of its choice:
    speculating vs AR where it speculates, AR vs the best draft length where it does not."""
    best = {"margin": 0.0}
    low = 0
    for key in sorted(lengths):
        chosen = lengths[key]
        ar = score(low, key, 0)
        spec_len = max(range(1, most + 1), key=lambda k: score(low, key, k)) if most else 0
        spec = score(low, key, spec_len) if most else float("-inf")
        if chosen > 0 and ar > 0:
            margin, versus = score(low, key, chosen) / ar - 1, "AR"
        elif spec > 0:
            margin, versus = ar / spec - 1, f"K={spec_len}"
        else:
            margin, versus = 0.0, "nothing"
        if margin > best["margin"]:
            best = {"margin": float(margin), "band": [low + 1, key], "draft_len": chosen, "versus": versus}
        low = key
    return best


def decisive_spread(points: Sequence[BenchPoint], effect: dict) -> float | None:
    """The larger spread of the two measured points the effect rests on: at its band's upper batch
    size, the chosen draft length (or the best measured DFlash point, when the model chose an
    unswept length) and its alternative (AR, or the best measured DFlash point)."""
    if "band" not in effect:
        return None
    at = [p for p in points if p.concurrency == effect["band"][1]]
    ar = [p for p in at if p.method == AR]
    spec = sorted((p for p in at if p.method != AR), key=lambda p: (p.draft_len != effect["draft_len"], -p.tokens_per_s))
    spreads = [p.spread() for p in ar[:1] + spec[:1]]
    return max(spreads) if spreads and None not in spreads else None


def recommendation(effect: dict, spread: dict | None, model_error: float | None, uses_model: bool,
                   local_spread: float | None = None) -> dict:
    """Recommend the schedule only when its effect exceeds the run-to-run spread (the typical one,
    and that of the points the effect rests on) and, for a model-chosen schedule, the model's
    held-out error. -> {"recommended", "reason", "noise"}."""
    typical = None if spread is None else spread["median"]
    noise = {"spread": typical, "decisive_spread": local_spread, "model_error": model_error if uses_model else None}
    if spread is None:
        return {"recommended": False, "noise": noise,
                "reason": "one repeat per point, so the run-to-run spread is unknown (use --repeats 3 or more)"}
    if uses_model and model_error is None:
        return {"recommended": False, "noise": noise,
                "reason": "the cost model's held-out error is unknown (it needs 3 or more concurrency levels); "
                          "add levels or use --schedule-source measured"}
    margin = effect["margin"]
    chosen = "AR" if effect.get("draft_len") == 0 else f"K={effect.get('draft_len')}"
    claim = (f"its largest effect is {margin:.1%} ({chosen} vs {effect['versus']} at batch "
             f"{effect['band'][0]}-{effect['band'][1]})" if "band" in effect else "it has no effect at all")
    worst = max(typical, local_spread or 0.0)
    if worst >= margin:
        which = "typical" if worst == typical else f"at batch {effect['band'][1]}"
        return {"recommended": False, "noise": noise,
                "reason": f"{claim}, within the run-to-run spread ({which}) of {worst:.1%}: rerun with more "
                          "--repeats / --requests on a quieter machine"}
    if uses_model and model_error >= margin:
        return {"recommended": False, "noise": noise,
                "reason": f"{claim}, within the cost model's held-out error of {model_error:.1%}: use "
                          "--schedule-source measured, or a grid the model fits better"}
    return {"recommended": True, "noise": noise, "reason": f"{claim}, above the noise"}


def headline_intervals(points: Sequence[BenchPoint], headline: Callable[[Sequence[BenchPoint]], dict],
                       seed: int = 0) -> dict:
    """A bootstrap interval for each headline ratio (None where it cannot be formed)."""
    def ratio_of(name: str) -> Callable[[Sequence[BenchPoint]], float | None]:
        def ratio(sample: Sequence[BenchPoint]) -> float | None:
            value = headline(sample)[name]
            return None if value is None else value["ratio"]
        return ratio

    names = ("throughput_gain_at_equal_interactivity", "interactivity_gain_at_smallest_batch")
    usable = [p for p in points if p.method == AR] and [p for p in points if p.method != AR]
    return {name: bootstrap_interval(points, ratio_of(name), seed=seed) if usable else None for name in names}
