"""Adaptive draft length: per step, the number of drafts K that maximises the expected committed
tokens per second of step, from running estimates of acceptance and a table of measured step costs
(issue 17, round 2; the confidence truncation, round 6).

Why: on a small target an 8-token verify costs ~1.5 AR steps while tau is ~2.6, and the last draft
positions are rarely accepted, so a shorter block can commit nearly as many tokens for less.

Two decisions per step. Before it, `choose` picks K from per-position acceptance (K = 0: a plain
autoregressive step). A drafter step then drafts the whole block in its one forward anyway, so
`truncate` picks how many of those drafts to verify from the drafter's confidence in each
(`ConfidenceCalibration`): a confident block is verified whole, one whose third draft is a guess
stops before it. Any K is lossless (greedy and rejection sampling alike): K depends on past steps and
on the drafter's distributions, never on the target, the tokens drawn or the random numbers of the
step it sizes.

Drafts come from two sources with very different acceptance (dflash-sa): the DFlash drafter
("neural") and the suffix match ("suffix"); each has its own cost row and prior (`SOURCE_PRIORS`), and
its own estimates, one per bucket of what a step knows of a row before drafting (`KEY_EDGES`: for a
suffix draft, its match length; round 22).

The loop runs the policy compiled (`draft_length.cpp`, made by `adaptive_draft_length`) where the project's C++
kernels build: the same estimates in the same order of float64 operations, so the same choices; `AdaptiveDraftLength`
here is the fallback and the reference the tests hold the compiled one to.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..plugins.compiled import CompiledKernel
from .tuning import interleaved_medians

KERNEL = CompiledKernel(Path(__file__).with_name("draft_length.cpp"), "dflash_draft_length",
                        "compiled draft-length policy", "the adaptive draft length runs in Python")

SOURCES = ("neural", "suffix")

# The acceptance an untried draft position starts from, per source. A neural draft's acceptance falls with
# its position; a suffix draft copies a repeat that, once it has held, mostly keeps holding (conditional
# acceptance 0.9-1.0 past the eighth draft with 15 suffix drafts verified every step), so its untried positions
# start optimistic and K grows where the text repeats. 0.85 was the best of 0.5 / 0.7 / 0.85 / 0.95 for
# dflash-sa at 128 tokens, and of 0.5 / 0.7 / 0.85 at 256 (docs/benchmarks.md, round 15); the neural prior made
# no difference (0.35-0.8).
SOURCE_PRIORS = {"neural": 0.5, "suffix": 0.85}

# Per source, the bucket edges of a row's key, the one thing a step knows before drafting that predicts the source's
# acceptance: each bucket has its own estimate. A suffix draft's key is its match length: on the embedded pair (the
# 64 held-out prompts, 128 tokens, every position) half of the suffix drafts after a match of 2 fail at once and 3.0
# of 15 hold on average, 6-8 after a match of 4-15, 13 after one of 16 or more; one estimate for all of them sizes
# the short matches' steps like the long ones'. Buckets split at 4 and 16 gave dflash-sa 1.04x in an offline replay of
# the policy on the 48 prompts after the benchmark's 16 (chosen on those 16: 1.03x; round 22). The neural drafter has
# no key: the target's confidence in the anchor predicted its acceptance on the 16 prompts but gained nothing on the 48.
KEY_EDGES: dict[str, tuple[float, ...]] = {"neural": (), "suffix": (4, 16)}


@dataclass
class AcceptanceEstimate:
    """Per-position conditional acceptance p[j] = P(draft j+1 accepted | drafts 1..j accepted), from
    counts that decay every step toward a prior: a position the chosen K leaves untried drifts back
    to the prior, so it gets tried again when it looks worth it."""

    most: int
    decay: float = 0.9  # per step: the estimate follows roughly the last 1 / (1 - decay) steps
    prior: float = 0.5
    prior_weight: float = 1.0  # pseudo-trials of the prior
    accepted: list[float] = field(init=False)
    trials: list[float] = field(init=False)
    expected: list[float] | None = field(init=False, default=None)  # `expected_tokens` until the next `observe`

    def __post_init__(self) -> None:
        self.accepted, self.trials = [0.0] * self.most, [0.0] * self.most

    def rates(self) -> list[float]:
        return [(a + self.prior * self.prior_weight) / (t + self.prior_weight)
                for a, t in zip(self.accepted, self.trials)]

    def observe(self, num_drafts: int, num_accepted: list[int]) -> None:
        """One step: each row verified `num_drafts` drafts and kept the first num_accepted[row]."""
        self.expected = None
        self.accepted = [a * self.decay for a in self.accepted]
        self.trials = [t * self.decay for t in self.trials]
        for kept in num_accepted:
            for position in range(min(kept + 1, num_drafts)):  # positions past the first rejection: untried
                self.trials[position] += 1
                self.accepted[position] += position < kept

    def expected_tokens(self) -> list[float]:
        """[K] -> expected committed tokens of a step with K drafts (the bonus token included). Kept until the next
        `observe` (every step asks, and most buckets did not move since): the caller must not change the list."""
        if self.expected is None:
            expected, survive = [1.0], 1.0
            for rate in self.rates():
                survive *= rate
                expected.append(expected[-1] + survive)
            self.expected = expected
        return self.expected


@dataclass
class ConfidenceCalibration:
    """P(a neural draft is accepted | every draft before it was) as a function of the drafter's own
    confidence in it (the peak probability of the draft's distribution; for a greedy draft, the
    probability of the drafted token), per confidence bucket, from decaying counts. The prior of a
    bucket is its midpoint: a calibrated drafter's confidence is its acceptance (on the embedded pair,
    from 0.06 in the lowest tenth to 0.96 in the highest)."""

    buckets: int = 10
    decay: float = 0.98  # per observed step
    prior_weight: float = 2.0
    accepted: list[float] = field(init=False)
    trials: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.accepted, self.trials = [0.0] * self.buckets, [0.0] * self.buckets

    def bucket(self, confidence: float) -> int:
        return min(int(confidence * self.buckets), self.buckets - 1)

    def rate(self, confidence: float) -> float:
        b = self.bucket(confidence)
        return (self.accepted[b] + (b + 0.5) / self.buckets * self.prior_weight) / (self.trials[b] + self.prior_weight)

    def expected_tokens(self, confidences: list[float]) -> list[float]:
        """[K] -> expected committed tokens of one row verifying its first K drafts (bonus included)."""
        expected, survive = [1.0], 1.0
        for confidence in confidences:
            survive *= self.rate(confidence)
            expected.append(expected[-1] + survive)
        return expected

    def observe(self, confidences: list[list[float]], num_accepted: list[int]) -> None:
        """One step: row i verified drafts of these confidences and kept the first num_accepted[i]."""
        self.accepted = [a * self.decay for a in self.accepted]
        self.trials = [t * self.decay for t in self.trials]
        for row, kept in zip(confidences, num_accepted):
            for position, confidence in enumerate(row[: kept + 1]):  # past the first rejection: untried
                self.trials[self.bucket(confidence)] += 1
                self.accepted[self.bucket(confidence)] += position < kept


class AdaptiveDraftLength:
    """Chooses K in [least, most] per step and source: argmax of expected tokens / cost[source][K], the
    expected tokens from that source's `AcceptanceEstimate`s (its untried positions at `priors[source]`,
    default `SOURCE_PRIORS`), one per bucket of the rows' keys (`key_edges`, default `KEY_EDGES`); a step's
    expected tokens are the sum over its rows, each from its own bucket.

    `costs[source][K]` is the measured seconds of a step with K drafts from that source, K = 0 being a
    plain autoregressive step; see `measure_step_costs`. A source's row may be longer than another's
    (suffix drafts are not bound to the drafter's block: `SuffixDFlashProposer(max_suffix_drafts=...)`).
    K = 0 wins where drafting costs more time than its expected tokens save (on a small CPU target a drafter
    step costs about an AR step, so a draft must be likely to hold). A step without drafts observes nothing,
    so after a run of such steps the source drafts again (its best K >= 1) to refresh its estimate: after
    `explore_every` steps, or more where that draft costs more, so that refreshing spends at most
    `explore_share` of the run's time over plain steps (a step with one drafter draft cost 2.6x an AR step of
    the lean target at batch 4, where refreshing every 9th step cost dflash-sa 0.93x -> 0.81x AR; round 17).
    Idle steps are counted per source and set of buckets, the estimates that a refresh would renew.

    `keys` (`choose`, `observe`) are the rows' keys, None for a source without edges (every row in its one bucket)."""

    def __init__(self, costs: dict[str, list[float]], least: int = 0, decay: float = 0.9,
                 priors: dict[str, float] | None = None, explore_every: int = 8, explore_share: float = 0.05,
                 key_edges: dict[str, Sequence[float]] | None = None):
        self.costs, self.least = costs, least
        self.explore_every, self.explore_share = explore_every, explore_share
        priors = SOURCE_PRIORS if priors is None else priors
        self.key_edges = {source: tuple((KEY_EDGES if key_edges is None else key_edges).get(source, ()))
                          for source in costs}
        self.most = {source: len(row) - 1 for source, row in costs.items()}  # per source
        self.estimates = {source: [AcceptanceEstimate(self.most[source], decay, priors[source])
                                   for _ in range(len(self.key_edges[source]) + 1)] for source in costs}
        self.calibration = ConfidenceCalibration()
        self.idle: dict[tuple[str, tuple[int, ...]], int] = {}  # steps in a row without drafts, per source and buckets
        self.choices: dict[str, dict] = {source: {} for source in costs}  # `best_choices`' answers until `observe`
        self.chosen: dict[str, list[int]] = {source: [] for source in costs}  # K of every step, for reports

    def set_costs(self, costs: dict[str, list[float]]) -> None:
        """Step costs measured at another live batch size (`CostTables`): the same sources and lengths; the
        estimates stay."""
        for source, row in costs.items():
            if len(row) != len(self.costs[source]):
                raise ValueError(f"new step costs for {source} must keep its {len(self.costs[source])} entries")
        self.costs = {**self.costs, **{source: list(row) for source, row in costs.items()}}
        for answers in self.choices.values():
            answers.clear()

    def buckets(self, source: str, keys: Sequence[float] | None, rows: int = 1) -> list[int]:
        """Each row's bucket of `source`'s estimates; no keys: the first bucket for each of `rows` rows."""
        if keys is None:
            return [0] * rows
        return [bisect_right(self.key_edges[source], key) for key in keys]

    def expected_tokens(self, source: str, buckets: list[int]) -> list[float]:
        """[K] -> expected committed tokens of a step, summed over its rows, one row per entry of `buckets`."""
        if len(buckets) == 1:  # a lone request: its bucket's own list, not a copy
            return self.estimates[source][buckets[0]].expected_tokens()
        rows = [self.estimates[source][b].expected_tokens() for b in buckets]
        return [sum(column) for column in zip(*rows)]

    def choose(self, source: str, most: int, keys: Sequence[float] | None = None) -> int:
        most = min(most, self.most[source])
        if most <= self.least:
            self.chosen[source].append(most)
            return most
        buckets = self.buckets(source, keys)
        k, probe, wait = self.best_choices(source, most, buckets)
        idle = (source, tuple(sorted(set(buckets))))
        if k == 0:
            self.idle[idle] = self.idle.get(idle, 0) + 1
            if self.idle[idle] >= wait:
                k = probe
        if k:
            self.idle[idle] = 0
        self.chosen[source].append(k)
        return k

    def best_choices(self, source: str, most: int, buckets: list[int]) -> tuple[int, int, float]:
        """For a step of `source` with at most `most` drafts and rows in `buckets`: the K in [least, most] of the most
        expected tokens per second, the best K >= 1 (a refresh's), and the idle steps that pay for that refresh. Kept
        per step shape until the source's next `observe`: most steps ask what the last one asked, and the computation
        ran cold after every target step (the default 1.01-1.02x as fast with it, round 29)."""
        shape = (most, tuple(buckets))
        found = self.choices[source].get(shape)
        if found is None:
            cost = self.costs[source]
            value = [e / c for e, c in zip(self.expected_tokens(source, buckets), cost[: most + 1])]

            def best(least: int) -> int:
                return max(range(least, most + 1), key=value.__getitem__)
            probe = best(1)
            extra = (cost[probe] - cost[0]) / (self.explore_share * cost[0])  # idle steps that pay for the probe
            found = self.choices[source][shape] = (best(self.least), probe, max(self.explore_every, extra))
        return found

    def truncate(self, confidences: torch.Tensor | list[list[float]], most: int,
                 suffix_keys: Sequence[float] = (), rows: list[int] | None = None) -> int:
        """After a drafter step: how many of the `most` drafts to verify, K in [1, most], the argmax of
        expected tokens / cost["neural"][K] where each neural row's acceptance follows its drafts'
        confidences [b, >= most] (`ConfidenceCalibration`; `rows`: the batch's rows that took the drafter's drafts,
        default all) and each row of suffix drafts (one per key in `suffix_keys`) follows the suffix source's
        estimates. Lossless like any K: it depends on the drafter's distributions and the committed tokens only, never
        on the target's verdict or the tokens drawn. Replaces the step's K in `chosen`."""
        if isinstance(confidences, torch.Tensor):
            confidences = confidences.tolist()
        if rows is not None:
            confidences = [confidences[i] for i in rows]
        most = min(most, self.most["neural"])
        expected = [0.0] * (most + 1)
        rows = [self.calibration.expected_tokens(row[:most]) for row in confidences]
        if suffix_keys:
            rows.append(self.expected_tokens("suffix", self.buckets("suffix", suffix_keys)))
        for row in rows:
            expected = [total + e for total, e in zip(expected, row)]
        cost = self.costs["neural"]
        k = max(range(1, most + 1), key=lambda k: expected[k] / cost[k])
        self.chosen["neural"][-1] = k
        return k

    def observe(self, source: str, num_drafts: int, num_accepted: list[int], keys: Sequence[float] | None = None) -> None:
        """One step of `source`: each row verified `num_drafts` drafts and kept num_accepted[row]; each bucket that
        has rows in it observes them."""
        if not (num_drafts and num_accepted):
            return
        self.choices[source].clear()
        buckets = self.buckets(source, keys, len(num_accepted))
        if len(buckets) == 1:  # a lone request
            self.estimates[source][buckets[0]].observe(num_drafts, num_accepted)
            return
        for bucket in sorted(set(buckets)):
            self.estimates[source][bucket].observe(num_drafts, [a for a, b in zip(num_accepted, buckets) if b == bucket])

    def observe_drafter(self, num_drafts: int, num_accepted: list[int], confidences: torch.Tensor,
                        rows: list[int] | None = None) -> None:
        """A drafter step: `observe("neural", ...)` and the calibration of the drafts' confidences [b, num_drafts],
        for the batch's `rows` that took the drafter's drafts (default: all; `num_accepted` is the batch's)."""
        table = confidences.tolist() if num_drafts else []
        if rows is not None:
            num_accepted, table = [num_accepted[i] for i in rows], [table[i] for i in rows]
        if not (num_drafts and num_accepted):
            return
        self.observe("neural", num_drafts, num_accepted)
        self.calibration.observe(table, num_accepted)


