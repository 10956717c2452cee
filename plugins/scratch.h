// Per-thread scratch memory that outlives a kernel call, for both compiled CPU kernel files.
//
// Why: a lone request's verify made ~870 heap allocations, a third of them the MoE's std::vectors (round 27: a probe
// on malloc); each malloc and free runs cold after a step's weights have streamed through the caches.
#pragma once

#include <cstddef>
#include <vector>

namespace dflash_scratch {

// `n` elements of this thread's buffer named `Slot` (any type, e.g. `struct ExpertFloats`), grown as needed and kept:
// its contents are whatever the last call left, so a caller writes before it reads. Two buffers live at once in one
// thread need two slots.
template <typename T, typename Slot>
T* buffer(size_t n) {
  thread_local std::vector<T> storage;
  if (storage.size() < n) storage.resize(n);
  return storage.data();
}

}  // namespace dflash_scratch
