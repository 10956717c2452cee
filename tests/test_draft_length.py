"""The adaptive draft-length policy (`runtime/draft_length.py`): its acceptance estimates and confidence calibration,
how it trades expected tokens against step costs, refreshes idle sources and truncates a drafter's block; the same
behaviour from the compiled policy (`draft_length.cpp`), and the same choices as the Python one step for step."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_dflash.runtime import draft_length
from trtllm_dflash.runtime.draft_length import (KEY_EDGES, SOURCE_PRIORS, AcceptanceEstimate, AdaptiveDraftLength,
                                               ConfidenceCalibration, CostTables, adaptive_draft_length)

EXPLORE_EVERY = 8  # the policies' default `explore_every`


def compiled_policy(costs, **options):
    if draft_length.KERNEL.module() is None:
        pytest.skip(f"the compiled draft-length policy is unavailable: {draft_length.KERNEL.unavailable_reason()}")
    return adaptive_draft_length(costs, **options)


POLICIES = {"python": AdaptiveDraftLength, "compiled": compiled_policy}


@pytest.mark.parametrize("kind", POLICIES)
def test_the_policy_bounds_each_source_by_its_own_cost_row(kind):
    policy = POLICIES[kind]({"neural": [1.0, 1.0, 1.0], "suffix": [1.0] * 8})  # free drafts: the most
    assert policy.choose("neural", 7) == 2 and policy.choose("suffix", 7) == 7 and policy.choose("suffix", 5) == 5
    assert policy.truncate(torch.full((1, 7), 0.9), 7) == 2


def test_acceptance_estimate_counts_positions_up_to_the_first_rejection():
    estimate = AcceptanceEstimate(most=4, decay=1.0, prior=0.5, prior_weight=1.0)
    estimate.observe(3, [1, 3, 0])  # row 0 kept 1 of 3, row 1 all 3, row 2 none
    assert estimate.trials == [3, 2, 1, 0] and estimate.accepted == [2, 1, 1, 0]
    assert estimate.rates() == pytest.approx([2.5 / 4, 1.5 / 3, 1.5 / 2, 0.5])
    r = estimate.rates()
    survive = [r[0], r[0] * r[1], r[0] * r[1] * r[2], r[0] * r[1] * r[2] * r[3]]
    assert estimate.expected_tokens() == pytest.approx([1, 1 + sum(survive[:1]), 1 + sum(survive[:2]),
                                                        1 + sum(survive[:3]), 1 + sum(survive)])
    decaying = AcceptanceEstimate(most=2, decay=0.5)
    decaying.observe(1, [0])  # position 0 rejected once; position 1 untried
    assert decaying.rates()[0] == pytest.approx(0.25)
    for _ in range(20):
        decaying.observe(1, [1])  # every later step keeps its only draft: the old rejection fades
    assert decaying.rates()[0] == pytest.approx((2 + 0.5) / (2 + 1), abs=1e-5)  # 2 = the decayed trial count
    assert decaying.rates()[1] == 0.5


@pytest.mark.parametrize("kind", POLICIES)
def test_adaptive_draft_length_trades_acceptance_against_cost(kind):
    make = POLICIES[kind]
    costs = {"neural": [1.0, 1.1, 1.2, 1.3], "suffix": [1.0, 1.1, 1.2, 1.3]}
    policy = make(costs)
    assert policy.choose("neural", 3) == 2  # prior 0.5: 1.75 tokens / 1.2 beats 1.5 / 1.1 and 1.875 / 1.3
    for _ in range(10):
        policy.observe("neural", 2, [0])  # the drafter's first draft always fails
        policy.observe("suffix", 3, [3])  # the suffix drafts always hold
    # a draft that never holds is not worth its cost: autoregressive steps, then one draft to look again
    assert [policy.choose("neural", 3) for _ in range(EXPLORE_EVERY)] == [0] * 7 + [1]
    assert policy.choose("neural", 3) == 0 and policy.choose("suffix", 3) == 3
    assert policy.choose("suffix", 2) == 2  # never more than the loop allows
    assert make(costs, least=1).choose("neural", 3) == 2  # least=1: always drafts
    assert make({"neural": [1.0, 1.0, 1.0, 1.0]}).choose("neural", 3) == 3  # free drafts: all


@pytest.mark.parametrize("kind", POLICIES)
def test_a_costly_draft_is_refreshed_less_often(kind):
    """Refreshing an idle source's estimate spends at most `explore_share` of the idle run's time over plain steps:
    a draft that costs 3x a plain step (+2.0) is tried again after 2.0 / (0.05 x 1.0) = 40 steps, not 8."""
    make = POLICIES[kind]
    policy = make({"neural": [1.0, 3.0, 3.1, 3.2]})
    for _ in range(10):
        policy.observe("neural", 2, [0])
    assert [policy.choose("neural", 3) for _ in range(40)] == [0] * 39 + [1]
    generous = make({"neural": [1.0, 3.0]}, explore_share=0.5)  # 4 steps pay for it: explore_every's 8
    assert [generous.choose("neural", 1) for _ in range(8)] == [0] * 7 + [1]


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["neural", "suffix"]), st.integers(1, 3),
                                st.lists(st.integers(0, 3), min_size=1, max_size=3),
                                st.lists(st.integers(1, 40), min_size=3, max_size=3)), min_size=1, max_size=30))
def test_kept_choices_are_what_the_estimates_give_now(steps):
    """`best_choices` keeps its answers until the source's next `observe`: after any mix of steps, every kept answer
    equals the one a policy with the same estimates and nothing kept computes."""
    import copy

    costs = {"neural": [1.0, 2.0, 2.1, 2.2], "suffix": [1.0, 1.1, 1.2, 1.3]}
    policy = AdaptiveDraftLength(costs)
    for source, drafts, accepted, keys in steps:
        keys = keys[: len(accepted)] if source == "suffix" else None
        policy.choose(source, 3, keys)
        policy.observe(source, drafts, [min(a, drafts) for a in accepted], keys)
        policy.choose(source, 2, keys)  # another shape, kept beside the first
    fresh = copy.deepcopy(policy)
    fresh.choices = {source: {} for source in costs}
    for source, kept in policy.choices.items():
        for (most, buckets), answer in kept.items():
            assert answer == fresh.best_choices(source, most, list(buckets))


@pytest.mark.parametrize("kind", POLICIES)
def test_untried_positions_start_at_each_source_s_prior(kind):
    """Before any observation each source's K follows its prior alone: the neural drafter's 0.5 stops at two
    drafts where the suffix source's optimistic prior verifies every one (SOURCE_PRIORS); swapped priors swap them."""
    costs = {source: [1.0 + 0.1 * k for k in range(8)] for source in ("neural", "suffix")}
    assert SOURCE_PRIORS == {"neural": 0.5, "suffix": 0.85}
    policy = POLICIES[kind](costs)
    assert policy.choose("neural", 7) == 2 and policy.choose("suffix", 7) == 7
    swapped = POLICIES[kind](costs, priors={"neural": 0.85, "suffix": 0.5})
    assert swapped.choose("neural", 7) == 7 and swapped.choose("suffix", 7) == 2