def adaptive_draft_length(costs: dict[str, list[float]], least: int = 0, decay: float = 0.9,
                          priors: dict[str, float] | None = None, explore_every: int = 8, explore_share: float = 0.05,
                          key_edges: dict[str, Sequence[float]] | None = None):
    """The adaptive policy (`AdaptiveDraftLength`'s arguments and methods): compiled (`draft_length.cpp`, the same
    choices step for step) where the project's C++ kernels build, else `AdaptiveDraftLength`. The Python policy's
    list work ran cold after every target step, ~5% of the default's time at batch 1; compiled, the default ran 1.02x
    as fast there (docs/benchmarks.md, round 30)."""
    module = KERNEL.module()
    if module is None:
        return AdaptiveDraftLength(costs, least=least, decay=decay, priors=priors, explore_every=explore_every,
                                   explore_share=explore_share, key_edges=key_edges)
    priors = SOURCE_PRIORS if priors is None else priors
    edges = KEY_EDGES if key_edges is None else key_edges
    return module.Policy({source: list(row) for source, row in costs.items()}, least, decay,
                         {source: priors[source] for source in costs}, explore_every, explore_share,
                         {source: [float(e) for e in edges.get(source, ())] for source in costs})


class CostTables:
    """Step costs measured at several live batch sizes (`measure_step_costs` at each): a served batch grows and
    shrinks as requests come and go, and a step of 8 rows costs several times one of 1, so a policy priced at one size
    misjudges the others. `price(policy, rows)` gives the policy the table of the smallest measured size at or above
    `rows` (else the largest) when that changes."""

    def __init__(self, tables: dict[int, dict[str, list[float]]]):
        self.tables = dict(sorted(tables.items()))
        self.in_force: int | None = None

    def for_rows(self, rows: int) -> dict[str, list[float]]:
        return self.tables[self.size_for(rows)]

    def size_for(self, rows: int) -> int:
        return next((size for size in self.tables if size >= rows), max(self.tables))

    def price(self, policy, rows: int) -> None:
        size = self.size_for(rows)
        if size != self.in_force:
            policy.set_costs(self.tables[size])
            self.in_force = size


