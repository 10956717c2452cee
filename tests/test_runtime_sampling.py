"""Speculative sampling is lossless: its samples follow the target's own sampling distribution.

On a vocabulary of 8 tokens the exact distribution of the 2nd and 3rd output tokens (64 cells,
first token marginalised) is computed by enumeration from the target with the same temperature /
top-k / top-p filter; 8,000 speculative samples are compared with a chi-square test at a fixed seed
and significance 0.001. The same test must reject a deliberately lossy acceptance rule.
"""

from __future__ import annotations


import pytest
import torch

import trtllm_dflash.runtime.reference as reference
from cpu_marks import needs_fbgemm
from trtllm_dflash.models import linear
from trtllm_dflash.models.random_pair import drafter_config_for, random_drafter, random_target, tiny_target_config
from trtllm_dflash.models.target import GptOssTarget
from trtllm_dflash.runtime.accept import rejection_accept
from trtllm_dflash.runtime.draft_length import adaptive_draft_length
from trtllm_dflash.runtime.proposers import DFlashProposer, SuffixDFlashProposer
from trtllm_dflash.runtime.reference import ReferenceRuntime
from trtllm_dflash.runtime.sampling import SamplingParams, probabilities

VOCAB = 8
PROMPT = [1, 2, 3]
ALPHA = 1e-3
SAMPLES_PER_SEED, SEEDS = 1000, 8


@pytest.fixture(scope="module")
def pair():
    config = tiny_target_config(vocab_size=VOCAB, eos_token_id=VOCAB - 1, initializer_range=0.1)
    hf = random_target(config, 21).float()
    drafter = random_drafter(drafter_config_for(config, block_size=4), 22)
    return hf, GptOssTarget(hf), drafter


def exact_joint(hf, params) -> torch.Tensor:
    """P(t2, t3) = sum_t1 p(t1) p(t2 | t1) p(t3 | t1, t2), with the sampling filter applied."""
    def next_probs(prefix):
        with torch.no_grad():
            return probabilities(hf(torch.tensor([PROMPT + prefix])).logits[0, -1], params).double()
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    p1 = next_probs([])
    for t1 in range(VOCAB):
        p2 = next_probs([t1])
        for t2 in range(VOCAB):
            joint[t2] += p1[t1] * p2[t2] * next_probs([t1, t2])
    return joint


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square; cells with expected count < 5 are pooled into one."""
    counts, probs = counts.flatten().double(), probs.flatten()
    expected = probs * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


def speculative_counts(target, drafter, params_for_seed, proposer=None,
                       inflight_batch: int | None = None) -> tuple[torch.Tensor, list[int], int]:
    """-> (counts of (t2, t3), acceptance histogram, steps whose drafts came from the suffix index). With
    `inflight_batch`, in-flight batches of that many rows instead of one static batch of all samples."""
    counts = torch.zeros(VOCAB, VOCAB)
    histogram, suffix_steps = [0] * 16, 0  # wide enough for any block here (zip stops at the request's)
    runtime = ReferenceRuntime(target, proposer or DFlashProposer(drafter, target), inflight=inflight_batch is not None)
    for seed in range(SEEDS):
        results = runtime.generate([PROMPT] * SAMPLES_PER_SEED, params_for_seed(seed),
                                   batch_size=inflight_batch or SAMPLES_PER_SEED)
        for result in results:
            counts[result.output_token_ids[1], result.output_token_ids[2]] += 1
            histogram[: len(result.stats.accepted_histogram)] = [
                h + n for h, n in zip(histogram, result.stats.accepted_histogram)]
            suffix_steps += result.stats.suffix_steps
    return counts, histogram, suffix_steps


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.7, 0.9, 0), (1.0, 0.8, 6)])
def test_speculative_samples_follow_target_distribution(pair, temperature, top_p, top_k):
    hf, target, drafter = pair
    def params(seed):
        return SamplingParams(max_tokens=3, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    counts, histogram, _ = speculative_counts(target, drafter, params)
    assert histogram[0] > 0 and sum(histogram[1:]) > 0, "both acceptance and rejection must be exercised"
    p_value = chi_square_p_value(counts, exact_joint(hf, params(0)))
    assert p_value > ALPHA, f"speculative samples deviate from the target distribution (p = {p_value:.2e})"


@pytest.mark.parametrize("max_suffix_drafts", [None, 7])
def test_hybrid_samples_follow_target_distribution(pair, max_suffix_drafts):
    """dflash-sa at T=0.7: with threshold 1 a first token that repeats a prompt token takes suffix
    drafts (one-hot q) and any other takes the drafter's, in the same batch; also with suffix drafts
    past the drafter's block of 4."""
    hf, target, drafter = pair
    def params(seed):
        return SamplingParams(max_tokens=3, temperature=0.7, seed=seed)
    hybrid = SuffixDFlashProposer(DFlashProposer(drafter, target), threshold=1, max_suffix_drafts=max_suffix_drafts)
    counts, histogram, suffix_steps = speculative_counts(target, drafter, params, hybrid)
    assert 0 < suffix_steps < sum(histogram), "both suffix and drafter steps must be exercised"
    assert histogram[0] > 0 and sum(histogram[1:]) > 0, "both acceptance and rejection must be exercised"
    p_value = chi_square_p_value(counts, exact_joint(hf, params(0)))
    assert p_value > ALPHA, f"dflash-sa samples deviate from the target distribution (p = {p_value:.2e})"


