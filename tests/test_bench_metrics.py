"""Serving metrics on scripted timelines (exact), Poisson arrivals, load drivers, bootstrap
intervals and the refusal to recommend a schedule that noise could explain."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from trtllm_dflash.bench.confidence import (bootstrap_interval, decisive_spread, recommendation, schedule_effect,
                                            spread_summary)
from trtllm_dflash.bench.load import LoadShape, closed_loop, open_loop, poisson_arrivals, read_sharegpt, synthetic_prompts
from trtllm_dflash.bench.metrics import RequestRecord, distribution, latency_samples, reported_acceptance, run_figures
from trtllm_dflash.bench.points import AR, CONCURRENCY, RATE, BenchPoint
from trtllm_dflash.bench.report import headline
from trtllm_dflash.errors import InputError


def scripted(send: float, chunks: list[tuple[float, int]], end: float | None = None, **stats) -> RequestRecord:
    record = RequestRecord(prompt_tokens=4, send=send, **stats)
    for when, tokens in chunks:
        record.add_chunk(when, tokens)
    record.end = chunks[-1][0] if end is None else end
    return record


def test_ttft_tpot_itl_e2e_of_a_scripted_timeline():
    # Sent at 1.0; first token at 1.5 (TTFT 0.5); then a block of 3 at 1.7 and 2 at 2.1: 6 tokens.
    record = scripted(1.0, [(1.5, 1), (1.7, 3), (2.1, 2)], end=2.2)
    assert record.ttft == pytest.approx(0.5)
    assert record.output_tokens == 6
    assert record.tpot == pytest.approx((2.1 - 1.5) / 5)  # decode time over the 5 tokens after the first
    assert record.itls == pytest.approx([0.2, 0.4])  # per chunk: one gap covers a whole accepted block
    assert record.e2e == pytest.approx(1.2)
    assert scripted(0.0, [(0.3, 1)]).tpot is None  # one token: no decode time


def test_percentiles_are_numpys_linear_interpolation():
    values = [0.1, 0.2, 0.3, 0.4, 1.0]
    stats = distribution(values)
    assert stats["p50"] == pytest.approx(0.3)
    assert stats["p90"] == pytest.approx(0.4 + 0.6 * 0.6)  # rank 3.6 between 0.4 and 1.0
    assert stats["p99"] == pytest.approx(0.4 + 0.6 * 0.96)
    assert stats["mean"] == pytest.approx(0.4)
    assert distribution([]) is None


def test_run_figures_throughput_and_failed_requests():
    good = [scripted(0.0, [(0.5, 1), (1.0, 4)]), scripted(0.5, [(1.0, 1), (2.0, 9)])]
    failed = RequestRecord(prompt_tokens=4, send=0.2, error="HTTP 500")
    figures = run_figures(good + [failed])
    assert figures["completed"] == 2 and figures["failed"] == 1
    assert figures["duration_s"] == pytest.approx(2.0)  # first send 0.0 to last end 2.0
    assert figures["output_tokens_per_s"] == pytest.approx(15 / 2.0)
    assert figures["requests_per_s"] == pytest.approx(1.0)
    assert figures["tokens_per_s_user"] == pytest.approx(np.mean([4 / 0.5, 9 / 1.0]))
    samples = latency_samples(good)
    assert samples["ttft_s"] == pytest.approx([0.5, 0.5]) and samples["itl_s"] == pytest.approx([0.5, 1.0])
    assert run_figures([failed]) == {"completed": 0, "failed": 1}


def test_reported_acceptance_is_token_weighted_or_not_reported():
    a = scripted(0.0, [(0.1, 1), (0.2, 3)], tau=3.0, per_position_acceptance=[1.0, 0.5])
    b = scripted(0.0, [(0.1, 1), (0.2, 11)], tau=1.5, per_position_acceptance=[0.5, 0.0])
    tau, positions = reported_acceptance([a, b])
    assert tau == pytest.approx((3.0 * 4 + 1.5 * 12) / 16)
    assert positions == pytest.approx([(1.0 * 4 + 0.5 * 12) / 16, (0.5 * 4) / 16])
    assert reported_acceptance([scripted(0.0, [(0.1, 2)])]) == (None, None)
    # A server's own token count wins over counting chunks (OpenAI chunks carry no count).
    assert scripted(0.0, [(0.1, 1), (0.2, 1)], reported_output_tokens=7).output_tokens == 7


def test_poisson_arrivals_are_seeded_and_at_the_rate():
    assert poisson_arrivals(4.0, 50, None, seed=3) == poisson_arrivals(4.0, 50, None, seed=3)
    assert poisson_arrivals(4.0, 50, None, seed=3) != poisson_arrivals(4.0, 50, None, seed=4)
    gaps = []
    for seed in range(200):
        arrivals = poisson_arrivals(5.0, 101, None, seed)
        assert len(arrivals) == 101 and arrivals[0] == 0.0 and arrivals == sorted(arrivals)
        gaps += np.diff(arrivals).tolist()
    # 20,000 exponential gaps: mean 1/rate within 3% (its standard error is 0.7%), and exponential
    # (standard deviation equal to the mean, unlike evenly spaced or bursty arrivals).
    assert np.mean(gaps) == pytest.approx(1 / 5.0, rel=0.03)
    assert np.std(gaps) == pytest.approx(1 / 5.0, rel=0.05)
    timed = poisson_arrivals(10.0, 0, duration=20.0, seed=1)
    assert timed[-1] <= 20.0 and len(timed) == pytest.approx(200, rel=0.2)
    with pytest.raises(InputError, match="--request-rate"):
        poisson_arrivals(0.0, 5, None, 0)


class FakeServer:
    """Answers after `service_s`, counting requests in flight."""

    def __init__(self, service_s: float):
        self.service_s, self.in_flight, self.most = service_s, 0, 0
        self.lock = threading.Lock()

    def send(self, prompt) -> RequestRecord:
        record = RequestRecord(prompt_tokens=len(prompt), send=time.perf_counter())
        with self.lock:
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
        time.sleep(self.service_s)
        record.add_chunk(time.perf_counter(), 1)
        record.end = time.perf_counter()
        with self.lock:
            self.in_flight -= 1
        return record


def test_closed_loop_keeps_exactly_the_users_in_flight():
    server = FakeServer(0.01)
    shape = LoadShape(CONCURRENCY, 3, requests=12)
    records = closed_loop(server.send, shape.prompts([[1, 2], [3]]), 3, None)
    assert len(records) == 12 and server.most == 3


def test_closed_loop_with_a_duration_stops_sending():
    server = FakeServer(0.01)
    shape = LoadShape(CONCURRENCY, 2, requests=0, duration=0.1)
    start = time.perf_counter()
    records = closed_loop(server.send, shape.prompts([[1]]), 2, shape.duration)
    assert time.perf_counter() - start < 1.0 and 4 <= len(records) <= 40


def test_open_loop_sends_on_schedule_regardless_of_replies():
    server = FakeServer(0.05)  # slower than the arrivals: requests overlap
    arrivals = [0.0, 0.01, 0.02, 0.03]
    records = open_loop(server.send, iter([[1]] * 4), arrivals)
    sends = sorted(r.send for r in records)
    assert len(records) == 4 and server.most >= 3
    assert [s - sends[0] for s in sends] == pytest.approx(arrivals, abs=0.01)


def test_sharegpt_takes_the_first_human_turn(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text('[{"conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "yo"}]},'
                    ' {"conversations": [{"from": "gpt", "value": "only a reply"}]}]')
    assert read_sharegpt(path) == ["hi there"]
    path.write_text('{"conversations": []}')
    with pytest.raises(InputError, match="JSON list of conversations"):
        read_sharegpt(path)


def test_synthetic_prompts_have_the_asked_length_and_range():
    prompts = synthetic_prompts(5, 7, 50, seed=1)
    assert prompts == synthetic_prompts(5, 7, 50, seed=1)
    assert len(prompts) == 5 and all(len(p) == 7 and all(2 <= t < 49 for t in p) for p in prompts)


def point(method: str, k: int, c: int, users: list[float], totals: list[float]) -> BenchPoint:
    return BenchPoint(method=method, draft_len=k, concurrency=c, tokens_per_s_user=float(np.median(users)),
                      tokens_per_s=float(np.median(totals)), tau=None, draft_s=None, verify_s=None, step_s=None,
                      mean_batch=None, steps=None, decode_tokens=None, repeats=len(users),
                      tokens_per_s_user_repeats=users, tokens_per_s_repeats=totals)


def interactivity(points):
    value = headline(points)["interactivity_gain_at_smallest_batch"]
    return None if value is None else value["ratio"]


def test_bootstrap_interval_brackets_the_ratio_and_widens_with_noise():
    quiet = [point(AR, 0, 1, [100, 101, 99], [100, 101, 99]), point("dflash", 3, 1, [200, 202, 198], [200, 201, 199])]
    noisy = [point(AR, 0, 1, [60, 100, 140], [60, 100, 140]), point("dflash", 3, 1, [120, 200, 280], [120, 200, 280])]
    low, high = bootstrap_interval(quiet, interactivity)
    assert low <= 2.0 <= high and high - low < 0.1
    wide = bootstrap_interval(noisy, interactivity)
    assert wide[1] - wide[0] > 5 * (high - low)
    assert bootstrap_interval(quiet, interactivity, seed=1) == bootstrap_interval(quiet, interactivity, seed=1)
    single = [point(AR, 0, 1, [100], [100]), point("dflash", 3, 1, [200], [200])]
    assert bootstrap_interval(single, interactivity) is None  # one repeat: nothing to resample


def test_spread_is_range_over_median():
    p = point(AR, 0, 1, [90, 100, 110], [80, 100, 130])
    assert p.spread() == pytest.approx(0.5) and p.spread("tokens_per_s_user") == pytest.approx(0.2)
    assert spread_summary([p, point(AR, 0, 2, [1, 1], [100, 110])])["median"] == pytest.approx((0.5 + 10 / 105) / 2)
    assert spread_summary([point(AR, 0, 1, [1], [1])]) is None


def test_schedule_effect_and_refusal_when_noise_exceeds_it():
    scores = {(1, 0): 100.0, (1, 1): 120.0, (1, 2): 126.0, (4, 0): 300.0, (4, 1): 280.0, (4, 2): 250.0}
    score = lambda low, high, k: scores[(high, k)]  # noqa: E731
    effect = schedule_effect(score, {1: 2, 4: 0}, 2)
    assert effect["margin"] == pytest.approx(0.26) and effect["band"] == [1, 1] and effect["versus"] == "AR"
    quiet = {"median": 0.05, "max": 0.1, "points": 6}
    assert recommendation(effect, quiet, 0.1, uses_model=True)["recommended"]
    refused = recommendation(effect, quiet, 1.05, uses_model=True)  # the 105% held-out error
    assert not refused["recommended"] and "held-out error of 105.0%" in refused["reason"]
    noisy = recommendation(effect, {"median": 0.4, "max": 0.9, "points": 6}, 0.1, uses_model=True)
    assert not noisy["recommended"] and "spread (typical) of 40.0%" in noisy["reason"]
    # Quiet on the whole, but the two points the effect rests on scatter more than the effect.
    local = recommendation(effect, quiet, 0.1, uses_model=True, local_spread=0.3)
    assert not local["recommended"] and "spread (at batch 1) of 30.0%" in local["reason"]
    assert recommendation(effect, quiet, 1.05, uses_model=False)["recommended"]  # measured: no model error
    assert not recommendation(effect, None, 0.1, uses_model=True)["recommended"]  # one repeat
    # Speculation off everywhere: the effect is AR's lead over the best draft length.
    off = schedule_effect(score, {1: 0, 4: 0}, 2)
    assert off["versus"] in ("K=1", "K=2") and off["margin"] == pytest.approx(300 / 280 - 1)


def test_decisive_spread_reads_the_effects_own_points():
    points = [point(AR, 0, 1, [1, 1, 1], [90, 100, 140]), point("dflash", 3, 1, [1, 1, 1], [190, 200, 210]),
              point("dflash", 1, 1, [1, 1, 1], [100, 100, 100]), point(AR, 0, 4, [1, 1], [100, 300])]
    effect = {"margin": 1.0, "band": [1, 1], "draft_len": 3, "versus": "AR"}
    assert decisive_spread(points, effect) == pytest.approx(0.5)  # AR at c=1: (140 - 90) / 100
    unswept = {"margin": 1.0, "band": [1, 1], "draft_len": 5, "versus": "AR"}  # falls back to the fastest, K=3
    assert decisive_spread(points[1:3], unswept) == pytest.approx(0.1)
    assert decisive_spread(points, {"margin": 0.0}) is None


def test_rate_points_are_labelled_by_their_rate():
    p = BenchPoint(method=AR, draft_len=0, concurrency=8, tokens_per_s_user=1.0, tokens_per_s=1.0, tau=None,
                   draft_s=None, verify_s=None, step_s=None, mean_batch=None, steps=None, decode_tokens=None,
                   repeats=1, load=RATE, rate=2.5)
    assert p.label == "rate=2.5/s" and p.level == 2.5
