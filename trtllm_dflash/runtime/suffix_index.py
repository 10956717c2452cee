"""An incremental suffix index over one request's committed tokens (a suffix automaton).

The hybrid drafter asks, before each verify step: what is the longest suffix of the committed
sequence that also occurred earlier, and which tokens followed that earlier occurrence? A suffix
automaton answers both in O(1) after each appended token, and appending is O(1) amortised
(Blumer et al. 1985): no rescan of the history, however long it grows.

Why it works: every state groups the substrings that end at the same set of positions; the state
of the whole sequence ends only at the newest position, so its suffix link is the state of the
longest suffix that also ends somewhere earlier. Each state keeps one position where its
substrings end, refreshed each time the state is that answer (a clone inherits its original's):
a recent occurrence, known without a search. Recent beats first: on the embedded pair, drafts
copied after the most recent occurrence are accepted more often (docs/benchmarks.md).

The loop keeps a batch's indexes in `SuffixIndexes`: compiled (`suffix_index.cpp`, the same automaton) where the
project's C++ kernels build, else these Python ones.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.kv_cache import place_items
from ..plugins.compiled import CompiledKernel

KERNEL = CompiledKernel(Path(__file__).with_name("suffix_index.cpp"), "dflash_suffix_index", "compiled suffix index",
                        "the hybrid's suffix indexes run in Python")


class SuffixIndex:
    """Append tokens with `extend`; `match_length` and `continuation` describe the longest suffix
    that occurred earlier. Lists of plain ints: the per-token work is a few dict operations."""

    def __init__(self):
        self.tokens: list[int] = []
        self.next: list[dict[int, int]] = [{}]  # per state: token -> state
        self.link: list[int] = [-1]  # suffix link (-1 for the root)
        self.length: list[int] = [0]  # longest substring of the state
        self.end: list[int] = [-1]  # per state: where (the last token of) a recent occurrence ends
        self.last = 0  # state of the whole sequence
        self.match_end = -1  # where the longest suffix occurring earlier ends there (-1: no match)

    def __len__(self) -> int:
        return len(self.tokens)

    def new_state(self, length: int, link: int, end: int, transitions: dict[int, int]) -> int:
        self.next.append(transitions)
        self.link.append(link)
        self.length.append(length)
        self.end.append(end)
        return len(self.length) - 1

    def append(self, token: int) -> None:
        """The standard online construction, one token."""
        position = len(self.tokens)
        self.tokens.append(token)
        current = self.new_state(self.length[self.last] + 1, 0, position, {})
        state = self.last
        while state != -1 and token not in self.next[state]:
            self.next[state][token] = current
            state = self.link[state]
        if state != -1:
            target = self.next[state][token]
            if self.length[state] + 1 == self.length[target]:
                self.link[current] = target
            else:  # split: a clone takes the shorter strings of `target`
                clone = self.new_state(self.length[state] + 1, self.link[target], self.end[target],
                                       dict(self.next[target]))
                while state != -1 and self.next[state].get(token) == target:
                    self.next[state][token] = clone
                    state = self.link[state]
                self.link[target] = self.link[current] = clone
        self.last = current
        answer = self.link[current]
        self.match_end = self.end[answer]  # before this position is recorded: an earlier occurrence
        self.end[answer] = position

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.append(token)

    def match_length(self) -> int:
        """Length of the longest suffix that also occurred ending at an earlier position (0: none)."""
        return self.length[self.link[self.last]] if self.tokens else 0

    def continuation(self, count: int) -> list[int]:
        """The `count` tokens that followed that earlier occurrence (call only when match_length() > 0).
        Where they run past the end of the sequence the copy continues from itself, as a repeating
        loop would (the match ends `period` tokens before the end: token j + period repeats token j)."""
        out = self.tokens[self.match_end + 1: self.match_end + 1 + count]
        period = len(self.tokens) - 1 - self.match_end
        while len(out) < count:
            out.append(out[len(out) - period])
        return out


class SuffixIndexes:
    """A batch's suffix indexes, one per request: compiled where `KERNEL` builds, else `SuffixIndex` (the same
    answers, tests/test_runtime_hybrid.py). Compiled because the Python index's per-token work runs cold after every
    target step and grows with the batch: the default 1.02x as fast at batch 1, 4 and 8, the same steps
    (docs/benchmarks.md, round 29)."""

    def __init__(self, batch: int):
        self.module = KERNEL.module()
        self.make = SuffixIndex if self.module is None else self.module.SuffixIndex
        self.indexes = [self.make() for _ in range(batch)]

    def place(self, slots: list[int]) -> None:
        """Empty indexes for requests joining the batch at rows `slots` (a finished request's, or appended in order;
        `KVArena.place`): they read their prompts at the next `match`."""
        place_items(self.indexes, slots, [self.make() for _ in slots])

    def match(self, history: list[list[int]]) -> list[int]:
        """Each index brought up to its row of `history` (lists of token ids; only their new tails are read) -> each
        row's match length."""
        if self.module is not None:
            return self.module.match(self.indexes, history)
        lengths = []
        for index, sequence in zip(self.indexes, history):
            index.extend(sequence[len(index):])
            lengths.append(index.match_length())
        return lengths

    def continuation(self, row: int, count: int) -> list[int]:
        return self.indexes[row].continuation(count)

    def verify_block(self, count: int) -> torch.Tensor:
        """The verify block of a step whose rows all take suffix drafts, int64 [b, 1 + count] on the CPU: each row's
        newest token (its anchor), then `count` tokens of its continuation."""
        if self.module is not None:
            return self.module.verify_block(self.indexes, count)
        return torch.tensor([[index.tokens[-1]] + index.continuation(count) for index in self.indexes])

    def keep_rows(self, rows: list[int]) -> None:
        self.indexes = [self.indexes[i] for i in rows]
