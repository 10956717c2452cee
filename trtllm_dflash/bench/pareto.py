"""Throughput-interactivity Pareto math: pure functions over (x, y) points.

x = decode tokens/s per user (interactivity), y = aggregate decode tokens/s (throughput). A serving
configuration is only worth running if no other is at least as good on both axes, so curves are
compared on their frontiers. "Gain at equal interactivity" reads the baseline's throughput at the
same x by linear interpolation between its frontier points, never by extrapolation: outside the
baseline's x range there is no equal-interactivity baseline to divide by.
"""

from __future__ import annotations

from collections.abc import Iterable

Point = tuple[float, float]


def frontier(points: Iterable[Point]) -> list[Point]:
    """The points no other point dominates (>= on both axes), by x ascending (y then descends)."""
    kept: list[Point] = []
    for x, y in sorted(points, key=lambda p: (-p[0], -p[1])):
        if not kept or y > kept[-1][1]:
            kept.append((x, y))
    return kept[::-1]


def interpolate(curve: list[Point], x: float) -> float | None:
    """y of a frontier (x ascending) at x, linear between neighbours; None outside its x range."""
    if not curve or not curve[0][0] <= x <= curve[-1][0]:
        return None
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return curve[0][1]  # a one-point curve, x equal to its x


def throughput_gains(candidate: Iterable[Point], baseline: Iterable[Point]) -> list[Point]:
    """(x, candidate y / baseline y at x) for each candidate frontier point inside the baseline's range."""
    base = frontier(baseline)
    gains = []
    for x, y in frontier(candidate):
        reference = interpolate(base, x)
        if reference:
            gains.append((x, y / reference))
    return gains


def best_throughput_gain(candidate: Iterable[Point], baseline: Iterable[Point]) -> Point | None:
    """(x, ratio) of the largest throughput gain at equal interactivity, or None without overlap."""
    gains = throughput_gains(candidate, baseline)
    return max(gains, key=lambda g: g[1]) if gains else None


def throughput_gain_at(candidate: Iterable[Point], baseline: Iterable[Point], x: float) -> float | None:
    """Candidate frontier throughput over baseline frontier throughput at interactivity x, or None
    where either frontier does not reach x."""
    ours, theirs = interpolate(frontier(candidate), x), interpolate(frontier(baseline), x)
    return ours / theirs if ours is not None and theirs else None
