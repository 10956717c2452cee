"""The PyTorch reference runtime: the batched, lossless DFlash draft-verify loop.

gpt-fast style: `prefill`, `verify_step` and `generate_batch` are small functions over plain
tensors; `ReferenceRuntime` only chunks prompts into batches. With no proposer the same loop is
the autoregressive baseline (a block of width 1), so both paths share every line of bookkeeping.

Per step, for the b active requests (anchor = newest committed token at position s):
  1. the proposer drafts K tokens for positions s+1..s+K;
  2. the target runs [anchor, drafts] at positions s..s+K in one pass (writing its K/V);
  3. the verification rule keeps a drafts and adds one bonus token (greedy or rejection sampling);
  4. the target cache rolls back to s+a+1 for free (lengths move; stale K/V is overwritten later),
     and the proposer receives the features of the a+1 committed positions.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ..models.kv_cache import KVArena, place_items, place_rows
from ..models.target import GptOssTarget
from .accept import greedy_verify_block, rejection_accept, sample_from_probs
from .interface import Admit, Cancelled, OnTokens, check_request
from .proposers import Proposer
from .sampling import SamplingParams, greedy_tokens, probabilities
from .stats import GenerationInterrupted, GenerationResult, RequestStats


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pick_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """The target's own choice from logits [b, V]: argmax, or a sample."""
    if params.greedy:
        return greedy_tokens(logits)
    uniforms = torch.rand(logits.shape[:-1], generator=generator, device=logits.device)
    return sample_from_probs(probabilities(logits, params), uniforms)