def test_inflight_batching_samples_follow_target_distribution(pair):
    """dflash-sa at T=0.7 in in-flight batches of 40 rows: requests accept different numbers of drafts, so they finish
    at different steps and newcomers are prefilled into their rows while the others decode, all on one random
    stream."""
    hf, target, drafter = pair
    def params(seed):
        return SamplingParams(max_tokens=3, temperature=0.7, seed=seed)
    hybrid = SuffixDFlashProposer(DFlashProposer(drafter, target), threshold=1)
    counts, histogram, suffix_steps = speculative_counts(target, drafter, params, hybrid, inflight_batch=40)
    assert 0 < suffix_steps < sum(histogram), "both suffix and drafter steps must be exercised"
    assert histogram[0] > 0 and sum(histogram[1:]) > 0, "both acceptance and rejection must be exercised"
    p_value = chi_square_p_value(counts, exact_joint(hf, params(0)))
    assert p_value > ALPHA, f"in-flight samples deviate from the target distribution (p = {p_value:.2e})"


@pytest.mark.parametrize("neural_costs,narrow", [
    ([1.0, 1.1, 1.2, 1.3], torch.bfloat16), ([1.0, 2.0, 2.1, 2.2], torch.bfloat16),
    pytest.param([1.0, 1.1, 1.2, 1.3], torch.float16,
                 marks=needs_fbgemm)])
def test_adaptive_draft_length_with_narrower_drafter_gemms_samples_follow_target_distribution(
        pair, neural_costs, narrow, monkeypatch):
    """dflash-sa at T=0.7 with a K chosen per step from past acceptance and the draft distribution q
    from a drafter whose GEMMs (LM head included; all of them, small as they are) run in bf16 or
    float16: still the target's distribution. Where drafting rarely pays (second cost table) the
    policy takes steps without drafts (K = 0) between its drafts."""
    hf, target, drafter = pair
    monkeypatch.setattr(linear, "NARROW_MIN_WEIGHTS", 0)
    monkeypatch.setattr(linear, "NARROW_MIN_ROWS", 0)
    monkeypatch.setattr(drafter, "_fused", None)
    def params(seed):
        return SamplingParams(max_tokens=3, temperature=0.7, seed=seed)
    # explore_share 1: a costly draft is still refreshed every 8 idle steps, so both kinds of step occur
    policy = adaptive_draft_length({"neural": neural_costs, "suffix": [1.0, 1.1, 1.2, 1.3]}, explore_share=1.0)
    hybrid = SuffixDFlashProposer(DFlashProposer(drafter, target, matmul_dtype=narrow), threshold=1, policy=policy)
    counts, histogram, _ = speculative_counts(target, drafter, params, hybrid)
    if neural_costs[1] >= 2:
        assert 0 in policy.chosen["neural"] and any(policy.chosen["neural"])
    assert histogram[0] > 0 and sum(histogram[1:]) > 0, "both acceptance and rejection must be exercised"
    p_value = chi_square_p_value(counts, exact_joint(hf, params(0)))
    assert p_value > ALPHA, f"adaptive-K samples deviate from the target distribution (p = {p_value:.2e})"


