"""A static per-request K/V arena: one contiguous row per request, indexed by absolute position.

Rolling back rejected drafts is free: a request's valid length simply moves back and later writes
overwrite the stale entries (attention masks never read past a query's own position). This is also
why the target keeps full history on its sliding-window layers: transformers' sliding cache keeps
only the last `sliding_window - 1` positions, so a multi-token verify could not be rolled back there.

All layers live in one tensor per K and V ([layers, b, kv_heads, capacity, D]; `k[i]` / `v[i]` are
views of layer i), so a writer that has every layer's K/V at once (the drafter's context) stores them
with one indexed copy.
"""

from __future__ import annotations

import torch

from .linear import cast


class KVArena:
    def __init__(self, num_layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, batch, kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.split()

    def split(self) -> None:
        self.k, self.v = list(self.keys.unbind(0)), list(self.values.unbind(0))
        self.rows = torch.arange(self.keys.shape[1], device=self.keys.device)[:, None]

    def write(self, layer: int, positions: torch.Tensor | int, k: torch.Tensor, v: torch.Tensor) -> None:
        """positions [b, t] (absolute), or an int `start` when every row's tokens go to start, start + 1, ...
        (a lone request); k/v [b, t, kv_heads, D] (token-major, as projections give them)."""
        if isinstance(positions, int):  # one copy into the span: a third of an indexed write's time
            self.k[layer][:, :, positions: positions + k.shape[1]] = k.transpose(1, 2)
            self.v[layer][:, :, positions: positions + v.shape[1]] = v.transpose(1, 2)
            return
        self.k[layer][self.rows, :, positions] = cast(k, self.keys.dtype)
        self.v[layer][self.rows, :, positions] = cast(v, self.values.dtype)

    def write_all(self, positions: torch.Tensor | int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Every layer at once: positions as for `write`; k/v [b, t, layers, kv_heads, D]."""
        if isinstance(positions, int):
            self.keys[:, :, :, positions: positions + k.shape[1]] = k.permute(2, 0, 3, 1, 4)
            self.values[:, :, :, positions: positions + v.shape[1]] = v.permute(2, 0, 3, 1, 4)
            return
        self.keys[:, self.rows, :, positions] = cast(k, self.keys.dtype)
        self.values[:, self.rows, :, positions] = cast(v, self.values.dtype)

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` positions of every row (callers mask what a row may not see)."""
        return self.k[layer][:, :, :length], self.v[layer][:, :, :length]

    def grow(self, capacity: int) -> None:
        """Room for `capacity` positions per row (a longer request joining the batch): the arena is copied once."""
        if capacity <= self.capacity:
            return
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:3], capacity, old.shape[4])
            new[:, :, :, : self.capacity] = old
            setattr(self, name, new)
        self.capacity = capacity
        self.split()

    def place(self, slots: list[int], other: "KVArena") -> None:
        """`other`'s row i into row slots[i] (requests joining a running batch, the same capacity; `place_rows`)."""
        if other.capacity != self.capacity:
            raise ValueError(f"cannot place rows of an arena of {other.capacity} positions in one of {self.capacity}")
        keys = place_rows(self.keys, slots, other.keys, dim=1)
        self.values = place_rows(self.values, slots, other.values, dim=1)
        if keys is not self.keys:  # rows were appended: new tensors, new per-layer views
            self.keys = keys
            self.split()

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop finished requests so the batch stays dense (one copy per finish event)."""
        self.keys, self.values = self.keys[:, rows], self.values[:, rows]
        self.split()


def reused_slots(size: int, slots: list[int]) -> int:
    """How many of `slots` (requests joining a batch of `size` entries) replace entries: those come first, and the
    slots past the batch must follow in order (size, size + 1, ...), to be appended."""
    reused = next((i for i, slot in enumerate(slots) if slot >= size), len(slots))
    if slots[reused:] != list(range(size, size + len(slots) - reused)):
        raise ValueError(f"slots {slots}: entries of the batch ({size}) first, then the next ones in order")
    return reused


def place_items(items: list, slots: list[int], new: list) -> None:
    """`place_rows` for a Python list (per-row state kept outside tensors), in place."""
    reused = reused_slots(len(items), slots)
    for slot, item in zip(slots[:reused], new):
        items[slot] = item
    items.extend(new[reused:])


def place_rows(tensor: torch.Tensor, slots: list[int], rows: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """`rows`' entry i (along `dim`) into entry slots[i] of `tensor` (requests joining a running batch): a slot inside
    `tensor` replaces a finished request's entry in place (one entry copied, not the tensor); the slots past it are
    appended (`reused_slots`) -> the tensor, a new one where entries were appended."""
    reused = reused_slots(tensor.shape[dim], slots)
    if reused:
        tensor.index_copy_(dim, torch.tensor(slots[:reused], device=tensor.device), rows.narrow(dim, 0, reused))
    if reused < len(slots):
        tensor = torch.cat([tensor, rows.narrow(dim, reused, len(slots) - reused)], dim=dim)
    return tensor