def test_confidence_calibration_starts_at_the_confidence_and_learns_acceptance():
    calibration = ConfidenceCalibration(decay=1.0)
    assert calibration.rate(0.93) == pytest.approx(0.95) and calibration.rate(1.0) == pytest.approx(0.95)
    assert calibration.expected_tokens([0.93, 0.13]) == pytest.approx([1, 1.95, 1.95 + 0.95 * 0.15])
    for _ in range(20):  # confident drafts that fail, unconfident ones that hold
        calibration.observe([[0.93, 0.13], [0.13, 0.93]], [0, 1])
    # row 0 tried only its first draft (0.93, rejected); row 1 kept its first (0.13) and lost its second (0.93)
    assert calibration.trials[9] == 40 and calibration.accepted[9] == 0
    assert calibration.trials[1] == 20 and calibration.accepted[1] == 20
    assert calibration.rate(0.95) == pytest.approx(0.95 * 2 / 42)


@pytest.mark.parametrize("kind", POLICIES)
def test_truncation_verifies_what_the_drafts_confidence_pays_for(kind):
    costs = {"neural": [1.0, 2.0, 2.1, 2.2, 2.3], "suffix": [1.0, 1.1, 1.2, 1.3, 1.4]}
    policy = POLICIES[kind](costs)

    def truncate(confidences, most, suffix_keys=(), rows=None):
        policy.choose("neural", 4)
        return policy.truncate(torch.tensor(confidences), most, list(suffix_keys), rows)

    assert truncate([[0.99, 0.99, 0.05, 0.99]], 4) == 2  # the third draft will likely fail: stop before it
    assert policy.chosen["neural"][-1] == 2  # the step's K as verified
    assert truncate([[0.99] * 4], 4) == 4
    assert truncate([[0.99] * 4], 2) == 2  # never more than drafted
    assert truncate([[0.05] * 4], 4) == 1  # the drafter step is paid for: at least one draft
    assert truncate([[0.05] * 4, [0.99] * 4], 4, rows=[1]) == 4  # only the batch's neural rows count
    for _ in range(30):
        policy.observe("suffix", 4, [4])  # suffix drafts that always hold
    assert truncate([[0.99, 0.05, 0.05, 0.05]], 4, suffix_keys=[2, 3, 2]) == 4  # the suffix rows carry it