def test_confidence_truncated_blocks_sample_the_target_distribution(pair):
    """DFlash alone at T=0.7 with the adaptive policy: every drafter step drafts the whole block and
    verifies as many drafts as their distributions' peaks pay for (costs under which the K verified
    varies as the calibration learns); the samples still follow the target's distribution."""
    hf, target, drafter = pair
    def params(seed):
        return SamplingParams(max_tokens=3, temperature=0.7, seed=seed)
    policy = adaptive_draft_length({"neural": [1.0, 1.3, 1.5, 1.7], "suffix": [1.0, 1.1, 1.2, 1.3]}, least=1)
    counts, histogram, _ = speculative_counts(target, drafter, params, DFlashProposer(drafter, target, policy=policy))
    assert len(set(policy.chosen["neural"])) > 1, "the truncation never changed K: the test would not exercise it"
    assert histogram[0] > 0 and sum(histogram[1:]) > 0, "both acceptance and rejection must be exercised"
    p_value = chi_square_p_value(counts, exact_joint(hf, params(0)))
    assert p_value > ALPHA, f"truncated-block samples deviate from the target distribution (p = {p_value:.2e})"


def test_the_test_rejects_a_lossy_rule(pair, monkeypatch):
    """Accepting every draft (uniforms forced to 0) is lossy; the chi-square test must notice."""
    hf, target, drafter = pair
    monkeypatch.setattr(reference, "rejection_accept",
                        lambda d, q, p, u: rejection_accept(d, q, p, torch.cat([torch.zeros_like(u[:, :-1]), u[:, -1:]], 1)))
    def params(seed):
        return SamplingParams(max_tokens=3, temperature=1.0, top_p=0.8, top_k=6, seed=seed)
    counts, _, _ = speculative_counts(target, drafter, params)
    assert chi_square_p_value(counts, exact_joint(hf, params(0))) < ALPHA


def test_sampling_is_reproducible(pair):
    _, target, drafter = pair
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7)
    runtime = ReferenceRuntime(target, DFlashProposer(drafter, target))
    first = [r.output_token_ids for r in runtime.generate([PROMPT, PROMPT[:2]], params, batch_size=2)]
    again = [r.output_token_ids for r in runtime.generate([PROMPT, PROMPT[:2]], params, batch_size=2)]
    assert first == again


def test_exact_joint_is_a_distribution(pair):
    hf, _, _ = pair
    joint = exact_joint(hf, SamplingParams(temperature=0.7, top_p=0.9))
    assert torch.isclose(joint.sum(), torch.tensor(1.0, dtype=torch.float64))
    assert not all(torch.isclose(joint.flatten(), joint.flatten()[:1]).tolist())  # not uniform: the test has power


def test_a_block_without_drafts_samples_the_bonus_from_the_target():
    """K = 0 (a draft-length schedule's 0, or the adaptive policy's): no draft to judge; the step's
    token is drawn from the target's distribution with the step's uniform."""
    from trtllm_dflash.runtime.accept import sample_from_probs

    p = torch.softmax(torch.randn(2, 1, VOCAB), dim=-1)
    u = torch.tensor([[0.3], [0.9]])
    drafts = torch.zeros(2, 0, dtype=torch.long)
    accepted, bonus = rejection_accept(drafts, torch.zeros(2, 0, VOCAB), p, u)
    assert accepted.tolist() == [0, 0] and torch.equal(bonus, sample_from_probs(p[:, 0], u[:, 0]))