def format_costs(costs: dict[str, list[float]]) -> str:
    """A cost table for a log line: per source, the milliseconds of K = 0, 1, ... drafts."""
    return "; ".join(f"{source} " + " ".join(f"{c * 1e3:.2f}" for c in row) for source, row in costs.items())


def nondecreasing(costs: list[float]) -> list[float]:
    """A step with more drafts never costs less (the extra work is a superset): a noisy measurement
    that says otherwise is raised to the running maximum."""
    out = []
    for cost in costs:
        out.append(max(cost, out[-1]) if out else cost)
    return out


@torch.inference_mode()
def measure_step_costs(target, make_proposer, batch: int, most: int, context: int = 200,
                       rounds: int = 20, suffix_most: int | None = None) -> dict[str, list[float]]:
    """Seconds of a step with K = 0..most drafts (suffix drafts: 0..`suffix_most`, default `most`) at
    `batch` rows and a `context`-token history, per
    source: "neural" = drafter step (context write of 3 committed tokens + the whole block's forward +
    LM head: a drafter step drafts every slot and `truncate` picks how many to verify) + verify of
    K + 1 tokens; "suffix" = verify alone (no drafter forward; the step's committed tokens wait for the next
    drafter step's context write, where they cost a few rows more of its first GEMMs). `make_proposer()`
    gives a fresh `DFlashProposer` (its state is scratch here). Medians over `rounds` interleaved rounds,
    made nondecreasing in K."""
    from .accept import greedy_verify_block
    from .sampling import SamplingParams

    device = target.device
    generator = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, target.vocab_size, (batch, context), generator=generator, device=device)
    positions = torch.arange(context, device=device).expand(batch, -1)
    proposer = make_proposer()
    committed, suffix_most = 3, suffix_most or most
    widest = max(most, suffix_most)
    capacity = context + (widest + 1) * rounds * committed + widest + 2
    cache = target.new_cache(batch, capacity)
    _, features = target(tokens, positions, cache, proposer.feature_layers)
    lens = torch.full((batch,), context, device=device)
    proposer.start(features, lens, capacity)  # writes the context
    new_features = features[:, :committed]
    kept = torch.full((batch,), committed - 1, device=device)
    params, anchors = SamplingParams(), tokens[:, -1]

    def draft(k):
        proposer.commit(new_features, kept)
        proposer.propose(anchors, proposer.context_lens, [], k, params, generator)

    def verify(k):  # greedy, as the loop verifies (`greedy_verify_block`); the first of these drafts misses
        greedy_verify_block(target, tokens[:, : k + 1], context + torch.arange(k + 1, device=device).expand(batch, -1),
                            cache, proposer.feature_layers, tokens[:, 1: k + 1])

    calls = [lambda: draft(most)] + [lambda k=k: verify(k) for k in range(widest + 1)]
    drafted, *verifies = interleaved_medians(calls, rounds)
    return {"neural": nondecreasing([verifies[0]] + [v + drafted for v in verifies[1: most + 1]]),
            "suffix": nondecreasing(verifies[: suffix_most + 1])}
