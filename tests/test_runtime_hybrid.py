"""dflash-sa: suffix-automaton drafts where the committed sequence repeats itself, DFlash otherwise.

The suffix index, in Python and compiled, is checked against a brute-force longest match, and a batch's compiled
indexes against the Python ones; the hybrid is token-identical to
greedy `generate` on a random and the embedded pair with suffix and neural rows mixed in one batch, reaches tau = block_size on a
forced repeat, and leaves the drafter's context exactly as a fresh prefill would. With an adaptive
draft length (any K per step) DFlash and the hybrid stay token-identical.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpu_marks import needs_fbgemm
from trtllm_dflash.errors import InputError
from trtllm_dflash.models import linear
from trtllm_dflash.models.random_pair import drafter_config_for, random_drafter, random_target, tiny_target_config
from trtllm_dflash.models.target import GptOssTarget
from trtllm_dflash.runtime.draft_length import adaptive_draft_length, measure_step_costs
from trtllm_dflash.runtime.proposers import DFlashProposer, SuffixDFlashProposer
from trtllm_dflash.runtime.reference import ReferenceRuntime, prefill
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.runtime.suffix_index import KERNEL, SuffixIndex, SuffixIndexes


def brute_force_match(sequence: list[int]) -> int:
    """Longest L such that the last L tokens also occur ending before the last position."""
    n = len(sequence)
    for length in range(n - 1, 0, -1):
        suffix = sequence[n - length:]
        if any(sequence[end - length + 1: end + 1] == suffix for end in range(length - 1, n - 1)):
            return length
    return 0


def compiled_index():
    module = KERNEL.module()
    if module is None:
        pytest.skip(f"the compiled suffix index is unavailable: {KERNEL.unavailable_reason()}")
    return module.SuffixIndex()


INDEXES = {"python": SuffixIndex, "compiled": compiled_index}


@pytest.mark.parametrize("kind", INDEXES)
@settings(max_examples=300, deadline=None)
@given(sequence=st.lists(st.integers(0, 3), min_size=1, max_size=60), count=st.integers(1, 8))
def test_suffix_index_matches_brute_force(kind, sequence, count):
    index = INDEXES[kind]()
    for n, token in enumerate(sequence, start=1):
        index.extend([token])
        prefix = sequence[:n]
        length = index.match_length()
        assert length == brute_force_match(prefix)
        if length:
            end = index.match_end
            assert end < n - 1 and prefix[end - length + 1: end + 1] == prefix[n - length:]
            extended = prefix + index.continuation(count)
            # the drafts copy what followed the earlier occurrence, continuing through themselves
            assert extended[n:] == [extended[end + 1 + j] for j in range(count)]


@pytest.mark.parametrize("kind", INDEXES)
def test_suffix_index_prefers_a_recent_occurrence(kind):
    index = INDEXES[kind]()
    index.extend([5, 1, 2, 7, 1, 2, 8, 1, 2])
    assert index.match_length() == 2 and index.continuation(2) == [8, 1]
    index.extend([3, 9, 9, 9])
    assert index.match_length() == 2 and index.continuation(3) == [9, 9, 9]  # overlapping loop


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=40), min_size=1, max_size=4),
       growth=st.lists(st.integers(0, 3), min_size=1, max_size=5), count=st.integers(1, 6))
def test_compiled_indexes_answer_as_the_python_ones(rows, growth, count):
    """A batch's compiled indexes give the Python ones' match lengths, continuations and verify block while the
    histories grow by a few tokens a step and rows leave (`keep_rows`)."""
    if KERNEL.module() is None:
        pytest.skip(f"the compiled suffix index is unavailable: {KERNEL.unavailable_reason()}")
    compiled = SuffixIndexes(len(rows))
    with pytest.MonkeyPatch.context() as patch:  # the fallback, as where the module cannot be built
        patch.setattr(KERNEL, "module", lambda: None)
        python = SuffixIndexes(len(rows))
    assert python.module is None and compiled.module is not None
    history = [list(row) for row in rows]
    for step, extra in enumerate(growth):
        for i, row in enumerate(history):
            row.extend((row[(j + i) % len(row)] for j in range(extra)))  # repeats, so matches are common
        assert compiled.match(history) == python.match(history)
        assert torch.equal(compiled.verify_block(count), python.verify_block(count))
        assert [compiled.continuation(i, count) for i in range(len(history))] == \
            [python.continuation(i, count) for i in range(len(history))]
        if step == 1 and len(history) > 1:  # the first row leaves the batch
            compiled.keep_rows(list(range(1, len(history))))
            python.keep_rows(list(range(1, len(history))))
            history = history[1:]


def test_compiled_indexes_refuse_a_history_that_is_not_lists():
    if KERNEL.module() is None:
        pytest.skip(f"the compiled suffix index is unavailable: {KERNEL.unavailable_reason()}")
    indexes = SuffixIndexes(1)
    with pytest.raises(RuntimeError, match="list of token ids"):
        indexes.match([(1, 2, 3)])
    with pytest.raises(RuntimeError, match="one row per index"):
        indexes.match([[1], [2]])


class RecordingHybrid(SuffixDFlashProposer):
    """Keeps which rows took suffix drafts at every step, and how many drafts the step verified."""

    def __init__(self, dflash, threshold, max_suffix_drafts=None):
        super().__init__(dflash, threshold, max_suffix_drafts=max_suffix_drafts)
        self.steps: list[list[bool]] = []
        self.widths: list[int] = []

    def propose(self, *args):
        block, q = super().propose(*args)
        self.steps.append(list(self.suffix_rows))
        self.widths.append(block.shape[1] - 1)
        return block, q


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_hybrid_greedy_matches_generate_with_mixed_rows(random_pair, batch_size):
    target, drafter, prompts, expected = random_pair
    proposer = RecordingHybrid(DFlashProposer(drafter, target), threshold=2)
    runtime = ReferenceRuntime(target, proposer)
    results = runtime.generate(prompts, SamplingParams(max_tokens=24), batch_size=batch_size)
    assert [r.output_token_ids for r in results] == expected
    suffix_steps = sum(r.stats.suffix_steps for r in results)
    assert 0 < suffix_steps < sum(r.stats.steps for r in results)  # both sources were used
    if batch_size > 1:
        assert any(any(step) and not all(step) for step in proposer.steps), "no step mixed suffix and neural rows"


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_hybrid_on_the_embedded_pair_matches_generate(embedded_pair, batch_size):
    target, drafter, prompts, expected = embedded_pair
    proposer = RecordingHybrid(DFlashProposer(drafter, target), threshold=2)
    results = ReferenceRuntime(target, proposer).generate(prompts, SamplingParams(max_tokens=32), batch_size=batch_size)
    assert [r.output_token_ids for r in results] == expected
    assert 0 < sum(r.stats.suffix_steps for r in results) < sum(r.stats.steps for r in results)
    if batch_size > 1:
        assert any(any(step) and not all(step) for step in proposer.steps), "no step mixed suffix and neural rows"


def counting_pair(vocab: int = 16):
    """A target forced to count (next token = token + 1 mod vocab, whatever the context): a large
    one-hot embedding dominates the residual stream and the LM head reads it shifted by one."""
    config = tiny_target_config(vocab_size=vocab, hidden_size=64, eos_token_id=vocab - 1)
    hf = random_target(config, 41).float()
    with torch.no_grad():
        hf.model.embed_tokens.weight.zero_()
        hf.lm_head.weight.zero_()
        for token in range(vocab):
            hf.model.embed_tokens.weight[token, token] = 50.0
            hf.lm_head.weight[(token + 1) % vocab, token] = 50.0
    return GptOssTarget(hf), random_drafter(drafter_config_for(config, block_size=6), 42)


def test_a_forced_repeat_takes_suffix_drafts_and_reaches_block_size():
    target, drafter = counting_pair()
    prompt = list(range(16)) + list(range(4))  # one full cycle, then the loop resumes
    params = SamplingParams(max_tokens=40)
    expected = [(4 + i) % 16 for i in range(40)]
    hybrid = ReferenceRuntime(target, SuffixDFlashProposer(DFlashProposer(drafter, target), threshold=2))
    (result,) = hybrid.generate([prompt], params)
    assert result.output_token_ids == expected
    assert result.stats.suffix_steps == result.stats.steps
    assert result.stats.accepted_per_step[:-1] == [5] * (result.stats.steps - 1)  # every draft kept: tau = 6
    (plain,) = ReferenceRuntime(target, DFlashProposer(drafter, target)).generate([prompt], params)
    assert plain.output_token_ids == expected and plain.stats.acceptance_length < 2  # the random drafter can't
    # next to a request without a repeat yet (neural drafts until it wraps around): still every draft kept
    looping, fresh = hybrid.generate([prompt, [0]], params, batch_size=2)
    assert looping.output_token_ids == expected and fresh.output_token_ids == [(1 + i) % 16 for i in range(40)]
    assert looping.stats.accepted_per_step[:-1] == [5] * (looping.stats.steps - 1)
    assert 0 < fresh.stats.suffix_steps < fresh.stats.steps


def test_suffix_drafts_run_past_the_drafters_block():
    """max_suffix_drafts = 11 with a block of 6: a forced repeat's steps keep all 11 suffix drafts (tau 12), a
    neighbour without a repeat drafts at most the block's 5 drafts on drafter steps, and both stay exact."""
    target, drafter = counting_pair()
    prompt = list(range(16)) + list(range(4))
    params = SamplingParams(max_tokens=40)
    hybrid = SuffixDFlashProposer(DFlashProposer(drafter, target), threshold=2, max_suffix_drafts=11)
    assert hybrid.num_drafts == 11
    (result,) = ReferenceRuntime(target, hybrid).generate([prompt], params)
    assert result.output_token_ids == [(4 + i) % 16 for i in range(40)]
    assert result.stats.accepted_per_step[:-1] == [11] * (result.stats.steps - 1)
    recording = RecordingHybrid(DFlashProposer(drafter, target), threshold=2, max_suffix_drafts=11)
    looping, fresh = ReferenceRuntime(target, recording).generate([prompt, [0]], params, batch_size=2)
    assert looping.output_token_ids == result.output_token_ids
    assert fresh.output_token_ids == [(1 + i) % 16 for i in range(40)]
    widths = [(all(rows), width) for rows, width in zip(recording.steps, recording.widths)]
    assert {w for every, w in widths if not every} == {5}  # the drafter ran: its block bounds the step
    assert max(w for every, w in widths if every) == 11


