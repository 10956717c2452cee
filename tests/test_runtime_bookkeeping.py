"""Acceptance bookkeeping and cache invariants under controlled drafts.

`ScriptedProposer` runs the real DFlash drafter (so its context cache is maintained exactly as in
production) but replaces its tokens: right for the first `k` positions, wrong after. Before every
step it checks both caches against a from-scratch recomputation on the committed sequence.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_dflash.models.random_pair import drafter_config_for, random_drafter, random_target, tiny_target_config
from trtllm_dflash.models.target import GptOssTarget
from trtllm_dflash.runtime.proposers import DFlashProposer, verify_block
from trtllm_dflash.runtime.reference import ReferenceRuntime
from trtllm_dflash.runtime.sampling import SamplingParams

BLOCK = 4
MAX_TOKENS = 30


class RecordingTarget(GptOssTarget):
    """Keeps a handle on the K/V arena the loop allocates."""

    def new_cache(self, batch, capacity):
        self.last_cache = super().new_cache(batch, capacity)
        return self.last_cache


class ScriptedProposer(DFlashProposer):
    def __init__(self, drafter, target, references, correct_prefix):
        super().__init__(drafter, target)
        self.references, self.correct_prefix = references, correct_prefix
        self.checks = 0
        self.started = 0  # requests of earlier batches (batches run in input order)

    def start(self, features, prompt_lens, capacity):
        super().start(features, prompt_lens, capacity)
        self.requests = list(range(self.started, self.started + len(prompt_lens)))
        self.started += len(prompt_lens)

    def keep_rows(self, rows):
        super().keep_rows(rows)
        self.requests = [self.requests[i] for i in rows.tolist()]

    def propose(self, anchors, anchor_positions, history, num_drafts, params, generator):
        super().propose(anchors, anchor_positions, history, num_drafts, params, generator)
        drafts = []
        for row, (request, s) in enumerate(zip(self.requests, anchor_positions.tolist())):
            truth = self.references[request][s + 1: s + BLOCK]
            drafts.append([t if j < self.correct_prefix else (t + 1) % self.target.vocab_size
                           for j, t in enumerate(truth)])
            self.check_caches(row, self.references[request][:s])
        return verify_block(anchors, torch.tensor(drafts)), None

    def check_caches(self, row, committed):
        """Target K/V and draft context K/V of positions [0, s) equal a fresh computation."""
        s = len(committed)
        fresh_target = GptOssTarget.new_cache(self.target, 1, s + 1)  # not recorded
        tokens = torch.tensor([committed])
        positions = torch.arange(s)[None]
        _, features = GptOssTarget.forward(self.target, tokens, positions, fresh_target, self.feature_layers)
        loop_target = self.target.last_cache
        for layer in range(len(loop_target.k)):
            torch.testing.assert_close(loop_target.k[layer][row, :, :s], fresh_target.k[layer][0, :, :s])
            torch.testing.assert_close(loop_target.v[layer][row, :, :s], fresh_target.v[layer][0, :, :s])
        fresh_draft = self.drafter.new_cache(1, s + 1)
        self.drafter.write_context(features, positions, fresh_draft)
        assert int(self.context_lens[row]) == s
        for layer in range(len(fresh_draft.k)):
            torch.testing.assert_close(self.cache.k[layer][row, :, :s], fresh_draft.k[layer][0, :, :s])
            torch.testing.assert_close(self.cache.v[layer][row, :, :s], fresh_draft.v[layer][0, :, :s])
        self.checks += 1


@pytest.fixture(scope="module")
def setup():
    config = tiny_target_config()
    target = RecordingTarget(random_target(config, 5).float())
    drafter = random_drafter(drafter_config_for(config, block_size=BLOCK), 6)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (3, 17, 9, 12)]
    # Greedy references long enough that a drafter is never asked beyond them.
    long = ReferenceRuntime(target, None).generate(prompts, SamplingParams(max_tokens=MAX_TOKENS + BLOCK), batch_size=4)
    references = [p + r.output_token_ids for p, r in zip(prompts, long)]
    return target, drafter, prompts, references


@pytest.mark.parametrize("correct_prefix", [0, 1, 2, BLOCK - 1])
def test_acceptance_length_follows_correct_prefix(setup, correct_prefix):
    target, drafter, prompts, references = setup
    proposer = ScriptedProposer(drafter, target, references, correct_prefix)
    results = ReferenceRuntime(target, proposer).generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), batch_size=3)
    for prompt, reference, result in zip(prompts, references, results):
        assert result.output_token_ids == reference[len(prompt): len(prompt) + MAX_TOKENS]  # still lossless
        stats = result.stats
        assert stats.acceptance_length == correct_prefix + 1
        assert stats.accepted_histogram[correct_prefix] == stats.steps
        assert stats.steps == -(-(MAX_TOKENS - 1) // (correct_prefix + 1))
        expected_positions = [1.0 if k < correct_prefix else 0.0 for k in range(BLOCK - 1)]
        assert stats.per_position_acceptance == expected_positions
    assert proposer.checks == sum(r.stats.steps for r in results)


def test_totals_count_one_prefill_token_per_request():
    from trtllm_dflash.runtime.stats import GenerationResult, RequestStats, total_stats

    results = [GenerationResult([1], list(range(10)), "length", RequestStats(4, num_output_tokens=10, decode_time=1.0))
               for _ in range(4)]
    total = total_stats(results, batch_size=2)
    assert total.num_decode_tokens == 4 * 9 and total.requests == 4
    assert total.decode_tokens_per_s == 36 / 2.0  # two batches of one second each


def test_totals_from_decode_spans_cover_static_batches_and_overlapping_requests():
    """Requests that say when their decode began: the run's prefill time is the union of their prefill spans, its
    decode time the union of all spans less that (static batches: the slowest request of each; in flight: overlaps
    counted once, gaps and newcomers' prefills left out)."""
    from trtllm_dflash.runtime.stats import GenerationResult, RequestStats, covered, total_stats

    def result(start, decode, prefill=0.5):
        return GenerationResult([1], list(range(5)), "length", RequestStats(4, num_output_tokens=5, decode_time=decode,
                                                                             prefill_time=prefill, decode_started=start))

    static = [result(10.0, 2.0), result(10.0, 3.0), result(20.0, 1.0), result(20.0, 0.5)]  # two batches of two
    assert total_stats(static, batch_size=2).decode_time == pytest.approx(3.0 + 1.0)
    assert total_stats(static, batch_size=2).prefill_time == pytest.approx(0.5 + 0.5)
    inflight = [result(10.0, 4.0), result(10.0, 1.0), result(11.5, 4.0), result(30.0, 1.0)]  # a newcomer at 11.5
    total = total_stats(inflight, batch_size=2)
    assert total.prefill_time == pytest.approx(0.5 + 0.5 + 0.5)
    assert total.decode_time == pytest.approx(5.5 - 0.5 + 1.0)  # the newcomer's prefill (11.0-11.5) is no decode
    assert total.num_decode_tokens == 16
    assert covered([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (3.5, 3.7)]) == pytest.approx(3.0)
    assert covered([]) == 0.0
