"""In-flight batching in the reference runtime: a finished request's row goes to the next prompt at the next step.

Newcomers are prefilled and take finished requests' rows (or rows appended after the batch); every proposer stays
token-identical to transformers' greedy `generate`, also when prompts arrive through `admit` mid-run and when a longer
one grows the arenas; a joined row's drafter context is exactly a fresh prefill's; the K/V arena places and grows rows
as it says. (Sampling under in-flight batching: tests/test_runtime_sampling.py.)
"""

from __future__ import annotations

import pytest
import torch

from trtllm_dflash.models.kv_cache import KVArena
from trtllm_dflash.runtime.draft_length import adaptive_draft_length
from trtllm_dflash.runtime.proposers import DFlashProposer, NGramProposer, SuffixDFlashProposer
from trtllm_dflash.runtime.reference import ReferenceRuntime, prefill
from trtllm_dflash.runtime.sampling import SamplingParams

COSTS = {"neural": [1.0, 1.1, 1.2, 1.3], "suffix": [1.0, 1.1, 1.2, 1.3]}

PROPOSERS = {
    "autoregressive": lambda target, drafter: None,
    "dflash": lambda target, drafter: DFlashProposer(drafter, target),
    "ngram": lambda target, drafter: NGramProposer(num_drafts=3),
    "dflash-sa-adaptive": lambda target, drafter: SuffixDFlashProposer(
        DFlashProposer(drafter, target), 2, policy=adaptive_draft_length(COSTS), max_suffix_drafts=7),
}


class PlacementLog:
    """Wraps `KVArena.place` and `keep_rows`: every placement's slots against the batch it went into, and the widest
    batch an arena held."""

    def __init__(self, monkeypatch):
        self.placed: list[tuple[list[int], int]] = []
        self.widest = 0
        place, keep = KVArena.place, KVArena.keep_rows

        def logged_place(arena, slots, other):
            self.placed.append((list(slots), arena.keys.shape[1]))
            place(arena, slots, other)
            self.widest = max(self.widest, arena.keys.shape[1])

        def logged_keep(arena, rows):
            keep(arena, rows)
            self.widest = max(self.widest, arena.keys.shape[1])

        monkeypatch.setattr(KVArena, "place", logged_place)
        monkeypatch.setattr(KVArena, "keep_rows", logged_keep)

    @property
    def reused(self) -> int:
        return sum(slot < batch for slots, batch in self.placed for slot in slots)


@pytest.mark.parametrize("method", PROPOSERS)
@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_inflight_batching_matches_generate(random_pair, method, batch_size, monkeypatch):
    target, drafter, prompts, expected = random_pair
    log = PlacementLog(monkeypatch)
    # stop ids the greedy outputs hit at different steps, some at their first token: rows free mid-batch, and some
    # newcomers finish as they join
    stops = (6, 15)
    runtime = ReferenceRuntime(target, PROPOSERS[method](target, drafter), inflight=True)
    results = runtime.generate(prompts, SamplingParams(max_tokens=24, stop_token_ids=stops), batch_size=batch_size)
    for result, want in zip(results, expected):
        end = next((i for i, token in enumerate(want) if token in stops), None)
        assert result.output_token_ids == (want if end is None else want[: end + 1])
        assert result.finish_reason == ("length" if end is None else "stop")
    assert sum(r.finish_reason == "stop" and len(r.output_token_ids) == 1 for r in results) >= 3
    assert len(results) == len(prompts)
    if batch_size > 1:  # a lone request's successor starts afresh
        assert log.reused, "no newcomer took a finished request's row"
    assert log.widest <= batch_size


@pytest.mark.parametrize("batch_size", [3, 8])
def test_inflight_batching_on_the_embedded_pair_matches_generate(embedded_pair, batch_size):
    """The embedded pair runs the compiled drafter step (`WholeDraftStep`), whose context write a newcomer's prompt
    goes through, and the compiled suffix index; the default's adaptive draft length."""
    target, drafter, prompts, expected = embedded_pair
    proposer = SuffixDFlashProposer(DFlashProposer(drafter, target), 2, policy=adaptive_draft_length(COSTS),
                                    max_suffix_drafts=15)
    runtime = ReferenceRuntime(target, proposer, inflight=True)
    # max_tokens differ per request only through the prompts' lengths; half the prompts cut short so rows free early
    results = runtime.generate(prompts, SamplingParams(max_tokens=32), batch_size=batch_size)
    assert [r.output_token_ids for r in results] == expected
    assert 0 < sum(r.stats.suffix_steps for r in results) < sum(r.stats.steps for r in results)