@pytest.mark.parametrize("batch_size", [1, 3])
def test_long_suffix_drafts_stay_token_identical(random_pair, batch_size):
    """Fixed and adaptive (per-source rows of different lengths) with suffix drafts up to 9 past a block of 4."""
    target, drafter, prompts, expected = random_pair
    costs = {"neural": [1.0, 1.1, 1.2, 1.3], "suffix": [1.0 + 0.05 * k for k in range(10)]}
    policy = adaptive_draft_length(costs)
    for proposer in (SuffixDFlashProposer(DFlashProposer(drafter, target), 2, max_suffix_drafts=9),
                     SuffixDFlashProposer(DFlashProposer(drafter, target), 2, policy=policy, max_suffix_drafts=9)):
        results = ReferenceRuntime(target, proposer).generate(prompts, SamplingParams(max_tokens=24), batch_size)
        assert [r.output_token_ids for r in results] == expected
    assert max(policy.chosen["suffix"]) > 3 >= max(policy.chosen["neural"])


def test_a_suffix_draft_limit_short_of_the_block_is_refused(random_pair):
    target, drafter, _, _ = random_pair  # a block of 4: 3 drafts
    with pytest.raises(InputError, match="max_suffix_drafts"):
        SuffixDFlashProposer(DFlashProposer(drafter, target), max_suffix_drafts=2)
    assert SuffixDFlashProposer(DFlashProposer(drafter, target), max_suffix_drafts=3).num_drafts == 3


