"""Draft proposers: what fills a block before the target verifies it.

A proposer sees the batch through a few calls and keeps whatever per-request state it needs:
`start` after prefill, `propose` before each verify, `commit` after it, `keep_rows` when finished
requests leave the batch, `join` when requests join it (in-flight batching). The DFlash proposer is the
product, alone or with suffix-automaton drafts (`SuffixDFlashProposer`); n-gram prompt lookup is the
draft-model-free baseline; test proposers reuse the interface.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..errors import InputError
from ..models.drafter import DFlashDrafter
from ..models.kv_cache import place_rows
from ..models.linear import CastLinear, cast, gemm_dtype
from ..models.target import GptOssTarget
from ..plugins.draft_block.cpu import greedy_peak_cpu, serves
from .accept import sample_from_probs
from .draft_length import AdaptiveDraftLength, CostTables
from .sampling import SamplingParams, greedy_tokens, probabilities
from .suffix_index import SuffixIndexes


class Proposer(Protocol):
    num_drafts: int  # the most drafts per block (block_size - 1); a step may ask for fewer
    feature_layers: list[int]  # target layers whose outputs the proposer consumes
    needs_history: bool  # whether `propose` reads the committed tokens

    def start(self, features: torch.Tensor | None, prompt_lens: torch.Tensor, capacity: int) -> None: ...

    def propose(self, anchors: torch.Tensor, anchor_positions: torch.Tensor, history: list[list[int]],
                num_drafts: int, params: SamplingParams, generator: torch.Generator
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> the block to verify, int64 [b, 1 + K] with K <= num_drafts: each row's anchor, then its drafts (the
        proposer builds it: a `cat` of anchors and drafts, as the loop did, ran cold every step); and, when sampling,
        the distributions the drafts were drawn from [b, K, V] (None means the drafts are deterministic: q is
        one-hot). `history` holds each request's committed tokens (prompt, outputs, anchor last): the loop's own
        lists, grown in place from step to step, so a proposer can read just the new tail (never modify them)."""
        ...

    def commit(self, features: torch.Tensor | None, num_accepted: torch.Tensor) -> None:
        """After every verify, also one without drafts: features [b, width, F] of the verified
        positions, of which the first num_accepted + 1 are now committed."""
        ...

    def keep_rows(self, rows: torch.Tensor) -> None: ...

    def join(self, features: torch.Tensor | None, prompt_lens: torch.Tensor, capacity: int, slots: list[int]) -> None:
        """Requests prefilled after `start` join the batch, as `start` takes a batch's first ones: newcomer i takes
        batch row slots[i], a finished request's row (its state replaced) or, past the batch, a row appended in
        order (`KVArena.place`)."""
        ...