def test_each_bucket_of_match_lengths_learns_its_own_acceptance():
    """Suffix drafts after short matches that fail and after long ones that hold, in one step: each bucket of
    KEY_EDGES learns its own, so a step of short matches stops early while one of long matches verifies every
    draft, and a mixed step weighs both."""
    costs = {"neural": [1.0, 2.0, 2.1], "suffix": [1.0 + 0.1 * k for k in range(8)]}
    policy = AdaptiveDraftLength(costs)
    assert KEY_EDGES["suffix"] == (4, 16) and policy.buckets("suffix", [2, 3, 4, 15, 16, 90]) == [0, 0, 1, 1, 2, 2]
    for _ in range(30):
        policy.observe("suffix", 7, [0, 7, 7], keys=[2, 20, 40])
    assert policy.choose("suffix", 7, keys=[2]) == 0
    assert policy.choose("suffix", 7, keys=[20]) == 7 == policy.choose("suffix", 7, keys=[2, 30])
    assert policy.estimates["suffix"][1].trials == [0.0] * 7  # the middle bucket saw nothing: still at its prior
    assert policy.choose("suffix", 7, keys=[8]) == 7 and policy.choose("suffix", 7) == 0  # no keys: the first bucket
    policy.choose("neural", 2)
    assert policy.truncate([[0.05, 0.05]], 2, suffix_keys=[2]) == 1 < policy.truncate([[0.05, 0.05]], 2, [20])


@pytest.mark.parametrize("kind", POLICIES)
def test_idle_steps_count_per_bucket(kind):
    """A bucket whose drafts never hold goes plain and is refreshed after `explore_every` of its own idle steps;
    steps of another bucket in between neither refresh it nor reset its count."""
    policy = POLICIES[kind]({"suffix": [1.0, 1.3, 1.4]}, priors={"suffix": 0.85})
    for _ in range(10):
        policy.observe("suffix", 2, [0], keys=[2])
    chosen = []
    for _ in range(EXPLORE_EVERY):
        chosen.append(policy.choose("suffix", 2, keys=[2]))
        assert policy.choose("suffix", 2, keys=[30]) == 2  # the untried long bucket drafts every time
    assert chosen == [0] * 7 + [2]


STEP = st.tuples(st.integers(1, 8),  # rows
                 st.sampled_from(["neural", "suffix", "mixed"]),
                 st.integers(0, 20),  # the loop's most drafts
                 st.lists(st.integers(0, 40), min_size=8, max_size=8),  # match lengths, the suffix rows' keys
                 st.lists(st.integers(0, 15), min_size=8, max_size=8),  # drafts kept, cut to the step's K
                 st.lists(st.floats(0.0, 1.0, width=32), min_size=64, max_size=64))  # the drafter's confidences


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(STEP, min_size=1, max_size=60), share=st.sampled_from([0.05, 0.5]))
def test_the_compiled_policy_chooses_as_the_python_one(steps, share):
    """Any run of steps as the hybrid proposer makes them (suffix steps, drafter steps with some rows on suffix drafts,
    plain steps), each priced by its rows' table (`CostTables`, as served): the compiled policy returns the Python one's
    K at every `choose` and `truncate`, and its estimates and calibration expect the same tokens, float for float, after
    every step."""
    costs = {"neural": [1.0, 2.6, 2.7, 2.9, 3.0, 3.2, 3.3, 3.5], "suffix": [1.0 + 0.07 * k for k in range(16)]}
    wide = {"neural": [1.0 + 0.9 * k for k in range(8)], "suffix": [1.0 + 0.5 * k for k in range(16)]}  # 4+ rows
    python, compiled = AdaptiveDraftLength(costs, explore_share=share), compiled_policy(costs, explore_share=share)
    tables = {policy: CostTables({2: costs, 8: wide}) for policy in ("python", "compiled")}
    probes = [0.05 + 0.1 * i for i in range(7)]  # one row of confidences, one per calibration bucket but the last

    def same_estimates():
        for keys in (None, [2], [5], [20], [2, 5, 20, 20]):
            assert compiled.expected_tokens("suffix", keys) == python.expected_tokens(
                "suffix", python.buckets("suffix", keys))
        assert compiled.expected_tokens("neural") == python.expected_tokens("neural", [0])
        float32 = torch.tensor(probes).tolist()  # the compiled calibration reads float32 confidences
        assert compiled.calibrated_tokens(float32) == python.calibration.expected_tokens(float32)

    for rows, kind, most, lengths, kept, confidences in steps:
        same_estimates()
        tables["python"].price(python, rows)
        tables["compiled"].price(compiled, rows)
        keys = lengths[:rows]
        if kind == "suffix":
            k = python.choose("suffix", most, keys)
            assert compiled.choose("suffix", most, keys) == k
            accepted = [min(a, k) for a in kept[:rows]]
            python.observe("suffix", k, accepted, keys)
            compiled.observe("suffix", k, accepted, keys)
            continue
        k = python.choose("neural", most)
        assert compiled.choose("neural", most) == k
        if k == 0:
            continue
        neural = list(range(rows)) if kind == "neural" else list(range(0, rows, 2))
        suffix_keys = [keys[i] for i in range(rows) if i not in neural]
        table = torch.tensor(confidences, dtype=torch.float32).view(8, 8)[:rows, :k]
        picked = None if len(neural) == rows else neural
        k = python.truncate(table, k, suffix_keys, picked)
        assert compiled.truncate(table, k, suffix_keys, picked) == k
        accepted = [min(a, k) for a in kept[:rows]]
        if suffix_keys:
            suffix = [accepted[i] for i in range(rows) if i not in neural]
            python.observe("suffix", k, suffix, suffix_keys)
            compiled.observe("suffix", k, suffix, suffix_keys)
        python.observe_drafter(k, accepted, table[:, :k], picked)
        compiled.observe_drafter(k, accepted, table[:, :k], picked)
    same_estimates()
    assert compiled.chosen == python.chosen