class ScriptedHybrid(SuffixDFlashProposer):
    """Suffix drafts (whatever the match) for the first `suffix_steps` steps, the drafter afterwards;
    records the drafter's distributions and the committed sequence at the first neural step, and
    whether the draft cache covered positions [0, anchor) after every suffix-only step (it must not:
    their context waits for the drafter's step) and after the first neural one (it must: the
    invariant DFlashProposer documents for its own steps)."""

    def __init__(self, dflash, suffix_steps):
        super().__init__(dflash, threshold=1)
        self.remaining, self.seen, self.context_current = suffix_steps, None, []

    def match(self, history):
        lengths = super().match(history)
        self.remaining -= 1
        self.match_lengths = [self.threshold if self.remaining >= 0 else 0] * len(lengths)
        return self.match_lengths

    def suffix_drafts(self, count):
        return [index.continuation(count) if index.match_length() else [0] * count for index in self.indexes.indexes]

    def propose(self, anchors, anchor_positions, history, num_drafts, params, generator):
        block, q = super().propose(anchors, anchor_positions, history, num_drafts, params, generator)
        if all(self.suffix_rows):
            self.context_current.append(bool((self.dflash.context_lens == anchor_positions).all()))
        if self.seen is None and not any(self.suffix_rows):
            self.seen = ([list(h) for h in history], anchor_positions.clone(), q)
            self.context_current.append(bool((self.dflash.context_lens == anchor_positions).all()))
        return block, q


