"""A static per-request K/V arena: one contiguous row per request, indexed by absolute position.

Rolling back rejected drafts is free: a request's valid length simply moves back and later writes
overwrite the stale entries (attention masks never read past a query's own position). This is also
why the target keeps full history on its sliding-window layers: transformers' sliding cache keeps
only the last `sliding_window - 1` positions, so a multi-token verify could not be rolled back there.
"""

from __future__ import annotations

import torch


class KVArena:
    def __init__(self, num_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (batch, kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """positions [b, t] (absolute); k/v [b, kv_heads, t, D]."""
        rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
        self.k[layer][rows, :, positions] = k.transpose(1, 2).to(self.k[layer].dtype)
        self.v[layer][rows, :, positions] = v.transpose(1, 2).to(self.v[layer].dtype)

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` positions of every row (callers mask what a row may not see)."""
        return self.k[layer][:, :, :length], self.v[layer][:, :, :length]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop finished requests so the batch stays dense (one copy per finish event)."""
        self.k = [k[rows] for k in self.k]
        self.v = [v[rows] for v in self.v]
