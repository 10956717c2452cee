"""Pareto math, the cost model and the schedule on synthetic data with known answers."""

from __future__ import annotations

import json

import pytest

from trtllm_dflash.bench.cost_model import CostModel, fit_cost_model, holdout_error, holdout_split
from trtllm_dflash.bench.pareto import (best_throughput_gain, frontier, interpolate, throughput_gain_at,
                                        throughput_gains)
from trtllm_dflash.bench.points import AR, BenchPoint
from trtllm_dflash.bench.projection import acceptance_from_tau, project
from trtllm_dflash.bench.schedule import (build_schedule, canonical, check_schedule, choose_lengths, measured_score,
                                          model_score, schedule_from_bench)
from trtllm_dflash.errors import InputError
from trtllm_dflash.runtime.reference import draft_length

TRUE = CostModel(verify=(2e-3, 1e-4, 5e-5), draft=(1e-3, 2e-5, 3e-5), acceptance=(0.8, 0.6, 0.45, 0.3))


def synthetic_points(model: CostModel, concurrency=(1, 2, 4, 8, 16, 32)) -> list[BenchPoint]:
    points = []
    for c in concurrency:
        for k in range(model.max_draft_len + 1):
            draft, verify = model.draft_time(c, k), model.verify_time(c, k + 1)
            points.append(BenchPoint(method=AR if k == 0 else "dflash", draft_len=k, concurrency=c,
                                     tokens_per_s_user=model.tokens_per_s_user(c, k), tokens_per_s=model.tokens_per_s(c, k),
                                     tau=model.tokens_per_step(k), draft_s=draft, verify_s=verify, step_s=draft + verify,
                                     mean_batch=float(c), steps=10, decode_tokens=100, repeats=1,
                                     per_position_acceptance=list(model.acceptance[:k]),
                                     decode_tokens_per_s=model.tokens_per_s(c, k)))
    return points


def test_frontier_drops_dominated_points_and_sorts_by_x():
    points = [(1, 10), (2, 8), (1.5, 7), (3, 3), (2, 5), (0.5, 9)]
    assert frontier(points) == [(1, 10), (2, 8), (3, 3)]


def test_interpolate_is_linear_inside_and_none_outside():
    curve = [(1.0, 10.0), (3.0, 6.0)]
    assert interpolate(curve, 2.0) == pytest.approx(8.0)
    assert interpolate(curve, 1.0) == 10.0 and interpolate(curve, 3.0) == 6.0
    assert interpolate(curve, 0.5) is None and interpolate(curve, 3.5) is None
    assert interpolate([(2.0, 4.0)], 2.0) == 4.0 and interpolate([], 1.0) is None


def test_throughput_gain_at_equal_interactivity():
    ar = [(100.0, 100.0), (50.0, 400.0), (25.0, 800.0)]  # per user, aggregate
    spec = [(75.0, 750.0), (200.0, 200.0)]  # the second lies outside AR's interactivity range
    assert throughput_gains(spec, ar) == [(75.0, pytest.approx(3.0))]  # AR at 75 tok/s/user: 250
    assert best_throughput_gain(spec, ar) == (75.0, pytest.approx(3.0))
    assert throughput_gain_at(spec, ar, 75.0) == pytest.approx(3.0)
    assert best_throughput_gain([(500.0, 1.0)], ar) is None


def test_cost_model_recovers_known_parameters():
    fitted = fit_cost_model(synthetic_points(TRUE))
    assert fitted.verify == pytest.approx(TRUE.verify, rel=1e-6)
    assert fitted.draft == pytest.approx(TRUE.draft, rel=1e-6)
    assert fitted.acceptance == pytest.approx(TRUE.acceptance)
    assert fitted.tokens_per_step(4) == pytest.approx(1 + 0.8 + 0.6 + 0.45 + 0.3)


def test_holdout_interpolates_and_is_exact_on_noiseless_data():
    points = synthetic_points(TRUE)
    fit_on, held = holdout_split(points)
    assert {p.concurrency for p in held} == {2, 8} and {1, 32} <= {p.concurrency for p in fit_on}
    report = holdout_error(points)
    assert report["max_abs_relative_error"] < 1e-9 and report["heldout_concurrency"] == [2, 8]
    assert holdout_split(synthetic_points(TRUE, (1, 2))) is None


def test_cost_model_round_trips_and_refuses_unknown_draft_lengths():
    assert CostModel.from_dict(json.loads(json.dumps(TRUE.to_dict()))) == TRUE
    with pytest.raises(InputError, match="draft_len"):
        TRUE.tokens_per_step(5)