def test_drafter_context_is_complete_after_suffix_only_steps(random_pair):
    """After 5 suffix-only steps, the drafter's distributions equal those of a fresh DFlash
    proposer whose context is the prefill of the whole committed sequence."""
    target, drafter, prompts, _ = random_pair
    params = SamplingParams(max_tokens=30, temperature=1.0)
    scripted = ScriptedHybrid(DFlashProposer(drafter, target), suffix_steps=5)
    ReferenceRuntime(target, scripted).generate(prompts[:3], params, batch_size=3)
    # the first step's context is the prompts' (written at start); the next four steps' commits wait for the
    # drafter's step, which writes them all
    assert scripted.context_current == [True] + [False] * 4 + [True]
    history, positions, q = scripted.seen
    assert (positions >= torch.tensor([len(p) for p in prompts[:3]]) + 5).all()  # the steps committed tokens
    fresh = DFlashProposer(drafter, target)
    with torch.inference_mode():
        context = [h[:-1] for h in history]  # the anchor reaches the drafter as the block's first token
        capacity = max(map(len, history)) + 8
        _, _, features, lens = prefill(target, context, fresh.feature_layers, capacity)
        fresh.start(features, lens, capacity)
        anchors = torch.tensor([h[-1] for h in history])
        _, q_fresh = fresh.propose(anchors, positions, history, scripted.num_drafts, params,
                                   torch.Generator().manual_seed(0))
    assert torch.allclose(q, q_fresh, atol=1e-5)


def test_threshold_below_one_is_refused(random_pair):
    target, drafter, _, _ = random_pair
    with pytest.raises(InputError, match="sa_threshold"):
        SuffixDFlashProposer(DFlashProposer(drafter, target), threshold=0)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_adaptive_draft_length_stays_token_identical(random_pair, batch_size):
    target, drafter, prompts, expected = random_pair
    costs = {"neural": [1.0, 1.1, 1.2, 1.3], "suffix": [1.0, 1.1, 1.2, 1.3]}
    params = SamplingParams(max_tokens=24)
    plain_policy, hybrid_policy = adaptive_draft_length(costs), adaptive_draft_length(costs)
    plain = ReferenceRuntime(target, DFlashProposer(drafter, target, policy=plain_policy))
    hybrid = ReferenceRuntime(target, SuffixDFlashProposer(DFlashProposer(drafter, target), 2, policy=hybrid_policy))
    for runtime in (plain, hybrid):
        results = runtime.generate(prompts, params, batch_size=batch_size)
        assert [r.output_token_ids for r in results] == expected
    chosen = plain_policy.chosen["neural"] + hybrid_policy.chosen["neural"] + hybrid_policy.chosen["suffix"]
    assert len(set(chosen)) > 1, "the policy never changed K: the test would not exercise a varying block"
    assert 0 in chosen, "no autoregressive step: the test would not exercise K = 0"


