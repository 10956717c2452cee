// Float32 GEMMs of the target on Intel AMX tiles, exactly (part of cpu_kernel.cpp's module; plugins/target/cpu.py
// packs the weights: `amx_tiles`).
//
// Why: a verify's expert and attention GEMMs run at the float32 FMA rate (~55 GFLOP/s on one core), which makes an
// 8-token verify ~1.9x an AR step; an AMX tile multiply takes 16 x 32 bf16 products per row in one instruction. Bf16
// inputs would change the target's numbers, so each float32 input x is split into three bf16 parts x1 + x2 + x3 = x
// exactly (each holds 8 of x's 24 significant bits: x1 = bf16(x), x2 = bf16(x - x1), x3 = x - x1 - x2), and the
// weights are the checkpoint's bf16 values (MXFP4 experts and bf16 dense weights are exact in bf16). Every product
// x_i w is then exact in float32 and the tiles sum them in float32: the float32 GEMM's result up to summation order,
// like every float32 GEMM here. (Inputs below float32's normal range, < 1e-38, are flushed by the conversion: ~1e-38
// off, as `RowInt8`'s tiny-input caveat.) A row's numbers do not depend on the other rows of its tile.
#pragma once

#include <torch/extension.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "../amx_tiles.h"
#include "../scratch.h"

#if defined(DFLASH_AMX_TILES) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define DFLASH_AMX 1
#endif

namespace dflash_amx {

constexpr int64_t kTileRows = 16;  // rows (tokens) of an A or C tile
constexpr int64_t kTileK = 32;     // bf16 inputs along the reduction per A-tile row, two per 32-bit lane
constexpr int64_t kTileCols = 16;  // float32 columns of a C tile
constexpr int64_t kTileSize = kTileK * kTileCols;  // bf16 weights per B tile

// A matrix [in, out] packed by `amx_tiles`: B tiles [out / 16][in / 32][16][32], tile row p holding rows 2p and 2p + 1
// of its 32-row slice side by side for each of its 16 columns (AMX's pairs layout). `+` offsets like a pointer.
struct Tiles {
  const uint16_t* data;
  Tiles operator+(int64_t offset) const { return {data + offset}; }
};

#ifdef DFLASH_AMX
// Whether this build and CPU run the AMX-BF16 GEMM: built for it and the tiles granted (`amx_tiles.h`).
inline bool available() { return dflash_tiles::granted(); }

inline __m512 widen(__m256bh parts) {  // bf16 -> float32: the bits moved to the top half
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i&>(parts)), 16));
}

// x [in] -> parts[0..2] [in] in bf16 with parts[0] + parts[1] + parts[2] == x.
inline void split(const float* x, int64_t in, uint16_t* const* parts) {
  for (int64_t h = 0; h < in; h += 16) {
    __m512 rest = _mm512_loadu_ps(x + h);
    for (int i = 0; i < 3; ++i) {
      const __m256bh part = _mm512_cvtneps_pbh(rest);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(parts[i] + h), reinterpret_cast<const __m256i&>(part));
      rest = _mm512_sub_ps(rest, widen(part));
    }
  }
}

// Rows x[r] [in] (any addresses) times w [in, out] (`Tiles`) plus bias [out] (or none) -> y[r] [out], columns
// [c_begin, c_end) (multiples of 16); in a multiple of 32. The inputs' parts are stacked as 3 x rows rows (part i of
// row r at row i x rows + r), multiplied 16 rows and 3 column tiles at a time, and each output row is then the sum of
// its three parts' rows, the largest part first. On a Xeon VM with AMX a tile load took ~23 ns and a tile multiply
// ~15 ns, not overlapped: a B tile is loaded once per 16 stacked rows, which bounds a lone token's GEMM by its weight
// tiles' loads (~6 us for 256 x 512), still ~0.4x the float32 FMA kernel's time; ~0.3x at 8 tokens (round 22).
inline void rows_times(const float* const* x, int64_t rows, int64_t in, Tiles w, const float* bias, float* const* y,
                       int64_t c_begin, int64_t c_end) {
  const int64_t chunks = in / kTileK, stacked = 3 * rows, width = c_end - c_begin;
  const int64_t bytes = in * static_cast<int64_t>(sizeof(uint16_t));  // between the stacked rows
  uint16_t* const parts = dflash_scratch::buffer<uint16_t, struct AmxParts>(stacked * in);  // every entry is written
  float* const sums = dflash_scratch::buffer<float, struct AmxSums>(stacked * width);
  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* const row_parts[3] = {&parts[r * in], &parts[(rows + r) * in], &parts[(2 * rows + r) * in]};
    split(x[r], in, row_parts);
  }
  for (int64_t m0 = 0; m0 < stacked; m0 += kTileRows) {
    dflash_tiles::configure(std::min(kTileRows, stacked - m0));
    const uint16_t* a = parts + m0 * in;
    for (int64_t c0 = c_begin; c0 < c_end; c0 += 3 * kTileCols) {
      const int64_t group = std::min<int64_t>(3, (c_end - c0) / kTileCols);
      const uint16_t* b = w.data + c0 / kTileCols * chunks * kTileSize;  // column tile c0 / 16, row slice 0
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      for (int64_t chunk = 0; chunk < chunks; ++chunk, b += kTileSize) {
        // the weight tiles two slices ahead (a tile load waits on every line it misses; the hardware prefetcher
        // does not follow three interleaved streams)
        for (int64_t j = 0; j < group; ++j)
          for (int64_t line = 0; line < kTileSize; line += 32)
            __builtin_prefetch(b + j * chunks * kTileSize + 2 * kTileSize + line);
        _tile_loadd(3, a + chunk * kTileK, bytes);
        _tile_loadd(4, b, 64);
        if (group > 1) _tile_loadd(5, b + chunks * kTileSize, 64);
        if (group > 2) _tile_loadd(6, b + 2 * chunks * kTileSize, 64);
        _tile_dpbf16ps(0, 3, 4);
        if (group > 1) _tile_dpbf16ps(1, 3, 5);
        if (group > 2) _tile_dpbf16ps(2, 3, 6);
      }
      float* c = sums + m0 * width + (c0 - c_begin);
      const int64_t stride = width * static_cast<int64_t>(sizeof(float));
      _tile_stored(0, c, stride);
      if (group > 1) _tile_stored(1, c + kTileCols, stride);
      if (group > 2) _tile_stored(2, c + 2 * kTileCols, stride);
    }
  }
  _tile_release();
  for (int64_t r = 0; r < rows; ++r) {
    const float *p0 = &sums[r * width], *p1 = &sums[(rows + r) * width], *p2 = &sums[(2 * rows + r) * width];
    for (int64_t c = 0; c < width; c += kTileCols) {
      __m512 v = _mm512_add_ps(_mm512_add_ps(_mm512_loadu_ps(p0 + c), _mm512_loadu_ps(p1 + c)), _mm512_loadu_ps(p2 + c));
      if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + c_begin + c));
      _mm512_storeu_ps(y[r] + c_begin + c, v);
    }
  }
}

#else
inline bool available() { return false; }

inline void rows_times(const float* const*, int64_t, int64_t, Tiles, const float*, float* const*, int64_t, int64_t) {
  TORCH_CHECK(false, "this build has no AMX-BF16 GEMM (the CPU lacks the instructions)");
}
#endif

}  // namespace dflash_amx