def test_admitted_prompts_join_mid_run_numbered_after_the_first(random_pair, monkeypatch):
    """`admit` hands over prompts one at a time while the run goes on, among them longer ones than the run was
    sized for (the arenas grow); streamed tokens and results carry the requests' numbers in admission order."""
    target, drafter, prompts, expected = random_pair
    log = PlacementLog(monkeypatch)
    longer = [p * 4 for p in prompts[:2]]  # up to 116 tokens against the first prompts' 2-29
    queue = longer + prompts[4:8]
    asked: list[int] = []

    def admit(free: int) -> list[list[int]]:
        asked.append(free)
        taken, queue[:] = queue[:1], queue[1:]
        return taken

    streamed: dict[int, list[int]] = {}
    runtime = ReferenceRuntime(target, PROPOSERS["dflash-sa-adaptive"](target, drafter), inflight=True)
    params = SamplingParams(max_tokens=24)
    results = runtime.generate(prompts[:4], params, batch_size=3, admit=admit,
                               on_tokens=lambda request, tokens: streamed.setdefault(request, []).extend(tokens))
    everything = prompts[:4] + longer + prompts[4:8]
    want = [r.output_token_ids for r in ReferenceRuntime(target, None).generate(everything, params)]
    assert [r.prompt_token_ids for r in results] == everything
    assert [r.output_token_ids for r in results] == want
    assert [streamed[i] for i in range(len(everything))] == want
    assert all(0 < free <= 3 for free in asked) and not queue
    assert log.widest <= 3 and log.reused


def test_a_joined_rows_drafter_context_is_a_fresh_prefills(random_pair):
    """At a drafter step after newcomers joined, every row's draft distributions equal those of a fresh proposer
    whose context is the prefill of that row's committed sequence (a threshold no match reaches keeps every step
    on the drafter; sampling returns the distributions)."""
    target, drafter, prompts, _ = random_pair

    class Recording(SuffixDFlashProposer):
        def __init__(self):
            super().__init__(DFlashProposer(drafter, target), threshold=10 ** 6)
            self.seen = []

        def propose(self, anchors, anchor_positions, history, num_drafts, params, generator):
            block, q = super().propose(anchors, anchor_positions, history, num_drafts, params, generator)
            self.seen.append(([list(h) for h in history], anchor_positions.clone(), q))
            return block, q

    proposer = Recording()
    params = SamplingParams(max_tokens=12, temperature=1.0)
    ReferenceRuntime(target, proposer, inflight=True).generate(prompts[:9], params, batch_size=3)
    # the last steps run on rows that joined after the first three finished
    history, positions, q = proposer.seen[-1]
    assert not set(map(tuple, history)) & {tuple(p) for p in prompts[:3]}
    fresh = DFlashProposer(drafter, target)
    with torch.inference_mode():
        context = [h[:-1] for h in history]
        capacity = max(map(len, history)) + 8
        _, _, features, lens = prefill(target, context, fresh.feature_layers, capacity)
        fresh.start(features, lens, capacity)
        _, q_fresh = fresh.propose(torch.tensor([h[-1] for h in history]), positions, history, q.shape[1], params,
                                   torch.Generator().manual_seed(0))
    assert torch.allclose(q, q_fresh, atol=1e-5)


def test_static_runtimes_refuse_admit(random_pair):
    target, _, prompts, _ = random_pair
    with pytest.raises(ValueError, match="in-flight"):
        ReferenceRuntime(target, None).generate(prompts[:2], SamplingParams(max_tokens=2), admit=lambda free: [])


def arena(batch: int, capacity: int, start: float) -> KVArena:
    cache = KVArena(2, batch, 1, capacity, 4, torch.float32, "cpu")
    for i in range(batch):
        cache.keys[:, i], cache.values[:, i] = start + i, -(start + i)
    return cache


def test_place_replaces_rows_then_appends_in_order():
    cache, newcomers = arena(3, 5, 0.0), arena(3, 5, 10.0)
    cache.place([2, 0, 3], newcomers)
    assert cache.keys.shape[1] == 4 and cache.k[0].shape[0] == 4
    assert [float(cache.keys[0, i, 0, 0, 0]) for i in range(4)] == [11.0, 1.0, 10.0, 12.0]
    assert [float(cache.values[1, i, 0, 4, 3]) for i in range(4)] == [-11.0, -1.0, -10.0, -12.0]


@pytest.mark.parametrize("slots", [[0, 4], [3, 0], [5]])
def test_place_refuses_rows_that_skip_past_the_batch(slots):
    with pytest.raises(ValueError, match="in order"):
        arena(3, 5, 0.0).place(slots, arena(len(slots), 5, 10.0))


def test_place_refuses_another_capacity():
    with pytest.raises(ValueError, match="positions"):
        arena(2, 5, 0.0).place([0], arena(1, 6, 1.0))


def test_grow_keeps_every_row_and_zeroes_the_new_positions():
    cache = arena(2, 5, 1.0)
    cache.grow(9)
    assert cache.capacity == 9 and cache.keys.shape[3] == 9 and cache.k[1].shape[2] == 9
    assert torch.equal(cache.keys[:, :, :, :5], arena(2, 5, 1.0).keys)
    assert not cache.keys[:, :, :, 5:].any() and not cache.values[:, :, :, 5:].any()
    cache.grow(4)  # never shrinks
    assert cache.capacity == 9