@pytest.mark.parametrize("batch_size", [3, 8])
def test_context_queued_over_steps_without_drafts_survives_rows_leaving(random_pair, batch_size):
    """Mostly K = 0: committed features queue up between drafts while rows finish at different steps
    (and leave the batch); drafting after that must still be lossless and the drafter's context exact."""
    target, drafter, prompts, expected = random_pair
    policy = adaptive_draft_length({"neural": [1.0, 2.0, 2.1, 2.2], "suffix": [1.0, 1.1, 1.2, 1.3]}, explore_every=3,
                                 explore_share=1.0)
    proposer = SuffixDFlashProposer(DFlashProposer(drafter, target), 2, policy=policy)
    results = ReferenceRuntime(target, proposer).generate(prompts, SamplingParams(max_tokens=24), batch_size=batch_size)
    assert [r.output_token_ids for r in results] == expected
    assert 0 in policy.chosen["neural"] and any(policy.chosen["neural"])
    assert len({r.stats.steps for r in results}) > 1, "rows must finish at different steps"
    assert 0 < sum(r.stats.draftless_steps for r in results) < sum(r.stats.steps for r in results)


def test_pack_ragged_keeps_each_rows_entries_in_order():
    """Chunks of ragged rows (entries 0..last[i] of row i valid: a verify's num_accepted) pack left-aligned per row,
    padded with zeros to the longest; a single chunk is cut to its longest row."""
    from trtllm_dflash.runtime.proposers import pack_ragged

    first = torch.tensor([[[1.0], [2.0], [9.0]], [[3.0], [9.0], [9.0]]])  # row 0 keeps 2, row 1 keeps 1
    second = torch.tensor([[[4.0], [9.0]], [[5.0], [6.0]]])  # row 0 keeps 1, row 1 keeps 2
    out, lens = pack_ragged([(first, torch.tensor([1, 0])), (second, torch.tensor([0, 1]))])
    assert lens.tolist() == [3, 3] and out[..., 0].tolist() == [[1.0, 2.0, 4.0], [3.0, 5.0, 6.0]]
    out, lens = pack_ragged([(first, torch.tensor([1, -1])), (second, torch.tensor([-1, 0]))])  # -1: none kept
    assert lens.tolist() == [2, 1] and out[..., 0].tolist() == [[1.0, 2.0], [5.0, 0.0]]
    out, lens = pack_ragged([(first, torch.tensor([1, 0]))])
    assert lens.tolist() == [2, 1] and out.shape == (2, 2, 1)


def test_adaptive_steps_without_drafts_also_sample(random_pair):
    """K = 0 under rejection sampling: the step samples the target's token and the run completes,
    reproducibly, with the drafter's context caught up at its next draft."""
    target, drafter, prompts, _ = random_pair
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=3)
    costs = {"neural": [1.0, 2.0, 2.1, 2.2], "suffix": [1.0, 1.1, 1.2, 1.3]}  # drafting rarely pays
    outputs = []
    for _ in range(2):
        policy = adaptive_draft_length(costs)
        runtime = ReferenceRuntime(target, SuffixDFlashProposer(DFlashProposer(drafter, target), 2, policy=policy))
        outputs.append([r.output_token_ids for r in runtime.generate(prompts, params, batch_size=3)])
        assert 0 in policy.chosen["neural"] and any(policy.chosen["neural"])
    assert outputs[0] == outputs[1] and all(len(o) == 20 for o in outputs[0])