class DFlashProposer:
    """Block diffusion drafting with KV injection (dflash-algorithm.md §3.1-3.2).

    Invariants: after `propose`, the draft cache holds context K/V for positions [0, s) of each
    request (s = anchor position); the anchor reaches the drafter only through its embedding;
    `commit` queues the verify features of the anchor and the accepted drafts for the next call.
    With a `policy` (`adaptive_draft_length`: compiled, or `AdaptiveDraftLength`) each step first decides whether to
    draft at all; a drafter step drafts the whole block (at most the loop's K) and verifies as many drafts as their
    confidences pay for (`AdaptiveDraftLength.truncate`).
    With `matmul_dtype` (e.g. bfloat16) the GEMMs of the drafter step -- the context projection, the
    layers and the draft logits from a copy of the target's LM head -- run in the dtype `gemm_dtype`
    gives each (bf16: the LM head, 4 MB in float32, and the rest in fbgemm's float16 where it runs,
    else in the drafter's own; float16: all): drafts need not be exact (the target verifies them;
    sampled drafts carry the q they were drawn from). Where the target's own head serves the dtype (its
    fbgemm copy, `GptOssTarget.head`), the drafter's logits come from it. On a CPU with AVX512-BF16, or AVX2 and
    FMA, every bf16 GEMM, the LM head's copy included, is the compiled dot-product GEMM (`CastLinear.dot`) at any row
    count.
    """

    needs_history = False

    def __init__(self, drafter: DFlashDrafter, target: GptOssTarget, block_size: int | None = None,
                 policy: AdaptiveDraftLength | None = None, matmul_dtype: torch.dtype | None = None,
                 cost_tables: CostTables | None = None):
        """`cost_tables` (with a `policy`): its step costs at several live batch sizes, each step's rows' in force."""
        cfg = drafter.config
        self.drafter, self.target, self.policy, self.matmul_dtype = drafter, target, policy, matmul_dtype
        self.cost_tables = cost_tables
        self.head = None  # None: the target's own LM head (`GptOssTarget.head`), the very copy its verify reads
        if matmul_dtype is not None:
            head = target.hf.lm_head
            dtype = gemm_dtype(head.weight, matmul_dtype)
            if dtype != target.head.dtype:
                # an int8 head reads the very bytes the verify's exact greedy head has just read (3% of a drafter
                # step inside the loop, round 21)
                shared = target.greedy_head if dtype == torch.int8 else None
                self.head = CastLinear(head.weight, head.bias, dtype, few_rows=target.head,
                                       dot_packed=None if shared is None else (shared.packed, shared.scales))
        self.block_size = block_size or cfg.block_size
        self.num_drafts = self.block_size - 1
        self.keep_confidence = policy is not None  # the adaptive policy sizes a drafted block by it
        self.confidence: torch.Tensor | None = None
        self.feature_layers = list(cfg.target_layer_ids)
        self.mask_token_id = cfg.mask_token_id

    def start(self, features, prompt_lens, capacity):
        """Sizes every per-step buffer once: the draft arena (context plus one block of scratch), the
        block of tokens (mask ids after the anchor column) and the column offsets; decides how the drafter
        runs (`DFlashDrafter.plan`); and writes the prompts' context K/V, the drafter's prefill (so a step's
        cost does not depend on whether it is the first)."""
        batch, device = len(prompt_lens), prompt_lens.device
        self.plan = self.drafter.plan(self.matmul_dtype)  # the drafter stays as it is for this generate call
        self.cache = self.drafter.new_cache(batch, capacity)
        # a drafter with the target's own head (`head` None) leaves its logits to the target, whose `lm_head` a
        # stand-in may wrap (train.step's RecordingProposer): only a head of the proposer's own runs compiled
        self.whole_step = None if self.head is None else self.drafter.whole_step(
            self.plan, self.head, self.target.hf.model.embed_tokens.weight, capacity)
        self.context_lens = torch.zeros_like(prompt_lens)
        # chunks (features [b, w, F], the last valid entry per row [b]), `pack_ragged`
        self.pending = [(features, prompt_lens - 1)]
        self.no_features = features[:, :0]
        self.columns = torch.arange(capacity, device=device)
        self.block = torch.full((batch, self.block_size), self.mask_token_id, dtype=torch.long, device=device)
        self.write_pending_context()

    def take_pending(self) -> tuple[torch.Tensor, torch.Tensor | int, int | None]:
        """The queued committed positions' features and their arena positions (`write_context`'s), the queue
        emptied and `context_lens` advanced past them; and a lone request's anchor position (its context
        length after them; None for a batch)."""
        if len(self.context_lens) == 1:  # a lone request: each chunk's entries a prefix, one span after its context
            counts = [int(last) + 1 for _, last in self.pending]  # plain slices: `pack_ragged` took ~10 ops
            pieces = [features[:, :n] for (features, _), n in zip(self.pending, counts)]
            features = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0] if pieces else self.no_features
            start = int(self.context_lens)
            self.context_lens += features.shape[1]
            self.pending = []
            return features, start, start + features.shape[1]
        features, lens = pack_ragged(self.pending) if self.pending else (self.no_features, torch.zeros_like(self.context_lens))
        # A row's entries past its own pending length are padding: they land past its context, where nothing reads
        # them before they are overwritten; the clamp keeps them inside the arena.
        positions = (self.context_lens[:, None] + self.columns[: features.shape[1]]).clamp_(max=self.cache.capacity - 1)
        self.context_lens += lens
        self.pending = []
        return features, positions, None

    def write_pending_context(self) -> None:
        """Write the queued context K/V now (the prompts' at `start`; a drafter step writes the committed tokens'
        in its forward)."""
        features, positions, _ = self.take_pending()
        if not features.shape[1]:
            return
        if self.whole_step is not None:  # one compiled call instead of the lean path's ~6 (33 against 56 us; round 21)
            self.whole_step.write(features, positions, self.cache)
        else:
            self.drafter.write_context(features, positions, self.cache, self.matmul_dtype, self.plan)

    def propose(self, anchors, anchor_positions, history, num_drafts, params, generator):
        if self.cost_tables is not None:
            self.cost_tables.price(self.policy, len(anchors))
        drafting = num_drafts > 0 if self.policy is None else self.policy.choose("neural", num_drafts) > 0
        if not drafting:  # an autoregressive step: the queued context waits for the next draft
            return anchors[:, None], None
        block, q = self.draft(anchors, anchor_positions, num_drafts, params, generator)
        if self.policy is not None:  # the whole block is drafted; its confidences say how much to verify
            block, q = self.keep_first(self.policy.truncate(self.confidence, num_drafts), block, q)
        return block, q

    def keep_first(self, k: int, block: torch.Tensor,
                   q: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A drafted verify block with its first k drafts, their distributions and `confidence`: what the step
        verifies."""
        self.confidence = self.confidence[:, :k]
        return block[:, : k + 1], None if q is None else q[:, :k]

    def draft(self, anchors, anchor_positions, num_drafts, params, generator):
        """One drafter step: the verify block with `num_drafts` drafts per row and, when sampling, their
        distributions. With `keep_confidence`, `confidence` [b, num_drafts] is the peak of each draft's
        distribution (the greedy draft's probability): a function of the distributions, never of the tokens drawn
        from them, so a K chosen by it keeps rejection sampling exact (one chosen by the drawn token's own
        probability would not: the drafts it keeps would no longer be distributed as q)."""
        features, context_positions, lone_anchor = self.take_pending()
        width = num_drafts + 1
        block = self.block[:, :width]
        block[:, 0] = anchors
        greedy = None  # when greedy and compiled: (the verify block, the drafts' confidences)
        if self.whole_step is not None:  # one compiled call, which hands the verify block back whole
            logits, greedy = self.whole_step(block, features, context_positions, self.cache, self.context_lens,
                                             params.greedy)
        else:
            positions = anchor_positions[:, None] + self.columns[:width] if lone_anchor is None else lone_anchor
            hidden = self.drafter(self.target.embed(block), positions, self.cache, self.context_lens, self.matmul_dtype,
                                  context=(features, context_positions), plan=self.plan)
            logits = self.draft_logits(hidden[:, 1:])
            if params.greedy and self.plan.compiled and serves(logits):  # one pass instead of two or three ops
                tokens, peak = greedy_peak_cpu(logits)
                greedy = verify_block(anchors, tokens), peak
        if greedy is not None:
            verified, peak = greedy
            if self.keep_confidence:
                self.confidence = peak
            return verified, None
        if params.greedy:
            if self.keep_confidence:
                self.confidence = torch.softmax(logits, dim=-1).amax(dim=-1)
            return verify_block(anchors, greedy_tokens(logits)), None
        q = probabilities(logits, params)
        if self.keep_confidence:
            self.confidence = q.amax(dim=-1)
        uniforms = torch.rand(q.shape[:-1], generator=generator, device=q.device)
        return verify_block(anchors, sample_from_probs(q, uniforms)), q

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float logits [b, K, V] of the drafter's final-normed hidden states [b, K, H]."""
        if self.head is None:
            return self.target.lm_head(cast(hidden, self.target.dtype))
        return self.head(hidden)  # in the hidden states' dtype, float32 here

    def commit(self, features, num_accepted):
        """Queue the committed positions' features; usually the queue is empty (one step's worth),
        but steps without drafting (draft length 0 under load) let it grow until the next draft: as a list of
        chunks, packed once when taken, since re-packing it every step cost 7% of such a step at batch 4. A chunk
        keeps num_accepted as it is, the index of its rows' last committed entry: the count, num_accepted + 1, an
        op that ran cold every step, is made once when the queue is taken (`pack_ragged`)."""
        if self.policy is not None and features.shape[1] > 1:  # a step that verified drafts (the drafter's)
            self.policy.observe_drafter(features.shape[1] - 1, num_accepted.tolist(), self.confidence)
        self.pending.append((features, num_accepted))

    def keep_rows(self, rows):
        self.cache.keep_rows(rows)
        self.context_lens, self.no_features = self.context_lens[rows], self.no_features[rows]
        self.pending = [(features[rows], last[rows]) for features, last in self.pending]
        self.block = self.block[rows]

    def join(self, features, prompt_lens, capacity, slots):
        """The newcomers' prompt context K/V written at once into arena rows of their own, then placed in their slots
        (the arena grown first where `capacity` exceeds it); the batch's queued chunks hold nothing for them
        (`pack_ragged` counts last = -1 as none)."""
        joining, device = len(prompt_lens), prompt_lens.device
        if capacity > self.cache.capacity:  # a longer newcomer: the arena, its positions and the rotary table grow
            self.cache.grow(capacity)
            self.columns = torch.arange(capacity, device=device)
            if self.whole_step is not None:
                embedding = self.target.hf.model.embed_tokens.weight
                self.whole_step = self.drafter.whole_step(self.plan, self.head, embedding, capacity)
        cache = self.drafter.new_cache(joining, capacity)
        positions = self.columns[: features.shape[1]].repeat(joining, 1)  # right-padded prompts: each row from 0
        if self.whole_step is not None:
            self.whole_step.write(features, positions, cache)
        else:
            self.drafter.write_context(features, positions, cache, self.matmul_dtype, self.plan)
        self.cache.place(slots, cache)
        self.context_lens = place_rows(self.context_lens, slots, prompt_lens)
        self.no_features = place_rows(self.no_features, slots, features[:, :0])
        # the chunks are the verifies' own tensors: copies take the newcomers (as `cat` copied them before)
        self.pending = [(place_rows(chunk.clone(), slots, chunk.new_zeros(joining, *chunk.shape[1:])),
                         place_rows(last.clone(), slots, last.new_full((joining,), -1))) for chunk, last in self.pending]
        self.block = place_rows(self.block, slots, torch.full((joining, self.block_size), self.mask_token_id,
                                                              dtype=self.block.dtype, device=device))


def verify_block(anchors: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """The block a step verifies: anchors [b], then drafts [b, K] -> [b, 1 + K]."""
    return torch.cat([anchors[:, None], drafts], dim=1)


def pack_ragged(chunks: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks (features [b, w, F], last [b]: entries 0..last[i] of row i are valid), in order -> row i of the
    result holds its valid entries of every chunk, left-aligned and padded to the longest row; and their counts."""
    if len(chunks) == 1:
        features, last = chunks[0]
        lens = last + 1
        return features[:, : int(lens.max())], lens
    features = torch.cat([f for f, _ in chunks], dim=1)
    device = features.device
    valid = torch.cat([torch.arange(f.shape[1], device=device) <= n[:, None] for f, n in chunks], dim=1)
    lens = valid.sum(dim=1)
    out = features.new_zeros(features.shape[0], int(lens.max()), features.shape[2])
    columns = valid.cumsum(dim=1) - 1
    rows = torch.arange(features.shape[0], device=device)[:, None].expand_as(columns)
    out[rows[valid], columns[valid]] = features[valid]
    return out, lens


class NGramProposer:
    """Prompt lookup (the draft-model-free baseline TensorRT-LLM ships as NGram): find the most
    recent earlier occurrence of the sequence's last n tokens (longest n first) and propose the
    tokens that followed it. No target features, no drafter forward: its cost is a list search.
    Without a match it proposes the anchor repeated, which the target simply rejects."""

    feature_layers: list[int] = []
    needs_history = True

    def __init__(self, num_drafts: int, max_ngram: int = 3):
        self.num_drafts, self.max_ngram = num_drafts, max_ngram

    def start(self, features, prompt_lens, capacity):
        pass

    def lookup(self, sequence: list[int], k: int) -> list[int]:
        for n in range(min(self.max_ngram, len(sequence) - 1), 0, -1):
            pattern = sequence[-n:]
            for start in range(len(sequence) - n - 1, -1, -1):
                if sequence[start: start + n] == pattern:
                    follow = sequence[start + n: start + n + k]
                    return follow + [follow[-1]] * (k - len(follow))
        return [sequence[-1]] * k

    def propose(self, anchors, anchor_positions, history, num_drafts, params, generator):
        block = [[sequence[-1]] + self.lookup(sequence, num_drafts) for sequence in history]  # the anchor is last
        return torch.tensor(block, dtype=anchors.dtype, device=anchors.device), None

    def commit(self, features, num_accepted):
        pass

    def keep_rows(self, rows):
        pass

    def join(self, features, prompt_lens, capacity, slots):
        pass


DEFAULT_SA_THRESHOLD = 2  # chosen by measurement: docs/benchmarks.md, "Suffix-automaton hybrid drafting"


def check_max_suffix_drafts(value: int | None, block_drafts: int, bound: str, field: str) -> None:
    """dflash-sa's longest suffix draft must be at least the verify block's drafts, `bound` saying which block
    (an error naming `field` otherwise): suffix drafts run past the block, never short of it."""
    if value is not None and value < block_drafts:
        raise InputError(f"expected at least {bound} ({block_drafts}): suffix drafts run past the verify block, "
                         f"never short of it; got {value}.", field=field)


def default_sa_max_drafts(block_size: int) -> int:
    """dflash-sa's longest suffix draft unless asked otherwise: a verify of two blocks, 2 x block - 1 drafts (15 at
    the embedded drafter's block of 8, where the adaptive length then verifies mostly 12 at 128 tokens a prompt
    and 15 at 256: 1.04x and 1.08x over suffix drafts within the block; docs/benchmarks.md, rounds 14 and 15)."""
    return 2 * block_size - 1


class SuffixDFlashProposer:
    """DFlash with suffix-automaton drafting (`--draft-method dflash-sa`): per request and step,
    when the longest suffix of the committed sequence that occurred earlier (prompt or output) is
    at least `threshold` tokens, the tokens that followed that occurrence are the drafts (q is
    one-hot: deterministic), otherwise the DFlash drafter's. The choice depends on committed tokens
    only, so rejection sampling stays exact whichever source a row takes.

    Suffix drafts are not bound to the drafter's block: a step where every row takes them drafts up to
    `max_suffix_drafts` (default: the block's `num_drafts`), the loop's widest step; a step that runs the
    drafter verifies at most its block's drafts, the suffix rows' cut to as many.

    Each request has a suffix index (`SuffixIndexes`) that reads only the tokens committed since the last step.
    When every row takes suffix drafts the drafter does not run: the committed tokens' context K/V stay
    queued, as on a step without drafts, and the next drafter step writes all of them in its forward (a
    lone request's suffix step spent ~0.13 ms of ~0.75 on its own write, round 27; queued, they are a few
    more rows of a GEMM that reads its weights anyway, and a request that ends in a suffix run never
    writes them). `suffix_rows` says which rows of the last `propose`
    took suffix drafts (the loop counts them per request as `suffix_steps`). With a `policy` the
    step drafts the K it chooses for the suffix source when every row has a match; else, unless it
    chooses none, the drafter drafts the whole block and the step verifies the K that the neural rows'
    confidences and the suffix rows' estimate pay for. `dflash` itself must have no policy.
    """

    needs_history = True

    def __init__(self, dflash: DFlashProposer, threshold: int = DEFAULT_SA_THRESHOLD,
                 policy: AdaptiveDraftLength | None = None, max_suffix_drafts: int | None = None,
                 cost_tables: CostTables | None = None):
        """`cost_tables`: the policy's step costs at several live batch sizes, the one of each step's rows in force."""
        if threshold < 1:
            raise InputError(f"expected at least 1, got {threshold}.", field="sa_threshold")
        check_max_suffix_drafts(max_suffix_drafts, dflash.num_drafts, "the block's drafts", "max_suffix_drafts")
        if policy is not None and dflash.policy is not None:
            raise ValueError("give the adaptive draft length to the hybrid proposer only, not to its DFlash proposer")
        self.dflash, self.threshold, self.policy, self.cost_tables = dflash, threshold, policy, cost_tables
        dflash.keep_confidence = policy is not None
        self.num_drafts = max_suffix_drafts or dflash.num_drafts
        self.feature_layers = dflash.feature_layers
        self.suffix_rows: list[bool] = []
        self.match_lengths: list[int] = []  # per row, its suffix match's length at the last `propose`

    def start(self, features, prompt_lens, capacity):
        self.dflash.start(features, prompt_lens, capacity)
        self.indexes = SuffixIndexes(len(prompt_lens))

    def match(self, history: list[list[int]]) -> list[int]:
        """Each row's index brought up to its committed tokens (only what is new since the last step) -> each row's
        suffix match length, also kept as `match_lengths`."""
        self.match_lengths = self.indexes.match(history)
        return self.match_lengths

    def suffix_drafts(self, count: int) -> list[list[int] | None]:
        """Per row of the last `match`: its match's next `count` tokens, or None where the match is shorter than the
        threshold. Asked only once the step's K is known: most steps need fewer than the longest draft, and a step
        without drafts none (the hybrid's per-step Python cost ~10% of the loop's time, round 28)."""
        return [self.indexes.continuation(row, count) if length >= self.threshold else None
                for row, length in enumerate(self.match_lengths)]

    def propose(self, anchors, anchor_positions, history, num_drafts, params, generator):
        lengths = self.match(history)
        self.suffix_rows = [length >= self.threshold for length in lengths]
        everyone = all(self.suffix_rows)
        if self.policy is not None:
            if self.cost_tables is not None:
                self.cost_tables.price(self.policy, len(lengths))
            chosen = (self.policy.choose("suffix", num_drafts, lengths) if everyone
                      else self.policy.choose("neural", num_drafts))
            # a suffix step verifies what the policy chose; a drafter step drafts the whole block and
            # verifies what its drafts' confidences say (`truncate`)
            num_drafts = chosen if everyone or chosen == 0 else num_drafts
        if num_drafts == 0:  # an autoregressive step (the policy's choice)
            self.suffix_rows = [False] * len(lengths)
            return anchors[:, None], None
        if everyone:  # the committed tokens' context K/V wait for the next drafter step (see the class docstring)
            return self.indexes.verify_block(num_drafts).to(anchors.device), None
        num_drafts = min(num_drafts, self.dflash.num_drafts)  # the drafter's block bounds a step it drafts
        block, q = self.dflash.propose(anchors, anchor_positions, history, num_drafts, params, generator)
        if any(self.suffix_rows):
            matched = self.suffix_drafts(num_drafts)
            rows = torch.tensor([i for i, row in enumerate(matched) if row is not None], device=anchors.device)
            suffix = torch.tensor([row for row in matched if row is not None], dtype=block.dtype, device=block.device)
            block[rows, 1:] = suffix
            if q is not None:
                q[rows] = torch.nn.functional.one_hot(suffix, q.shape[-1]).to(q.dtype)
        if self.policy is not None:
            k = self.policy.truncate(self.dflash.confidence, num_drafts, self.suffix_keys(), self.neural_rows())
            block, q = self.dflash.keep_first(k, block, q)
        return block, q

    def neural_rows(self) -> list[int]:
        """The rows whose drafts in the last `propose` came from the drafter."""
        return [i for i, suffix in enumerate(self.suffix_rows) if not suffix]

    def suffix_keys(self) -> list[int]:
        """The match lengths of the rows whose drafts in the last `propose` came from their suffix match."""
        return [length for length, suffix in zip(self.match_lengths, self.suffix_rows) if suffix]

    def commit(self, features, num_accepted):
        drafts = features.shape[1] - 1
        if self.policy is not None and drafts:  # a step without drafts observes nothing
            kept, rows = num_accepted.tolist(), self.suffix_rows
            if any(rows):
                self.policy.observe("suffix", drafts, [a for a, row in zip(kept, rows) if row], self.suffix_keys())
            if not all(rows):  # the drafter's step
                self.policy.observe_drafter(drafts, kept, self.dflash.confidence, self.neural_rows())
        self.dflash.commit(features, num_accepted)

    def keep_rows(self, rows):
        self.dflash.keep_rows(rows)
        self.indexes.keep_rows(rows.tolist())

    def join(self, features, prompt_lens, capacity, slots):
        self.dflash.join(features, prompt_lens, capacity, slots)
        self.indexes.place(slots)