def prefill(target: GptOssTarget, prompts: Sequence[Sequence[int]], feature_layers: list[int], capacity: int):
    """Run right-padded prompts; returns (cache, last-position logits [b, V], features [b, L, F], lens)."""
    device = target.device
    lens = torch.tensor([len(p) for p in prompts], device=device)
    tokens = torch.zeros(len(prompts), int(lens.max()), dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.tensor(prompt, device=device)
    positions = torch.arange(tokens.shape[1], device=device).expand_as(tokens)
    cache = target.new_cache(len(prompts), capacity)
    with target.reading_experts(target.prefill_storage):  # the same numbers to float32 rounding, sooner
        logits, features = target(tokens, positions, cache, feature_layers, logit_index=lens - 1)
    return cache, logits, features, lens


def verify_width(proposer: Proposer | None) -> int:
    """The widest block a step verifies: the anchor and every draft (1 without a proposer)."""
    return 1 if proposer is None else proposer.num_drafts + 1


def kv_capacity(prompts: Sequence[Sequence[int]], max_tokens: int, block_size: int) -> int:
    """K/V positions a request among `prompts` needs at most: its prompt, max_tokens and the widest verify block."""
    return max(len(p) for p in prompts) + max_tokens + block_size


def draft_length(schedule: dict[int, int] | None, batch: int, most: int) -> int:
    """TensorRT-LLM's draft_len_schedule: the smallest key >= the live batch size gives the draft
    length; above the largest key speculation is off (0). No schedule: always `most`."""
    if schedule is None:
        return most
    fitting = [key for key in schedule if key >= batch]
    return min(schedule[min(fitting)], most) if fitting else 0


def verify_step(target: GptOssTarget, cache, proposer: Proposer | None, anchors: torch.Tensor,
                positions: torch.Tensor, history: list[list[int]], num_drafts: int, params: SamplingParams,
                generator: torch.Generator, step_times: dict[str, float], offsets: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft, verify and accept one block per request -> (drafts [b, K], num_accepted [b], bonus [b]). `offsets`:
    0, 1, ... covering the widest block, made once per batch (an `arange` a step ran cold, round 27)."""
    device = anchors.device
    start = time.perf_counter()
    if num_drafts == 0:
        block, q = anchors[:, None], None
    else:  # the proposer hands over the whole block: a `cat` here ran cold after the last step's weights streamed
        block, q = proposer.propose(anchors, positions, history, num_drafts, params, generator)
    synchronize(device)
    drafted = time.perf_counter()
    drafts = block[:, 1:]
    # a view without drafts: each tensor op here runs cold (docs/benchmarks.md, round 27)
    block_positions = positions[:, None] + offsets[: block.shape[1]] if drafts.shape[1] else positions[:, None]
    feature_layers = proposer.feature_layers if proposer is not None else []
    if params.greedy:
        num_accepted, bonus, features = greedy_verify_block(target, block, block_positions, cache, feature_layers,
                                                            drafts)
    else:
        logits, features = target(block, block_positions, cache, feature_layers)
        p = probabilities(logits, params)
        if q is None:  # deterministic drafts: q is one-hot at the draft token
            q = torch.nn.functional.one_hot(drafts, p.shape[-1]).to(p.dtype)
        uniforms = torch.rand(block.shape, generator=generator, device=device)
        num_accepted, bonus = rejection_accept(drafts, q, p, uniforms)
    if proposer is not None:
        proposer.commit(features, num_accepted)
    synchronize(device)
    step_times["draft"] += drafted - start
    step_times["verify"] += time.perf_counter() - drafted
    return drafts, num_accepted, bonus


@torch.inference_mode()
def generate_batch(target: GptOssTarget, proposer: Proposer | None, prompts: Sequence[Sequence[int]],
                   params: SamplingParams, on_tokens: OnTokens | None = None,
                   step_times: dict[str, float] | None = None,
                   draft_len_schedule: dict[int, int] | None = None,
                   cancelled: Cancelled | None = None, admit: Admit | None = None,
                   slots: int | None = None, capacity: int | None = None,
                   step_counts: dict[str, int] | None = None) -> list[GenerationResult]:
    """Generate for one batch of prompts until every request stops or reaches max_tokens.
    With a schedule the draft length follows the live batch size, step by step. `cancelled(request)`,
    asked before each step, finishes a request as "cancelled" (a server's client went away).

    In-flight batching: with `admit`, before each step where fewer than `slots` (default: the first prompts' count)
    requests are live, `admit(free)` may hand over up to `free` more prompts; they are prefilled and join the batch
    at once, numbered after those before them (`on_tokens`, `cancelled` and the results use that numbering).
    `capacity`: K/V positions per row at first (default: what the first prompts need, `kv_capacity`); a longer prompt
    joining the batch grows the arenas (`KVArena.grow`, `Proposer.join`). `step_counts` gains the verify steps
    ("steps") and the live rows summed over them ("rows")."""
    device = target.device
    block_size = verify_width(proposer)
    step_times = step_times if step_times is not None else {"draft": 0.0, "verify": 0.0}
    generator = torch.Generator(device=device).manual_seed(params.seed)  # one stream for the run, newcomers too
    stops = set(params.stop_token_ids)
    slots = slots or len(prompts)
    capacity = capacity or kv_capacity(prompts, params.max_tokens, block_size)
    offsets = torch.arange(block_size, device=device)
    feature_layers = proposer.feature_layers if proposer is not None else []
    prompts = list(prompts)
    stats = [RequestStats(block_size) for _ in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    # each request's committed tokens, grown in place: a proposer reads only what is new
    sequences = [list(p) for p in prompts] if proposer is not None and proposer.needs_history else None
    finish: list[str | None] = [None] * len(prompts)

    def commit(request: int, new_tokens: list[int]) -> None:
        taken = []
        for token in new_tokens:
            taken.append(token)
            if token in stops:
                finish[request] = "stop"
                break
            if len(outputs[request]) + len(taken) >= params.max_tokens:
                finish[request] = "length"
                break
        outputs[request].extend(taken)
        if sequences is not None:
            sequences[request].extend(taken)
        if on_tokens is not None:
            on_tokens(request, taken)

    def enter(first_request: int, taken: list[int] | None) -> tuple[KVArena, torch.Tensor, torch.Tensor]:
        """Prefill requests first_request.. -> their cache rows, first tokens and prompt lengths; the proposer starts
        on them (a batch's first requests: `taken` None) or takes them into batch rows `taken` (`Proposer.join`)."""
        newcomers = prompts[first_request:]
        synchronize(device)
        start = time.perf_counter()
        cache, logits, features, lens = prefill(target, newcomers, feature_layers, capacity)
        first = pick_tokens(logits, params, generator)
        if proposer is not None:
            if taken is None:
                proposer.start(features, lens, capacity)
            else:
                proposer.join(features, lens, capacity, taken)
        synchronize(device)
        now = time.perf_counter()
        for request, token in enumerate(first.tolist(), start=first_request):
            stats[request].prefill_time, stats[request].decode_started = now - start, now
            commit(request, [token])
        return cache, first, lens

    def admitted(free: int) -> bool:
        """Whether `admit` handed over prompts (added to the run's lists)."""
        more = list(admit(free)) if admit is not None and free > 0 else []
        if len(more) > free:
            raise ValueError(f"admit handed over {len(more)} prompts for {free} free rows")
        prompts.extend(more)
        stats.extend(RequestStats(block_size) for _ in more)
        outputs.extend([] for _ in more)
        finish.extend(None for _ in more)
        if sequences is not None:
            sequences.extend(list(p) for p in more)
        return bool(more)

    def results() -> list[GenerationResult]:
        for request, request_stats in enumerate(stats):
            request_stats.num_output_tokens = len(outputs[request])
        return [GenerationResult(list(p), outputs[r], finish[r], stats[r]) for r, p in enumerate(prompts)]

    try:
        cache, anchors, positions = enter(0, None)
        rows = list(range(len(prompts)))  # batch row -> request index
        while True:
            if cancelled is not None:
                for request in rows:
                    if finish[request] is None and cancelled(request):
                        finish[request] = "cancelled"
            done = [i for i, request in enumerate(rows) if finish[request] is not None]  # batch rows to free
            if done:
                now = time.perf_counter()
                for i in done:
                    stats[rows[i]].decode_time = now - stats[rows[i]].decode_started
            first_new = len(prompts)
            if admitted(slots - len(rows) + len(done)):
                joining = len(prompts) - first_new
                capacity = max(capacity, kv_capacity(prompts[first_new:], params.max_tokens, block_size))
                if len(done) == len(rows):  # nothing live: the newcomers start a batch afresh
                    cache, anchors, positions = enter(first_new, None)
                    rows = list(range(first_new, len(prompts)))
                else:  # newcomers take finished requests' rows, then rows appended after the batch
                    taken = done[:joining] + list(range(len(rows), len(rows) + joining - len(done[:joining])))
                    cache.grow(capacity)  # a longer newcomer: room for it in every row
                    joined, first, lens = enter(first_new, taken)
                    cache.place(taken, joined)
                    anchors, positions = place_rows(anchors, taken, first), place_rows(positions, taken, lens)
                    place_items(rows, taken, list(range(first_new, len(prompts))))
                continue  # a newcomer may have finished at its first token
            if done:
                keep = [i for i, request in enumerate(rows) if finish[request] is None]
                rows = [rows[i] for i in keep]
                if not rows:
                    break
                index = torch.tensor(keep, device=device)
                cache.keep_rows(index)
                if proposer is not None:
                    proposer.keep_rows(index)
                anchors, positions = anchors[index], positions[index]
            most = 0 if proposer is None else proposer.num_drafts
            num_drafts = draft_length(draft_len_schedule, len(rows), most)
            history_rows = [sequences[r] for r in rows] if num_drafts and sequences is not None else []
            drafts, num_accepted, bonus = verify_step(target, cache, proposer, anchors, positions, history_rows,
                                                      num_drafts, params, generator, step_times, offsets)
            if step_counts is not None:
                step_counts["steps"] += 1
                step_counts["rows"] += len(rows)
            from_suffix = getattr(proposer, "suffix_rows", None) if num_drafts else None
            drafted = drafts.shape[1] > 0  # the proposer may have chosen none (adaptive draft length)
            for row, (request, a, draft_row, bonus_token) in enumerate(
                    zip(rows, num_accepted.tolist(), drafts.tolist(), bonus.tolist())):
                stats[request].record_step(a, from_suffix=bool(from_suffix and from_suffix[row]), drafted=drafted)
                commit(request, draft_row[:a] + [bonus_token])
            anchors, positions = bonus, positions + num_accepted + 1
        return results()
    except KeyboardInterrupt:
        now = time.perf_counter()
        for request in range(len(prompts)):
            if finish[request] is None:
                finish[request] = "interrupted"
                started = stats[request].decode_started  # None: interrupted in its prefill
                stats[request].decode_time = 0.0 if started is None else now - started
        raise GenerationInterrupted(results()) from None


class ReferenceRuntime:
    """Runs prompts through the loop `batch_size` at a time, in input order: with `inflight` (in-flight batching), a
    finished request's row goes to the next waiting prompt at the next step; without, in static batches (a batch's
    rows wait for its slowest request)."""

    backend = "reference"

    def __init__(self, target: GptOssTarget, proposer: Proposer | None,
                 draft_len_schedule: dict[int, int] | None = None, inflight: bool = False):
        self.target, self.proposer, self.draft_len_schedule = target, proposer, draft_len_schedule
        self.inflight = inflight

    def warm_up(self, prompt: Sequence[int]) -> None:
        """One short untimed generation: first calls pay one-time allocation and dispatch costs
        that would otherwise land in the first measured run."""
        self.generate([prompt], SamplingParams(max_tokens=3))

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, batch_size: int = 1,
                 on_tokens: OnTokens | None = None, cancelled: Cancelled | None = None,
                 admit: Admit | None = None) -> list[GenerationResult]:
        """`admit` (in-flight only): more prompts while the run goes on (a server's requests that arrive meanwhile),
        numbered after `prompts` and checked like them, as `generate_batch` takes them."""
        check_request(prompts, batch_size, self.target.vocab_size, params.max_tokens,
                      self.target.config.max_position_embeddings)
        self.step_times = {"draft": 0.0, "verify": 0.0}
        self.step_counts = {"steps": 0, "rows": 0}  # verify steps of this call, and their live rows summed
        if self.inflight:
            waiting = list(prompts[batch_size:])

            def next_prompts(free: int) -> list[Sequence[int]]:
                taken, waiting[:] = waiting[:free], waiting[free:]
                if admit is not None and free > len(taken):
                    arriving = list(admit(free - len(taken)))
                    check_request(arriving, batch_size, self.target.vocab_size, params.max_tokens,
                                  self.target.config.max_position_embeddings)
                    taken += arriving
                return taken

            return generate_batch(self.target, self.proposer, prompts[:batch_size], params, on_tokens, self.step_times,
                                  self.draft_len_schedule, cancelled, next_prompts, batch_size,
                                  self.capacity(prompts, params), self.step_counts)
        if admit is not None:
            raise ValueError("admitting prompts needs in-flight batching (ReferenceRuntime(..., inflight=True))")
        results: list[GenerationResult] = []
        for first in range(0, len(prompts), batch_size):
            chunk = prompts[first: first + batch_size]
            callback = None if on_tokens is None else (lambda r, toks, base=first: on_tokens(base + r, toks))
            stop = None if cancelled is None else (lambda r, base=first: cancelled(base + r))
            try:
                results.extend(generate_batch(self.target, self.proposer, chunk, params, callback, self.step_times,
                                              self.draft_len_schedule, stop, step_counts=self.step_counts))
            except GenerationInterrupted as interrupted:
                raise GenerationInterrupted(results + interrupted.results) from None
            except KeyboardInterrupt:  # between batches: what finished still counts
                raise GenerationInterrupted(results) from None
        return results

    def capacity(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> int:
        return kv_capacity(prompts, params.max_tokens, verify_width(self.proposer))