@pytest.mark.parametrize("suffix_most", [None, 6])
def test_measured_step_costs_cover_every_draft_length(random_pair, suffix_most):
    target, drafter, _, _ = random_pair
    costs = measure_step_costs(target, lambda: DFlashProposer(drafter, target), batch=2, most=3, context=20, rounds=2,
                               suffix_most=suffix_most)
    assert set(costs) == {"neural", "suffix"}
    assert len(costs["neural"]) == 4 and len(costs["suffix"]) == (suffix_most or 3) + 1
    for row in costs.values():
        assert all(c > 0 for c in row) and row == sorted(row)
    assert all(n >= s for n, s in zip(costs["neural"][1:], costs["suffix"][1:]))  # suffix steps skip the drafter


def test_the_hybrid_refuses_a_policy_on_its_dflash_proposer(random_pair):
    target, drafter, _, _ = random_pair
    policy = adaptive_draft_length({"neural": [1.0, 1.0], "suffix": [1.0, 1.0]})
    with pytest.raises(ValueError, match="hybrid proposer only"):
        SuffixDFlashProposer(DFlashProposer(drafter, target, policy=policy), 2, policy=policy)


@pytest.mark.parametrize("narrow", [
    torch.bfloat16,
    pytest.param(torch.float16, marks=needs_fbgemm)])
def test_narrower_drafter_gemms_stay_token_identical_and_close(random_pair, monkeypatch, narrow):
    """With the drafter step's GEMMs in bf16 or (fbgemm, float16 weights) float16 (`matmul_dtype`), its
    hidden states and draft logits differ from the float32 ones by that rounding only, and DFlash and the
    hybrid stay token-identical to generate. (The random pair's GEMMs are all small, which a narrower
    dtype would not serve: every one is narrowed here.)"""
    target, drafter, prompts, expected = random_pair
    # the random pair's LM head is small: bf16 serves it only where oneDNN packs it; else fbgemm's float16 does
    # where it runs, from a copy of its own (the target's random float32 head does not fit float16); else the
    # target's own head serves
    head = DFlashProposer(drafter, target, matmul_dtype=narrow).head
    if narrow == torch.bfloat16 and linear.onednn_packs(narrow, target.device):
        assert head is not None and head.dtype == torch.bfloat16
    else:
        assert (head is None) == (not linear.fbgemm_fp16()) and (head is None or head.dtype == torch.float16)
    monkeypatch.setattr(linear, "NARROW_MIN_WEIGHTS", 0)
    monkeypatch.setattr(linear, "NARROW_MIN_ROWS", 0)
    monkeypatch.setattr(drafter, "_fused", None)  # fused weights built under the default rule
    params = SamplingParams(max_tokens=24)
    fast = DFlashProposer(drafter, target, matmul_dtype=narrow)
    for proposer in (fast, SuffixDFlashProposer(DFlashProposer(drafter, target, matmul_dtype=narrow), 2)):
        results = ReferenceRuntime(target, proposer).generate(prompts, params, batch_size=3)
        assert [r.output_token_ids for r in results] == expected
    cfg = drafter.config
    features = torch.randn(2, 9, len(cfg.target_layer_ids) * cfg.hidden_size)
    block = torch.randn(2, cfg.block_size, cfg.hidden_size)
    positions = 9 + torch.arange(cfg.block_size).expand(2, -1)
    hidden = {}
    for dtype in (None, narrow):
        cache = drafter.new_cache(2, 9 + cfg.block_size)
        drafter.write_context(features, torch.arange(9).expand(2, -1), cache, dtype)
        hidden[dtype] = drafter(block, positions, cache, torch.tensor([9, 9]), dtype)
    assert hidden[narrow].dtype == torch.float32
    assert not torch.equal(hidden[narrow], hidden[None])
    torch.testing.assert_close(hidden[narrow], hidden[None], rtol=0.05, atol=0.05)
    exact = DFlashProposer(drafter, target).draft_logits(hidden[None])
    rounded = fast.draft_logits(hidden[None])
    assert rounded.dtype == torch.float32 and rounded.shape == exact.shape
    assert not torch.equal(rounded, exact) and torch.allclose(rounded, exact, rtol=0.05, atol=0.05)