def test_the_policy_runs_in_python_where_the_kernels_do_not_build(monkeypatch):
    monkeypatch.setattr(draft_length.KERNEL, "module", lambda: None)
    assert isinstance(adaptive_draft_length({"neural": [1.0, 2.0]}), AdaptiveDraftLength)


def test_the_compiled_policy_refuses_what_it_cannot_answer():
    policy = compiled_policy({"neural": [1.0, 2.0, 2.1]})
    with pytest.raises(RuntimeError, match="no step costs for draft source suffix"):
        policy.choose("suffix", 2, [3])
    with pytest.raises(RuntimeError, match="truncate follows a choose"):
        policy.truncate(torch.ones(1, 2), 2)
    with pytest.raises(RuntimeError, match=r"a tensor \[rows, K\]"):
        policy.truncate(torch.ones(2), 2)
    policy.choose("neural", 2)
    with pytest.raises(RuntimeError, match="row 3 is outside the batch of 2"):
        policy.truncate(torch.ones(2, 2), 2, [], [3])
    with pytest.raises(RuntimeError, match="row 2 is outside the batch of 2"):
        policy.observe_drafter(2, [1, 1], torch.ones(2, 2), [0, 2])


class Recorder:
    def __init__(self):
        self.tables = []

    def set_costs(self, costs):
        self.tables.append(costs)


def test_cost_tables_price_a_step_by_the_smallest_measured_batch_that_holds_its_rows():
    tables = {rows: {"neural": [float(rows), 2.0 * rows]} for rows in (1, 2, 4, 8)}
    priced, policy = CostTables(tables), Recorder()
    for rows in (1, 1, 3, 4, 2, 9, 8, 5):
        priced.price(policy, rows)
    assert [table["neural"][0] for table in policy.tables] == [1, 4, 2, 8]  # only when the table changes
    assert priced.for_rows(3) is tables[4] and priced.for_rows(100) is tables[8]


@pytest.mark.parametrize("kind", POLICIES)
def test_new_step_costs_keep_the_estimates_and_change_the_choice(kind):
    cheap, dear = {"neural": [1.0, 1.1, 1.2, 1.3]}, {"neural": [1.0, 3.0, 5.0, 7.0]}
    policy = POLICIES[kind](cheap, explore_every=1000)
    for _ in range(20):  # drafts that hold
        k = policy.choose("neural", 3)
        policy.observe("neural", k, [k])
    assert policy.choose("neural", 3) == 3
    policy.set_costs(dear)  # drafting now costs more than the held drafts give
    assert policy.choose("neural", 3) == 0
    policy.set_costs(cheap)
    assert policy.choose("neural", 3) == 3
    with pytest.raises((ValueError, RuntimeError), match="must keep its 4 entries"):
        policy.set_costs({"neural": [1.0, 2.0]})
