"""Greedy speculative decoding is token-identical to the target's own greedy decoding."""

from __future__ import annotations

import pytest
import torch

from trtllm_dflash.models.random_pair import drafter_config_for, random_drafter, random_target, tiny_target_config
from trtllm_dflash.models.target import GptOssTarget
from trtllm_dflash.plugins.draft_block.cpu import dot_kernel
from trtllm_dflash.runtime.proposers import DFlashProposer, NGramProposer
from trtllm_dflash.runtime.reference import ReferenceRuntime
from trtllm_dflash.runtime.sampling import SamplingParams

MAX_TOKENS = 24

PAIRS = {
    # 4 layers, window 8, block 4, features from layers 1 and 2
    "w8-b4": (dict(), dict(block_size=4, num_layers=1), 11),
    # 6 layers, window 4 (prompts far longer than the window), block 6, 2-layer drafter, 3 features
    "w4-b6": (dict(num_layers=6, sliding_window=4, experts=8, top_k=3),
              dict(block_size=6, num_layers=2, target_layer_ids=[0, 3, 4]), 12),
    # a vocabulary of 17 x 16 words: the target's exact greedy head runs where the int8 dot GEMM does
    "w8-b4-v272": (dict(vocab_size=272), dict(block_size=4, num_layers=1), 13),
}


@pytest.fixture(scope="module", params=sorted(PAIRS))
def setup(request):
    target_kw, drafter_kw, seed = PAIRS[request.param]
    config = tiny_target_config(**target_kw)
    hf = random_target(config, seed).float()
    target = GptOssTarget(hf)
    drafter = random_drafter(drafter_config_for(config, **drafter_kw), seed + 1)
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (50,), generator=gen).tolist()
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    with torch.no_grad():
        # An explicit attention mask: otherwise generate() treats prompt tokens equal to the pad id as padding.
        expected = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                pad_token_id=config.pad_token_id)[0, len(p):].tolist() for p in prompts]
    return target, drafter, prompts, expected


@pytest.mark.parametrize("inflight", [False, True], ids=["static", "inflight"])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_speculative_greedy_matches_transformers_generate(setup, batch_size, inflight):
    target, drafter, prompts, expected = setup
    runtime = ReferenceRuntime(target, DFlashProposer(drafter, target), inflight=inflight)
    results = runtime.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), batch_size=batch_size)
    mismatches = [i for i, (r, e) in enumerate(zip(results, expected)) if r.output_token_ids != e]
    assert not mismatches, f"{len(mismatches)} of {len(prompts)} prompts differ, first: {mismatches[0]}"
    assert all(r.finish_reason == "length" for r in results)


def test_the_exact_greedy_head_serves_where_the_int8_gemm_takes_the_head(setup):
    target = setup[0]
    int8 = dot_kernel(torch.int8)
    takes = target.vocab_size % 16 == 0 and int8 is not None
    assert (target.greedy_head is not None) == takes


def test_autoregressive_baseline_matches_transformers_generate(setup):
    target, _, prompts, expected = setup
    results = ReferenceRuntime(target, None).generate(prompts[:12], SamplingParams(max_tokens=MAX_TOKENS), batch_size=5)
    assert [r.output_token_ids for r in results] == expected[:12]
    assert all(r.stats.acceptance_length == 1.0 for r in results)


def test_stop_token_ends_request_and_is_kept(setup):
    target, drafter, prompts, expected = setup
    # Stop on the token each reference output emits at index 5: output ends right there.
    row = next(i for i, e in enumerate(expected) if e[5] not in e[:5])
    stop = expected[row][5]
    results = ReferenceRuntime(target, DFlashProposer(drafter, target)).generate(
        [prompts[row]], SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(stop,)))
    assert results[0].output_token_ids == expected[row][:6]
    assert results[0].finish_reason == "stop"


def test_block_size_smaller_than_trained(setup):
    target, drafter, prompts, expected = setup
    runtime = ReferenceRuntime(target, DFlashProposer(drafter, target, block_size=2))
    results = runtime.generate(prompts[:8], SamplingParams(max_tokens=MAX_TOKENS), batch_size=4)
    assert [r.output_token_ids for r in results] == expected[:8]
    assert all(len(r.stats.accepted_histogram) == 2 for r in results)


def test_ngram_proposer_is_lossless_and_accepts_on_repetition(setup):
    target, _, prompts, expected = setup
    runtime = ReferenceRuntime(target, NGramProposer(num_drafts=3))
    results = runtime.generate(prompts[:10], SamplingParams(max_tokens=MAX_TOKENS), batch_size=4)
    assert [r.output_token_ids for r in results] == expected[:10]
    # Random targets fall into loops, which prompt lookup predicts: some drafts must be accepted.
    assert sum(sum(r.stats.accepted_histogram[1:]) for r in results) > 0


def test_ngram_lookup_rules():
    proposer = NGramProposer(num_drafts=3, max_ngram=2)
    assert proposer.lookup([1, 2, 3, 9, 2, 3], 3) == [9, 2, 3]  # longest match "2 3" -> what followed it
    assert proposer.lookup([5, 6, 7, 5], 3) == [6, 7, 5]
    assert proposer.lookup([4, 8, 1], 3) == [1, 1, 1]  # no match: repeat the last token
    assert proposer.lookup([7, 7], 3) == [7, 7, 7]  # a short tail is padded with its last token


def test_draft_length_schedule_follows_live_batch_size(setup):
    """Schedule {2: 3, 4: 1}: 3 drafts while at most 2 requests are live, 1 up to 4, none above."""
    from trtllm_dflash.runtime.reference import draft_length

    assert [draft_length({2: 3, 4: 1}, b, 5) for b in (1, 2, 3, 4, 5)] == [3, 3, 1, 1, 0]
    assert draft_length(None, 9, 5) == 5
    target, drafter, prompts, expected = setup
    runtime = ReferenceRuntime(target, DFlashProposer(drafter, target), draft_len_schedule={2: 3, 4: 1})
    results = runtime.generate(prompts[:12], SamplingParams(max_tokens=MAX_TOKENS), batch_size=6)
    assert [r.output_token_ids for r in results] == expected[:12]  # lossless whatever the draft length
