// The register-tile GEMM of the target's CPU kernels (part of cpu_kernel.cpp's module): rows of float32 inputs times a
// weight matrix [in, out] stored as float32, int8 rows (tile by tile), bf16 pairs or AMX tiles, NR rows x NV vectors
// of accumulators a pass. The MoE (moe.h) and the attention's projections (`linear`) share it.
#pragma once

#include <torch/extension.h>

#include "../vector_math.h"
#include "amx_gemm.h"

#include <immintrin.h>

#include <cstdint>

namespace dflash_gemm {


using namespace dflash_vec;
using dflash_vec::load;  // beside the int8 overload below (an overload here would hide it otherwise)
constexpr int64_t kTile = 64;  // a weight tile's columns (int8 experts are stored tile by tile: cpu.py `TILE`)
constexpr int64_t kTail = kSizeMultiple;  // the columns of the tiles after the last whole one (cpu.py `LANES`)
constexpr int64_t kAhead = 16;  // weight rows a tile prefetches ahead
// A GEMM pass: kRows rows times kPassColumns columns of accumulators, held in registers with the pass's weights
#if defined(__AVX512F__)
constexpr int kRows = 4;
constexpr int64_t kPassColumns = 64;  // 16 accumulators, 4 weights of 32 registers
constexpr int kPairRows = 4;  // the same on bf16 pairs: 16 accumulators and 8 widened weights
#else
constexpr int kRows = 2;
constexpr int64_t kPassColumns = 32;  // 8 accumulators, 4 weights of 16 (AVX2; 4 rows or 64 columns spilled, round 23)
constexpr int kPairRows = 3;  // bf16 pairs: 3 rows the fastest from 1 to 16 rows though 12 + 8 vectors spill (round 24)
#endif
inline fvec load(const int8_t* p) {  // int8 -> float32, exactly
#if defined(__AVX512F__)
  return reinterpret_cast<fvec>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  return reinterpret_cast<fvec>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else  // an x86-64 CPU without AVX2: whatever the compiler makes of it, so that the module still builds
  typedef int8_t bytes_u __attribute__((vector_size(kLanes), aligned(1)));
  return __builtin_convertvector(*reinterpret_cast<const bytes_u*>(p), fvec);
#endif
}

// y[r][c0 : c0 + NV kLanes] = x[r] @ w[:, c0 : ...] (+ bias) for NR rows: one pass over the weight tile, NR x NV
// accumulators in registers. `w` points at the tile's first column, input rows `ld` apart: the matrix's width, or
// the tile's own where the matrix is stored tile by tile (`tile_major`).
template <int NR, int NV, typename W>
void tile(const float* const* x, int64_t in, const W* w, int64_t ld, const float* bias, float* const* y, int64_t c0) {
  fvec acc[NR][NV] = {};
  constexpr int64_t kLine = 64 / sizeof(W);  // weights per cache line
  for (int64_t h = 0; h < in; ++h) {
    // a tile reads one short run per weight row, rows `ld` apart: fetch a few rows ahead, which the hardware
    // prefetcher does not do for such strides (a lone token's experts come from memory: -35% of their time)
    for (int64_t e = 0; e < NV * kLanes; e += kLine) __builtin_prefetch(w + (h + kAhead) * ld + e);
    fvec wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = load(w + h * ld + v * kLanes);
    for (int r = 0; r < NR; ++r) {
      const fvec xs = splat(x[r][h]);
      for (int v = 0; v < NV; ++v) acc[r][v] = fmadd(xs, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v)
      store(y[r] + c0 + v * kLanes, bias ? acc[r][v] + load(bias + c0 + v * kLanes) : acc[r][v]);
}

// A matrix [in, out] in bf16, two input rows a word (cpu.py `Bf16Pairs`): word [p][c] holds w[2p][c] in its low
// half and w[2p + 1][c] in its high half, so one load and a shift and a mask widen two weight vectors, where a bf16
// matrix [in, out] costs a widening load and a shift each (a q/k/v GEMM 0.6x the time, at 1 row as at 8, on an
// AVX2 EPYC; round 24). The products and the order of the sums are the plain tile's.
struct Bf16Pairs {
  const uint32_t* words;
};

template <int NR, int NV>
void tile(const float* const* x, int64_t in, Bf16Pairs w, int64_t ld, const float* bias, float* const* y,
          int64_t c0) {
  fvec acc[NR][NV] = {};
  const ivec high_half = ivec{} + static_cast<int32_t>(0xFFFF0000u);
  for (int64_t h = 0; h < in; h += 2) {
    const uint32_t* row = w.words + h / 2 * ld;
    for (int64_t e = 0; e < NV * kLanes; e += 16) __builtin_prefetch(row + kAhead / 2 * ld + e);
    fvec even[NV], odd[NV];
    for (int v = 0; v < NV; ++v) {
      const ivec word = reinterpret_cast<ivec>(load(reinterpret_cast<const float*>(row + v * kLanes)));
      even[v] = reinterpret_cast<fvec>(word << 16);
      odd[v] = reinterpret_cast<fvec>(word & high_half);
    }
    for (int r = 0; r < NR; ++r) {
      const fvec xe = splat(x[r][h]), xo = splat(x[r][h + 1]);
      for (int v = 0; v < NV; ++v) acc[r][v] = fmadd(xo, odd[v], fmadd(xe, even[v], acc[r][v]));
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v)
      store(y[r] + c0 + v * kLanes, bias ? acc[r][v] + load(bias + c0 + v * kLanes) : acc[r][v]);
}

// One column tile for every row, NR rows at a time (the tile stays in cache between row blocks). `W`: a weight
// pointer at the tile's first column, or `Bf16Pairs` there.
template <int NV, int NR = kRows, typename W>
void rows_tile(const float* const* x, int64_t rows, int64_t in, W w, int64_t ld, const float* bias,
               float* const* y, int64_t c0) {
  int64_t r0 = 0;
  for (; r0 + NR <= rows; r0 += NR) tile<NR, NV>(x + r0, in, w, ld, bias, y + r0, c0);
  if constexpr (NR > 1)
    if (r0 < rows) rows_tile<NV, NR - 1>(x + r0, rows - r0, in, w, ld, bias, y + r0, c0);
}

// Rows x[r] [in] (any addresses) times w [in, out] plus bias [out] (or none) -> y[r] [out], columns
// [c_begin, c_end) (multiples of 16). `tile_major`: w stored tile by tile (64 columns, then 16 at a time), each
// tile's rows contiguous, so a tile streams from memory instead of reading a short run every `out` weights (then
// [c_begin, c_end) must be whole tiles).
template <typename W>
void linear_rows(const float* const* x, int64_t rows, int64_t in, const W* w, int64_t out, const float* bias,
                 float* const* y, int64_t c_begin, int64_t c_end, bool tile_major = false) {
  const auto at = [&](int64_t c0, int64_t width) {  // a tile: its first weight, its row stride, its passes
    const W* first = tile_major ? w + c0 * in : w + c0;
    const int64_t ld = tile_major ? width : out;
    int64_t v = 0;
    for (; v + kPassColumns <= width; v += kPassColumns)
      rows_tile<kPassColumns / kLanes>(x, rows, in, first + v, ld, bias, y, c0 + v);
    for (; v < width; v += kLanes) rows_tile<1>(x, rows, in, first + v, ld, bias, y, c0 + v);
  };
  int64_t c0 = c_begin;
  for (; c0 + kTile <= c_end; c0 += kTile) at(c0, kTile);
  for (; c0 < c_end; c0 += kTail) at(c0, kTail);
}

// The same on bf16 pairs (`tile_major` does not apply).
void linear_rows(const float* const* x, int64_t rows, int64_t in, Bf16Pairs w, int64_t out, const float* bias,
                 float* const* y, int64_t c_begin, int64_t c_end, bool = false) {
  int64_t c0 = c_begin;
  for (; c0 + kPassColumns <= c_end; c0 += kPassColumns)
    rows_tile<kPassColumns / kLanes, kPairRows>(x, rows, in, Bf16Pairs{w.words + c0}, out, bias, y, c0);
  for (; c0 < c_end; c0 += kLanes) rows_tile<1, kPairRows>(x, rows, in, Bf16Pairs{w.words + c0}, out, bias, y, c0);
}

// The same on AMX tiles (`amx_gemm.h`; `tile_major` does not apply: the tiles are their own layout).
void linear_rows(const float* const* x, int64_t rows, int64_t in, dflash_amx::Tiles w, int64_t /* out */,
                 const float* bias, float* const* y, int64_t c_begin, int64_t c_end, bool = false) {
  dflash_amx::rows_times(x, rows, in, w, bias, y, c_begin, c_end);
}

}  // namespace dflash_gemm