def test_schedule_follows_load_and_keeps_trtllm_constraints():
    # Verify cost grows with b*w, so long drafts pay at small batches only.
    model = CostModel(verify=(1e-3, 0.0, 2e-4), draft=(2e-4, 0.0, 1e-5), acceptance=(0.9, 0.8, 0.7, 0.6))
    lengths, capped = choose_lengths(model_score(model), [1, 2, 4, 8, 16, 32, 64], 4)
    values = [lengths[k] for k in sorted(lengths)]
    assert values[0] == 4 and values == sorted(values, reverse=True) and not capped
    section = build_schedule(model_score(model), [1, 2, 4, 8, 16, 32, 64], 4, "test")
    schedule = {int(k): v for k, v in section["draft_len_schedule"].items()}
    check_schedule(schedule, section["max_draft_len"])
    assert schedule[min(schedule)] == section["max_draft_len"] == 4
    for batch in range(1, 65):  # the canonical form means exactly what the per-band choice means
        assert draft_length(schedule, batch, 4) == lengths[min(k for k in lengths if k >= batch)]


def test_schedule_caps_later_bands_at_the_first_bands_length():
    # A band that would want longer drafts than batch 1 is capped: max_draft_len = schedule[min key].
    scores = {(1, 1): 5.0, (1, 2): 4.0, (4, 1): 1.0, (4, 2): 9.0}
    lengths, capped = choose_lengths(lambda low, high, k: scores.get((high, k), 0.0), [1, 4], 2)
    assert lengths == {1: 1, 4: 1} and capped == [4]


def test_canonical_merges_equal_bands_and_drops_trailing_zeros():
    assert canonical({1: 4, 2: 4, 4: 2, 8: 0, 16: 0}) == {2: 4, 4: 2}
    assert canonical({1: 0, 4: 0}) == {}


def test_measured_score_picks_the_fastest_measured_length():
    points = synthetic_points(TRUE, (1, 4))
    lengths, _ = choose_lengths(measured_score(points), [1, 4], 4)
    best = max((p for p in points if p.concurrency == 1), key=lambda p: p.tokens_per_s)
    assert lengths[1] == best.draft_len


@pytest.mark.parametrize("schedule, most, message", [
    ({0: 2}, None, ">= 1"), ({1: -1}, None, ">= 0"), ({1: 2, 4: 3}, None, "<= max_draft_len"),
    ({1: 2, 4: 1}, 3, "must map to max_draft_len")])
def test_check_schedule_rejects_what_trtllm_rejects(schedule, most, message):
    with pytest.raises(InputError, match=message):
        check_schedule(schedule, most)


def test_schedule_from_bench_reads_and_validates(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"schedule": {"draft_len_schedule": {"8": 2, "2": 4}, "max_draft_len": 4}}))
    assert schedule_from_bench(path) == {2: 4, 8: 2} and list(schedule_from_bench(path)) == [2, 8]
    path.write_text(json.dumps({"schedule": {"draft_len_schedule": {"2": 3, "8": 2}, "max_draft_len": 4}}))
    with pytest.raises(InputError, match="schedule.draft_len_schedule"):
        schedule_from_bench(path)
    path.write_text(json.dumps({"points": []}))
    with pytest.raises(InputError, match="is it a dflash-bench JSON"):
        schedule_from_bench(path)
    path.write_text("{")
    with pytest.raises(InputError, match="not valid JSON"):
        schedule_from_bench(path)
    with pytest.raises(InputError, match="not found"):
        schedule_from_bench(tmp_path / "missing.json")
    for schedule, most, field in [({"2": 4.9}, 4, "draft_len_schedule"), ({"x": 4}, 4, "draft_len_schedule"),
                                  ({"2": 4}, "4", "max_draft_len")]:
        path.write_text(json.dumps({"schedule": {"draft_len_schedule": schedule, "max_draft_len": most}}))
        with pytest.raises(InputError, match=f"bench.json: field 'schedule.{field}'"):
            schedule_from_bench(path)
    with pytest.raises(InputError, match="is a directory; expected a JSON file"):
        schedule_from_bench(tmp_path)
    path.write_bytes(b"\x00\xbd binary")
    with pytest.raises(InputError, match="bench.json: not valid JSON"):
        schedule_from_bench(path)


def test_schedule_from_bench_refuses_a_schedule_the_bench_did_not_recommend(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"schedule": {"recommended": False, "candidate_draft_len_schedule": {"4": 3},
                                             "reason": "its largest effect is 3.0%, within the spread of 9.0%"}}))
    with pytest.raises(InputError, match="schedule.recommended.*did not recommend a schedule: its largest effect"):
        schedule_from_bench(path)


def test_projection_uses_the_published_inputs():
    # tau at K = 3, 5, 9 is reproduced exactly by the per-position acceptance (HF-120b card, GSM8K).
    acceptance = acceptance_from_tau((3.3, 4.3, 5.3))
    assert [1 + sum(acceptance[:k]) for k in (3, 5, 9)] == pytest.approx([3.3, 4.3, 5.3])
    result = project("GSM8K", "card-calibrated")
    ar_batch1 = next(p for p in result["points"] if p.method == AR and p.concurrency == 1)
    assert ar_batch1.tokens_per_s_user == pytest.approx(420.0)  # TensorRT-LLM blog, 8x B200
    assert result["headline"]["interactivity_gain_at_smallest_batch"]["ratio"] > 1
    check_schedule({int(k): v for k, v in result["schedule"]["draft_len_schedule"].items()})
