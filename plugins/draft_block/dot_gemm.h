// The drafter's GEMMs on CPUs with AVX512 dot products (part of cpu_kernel.cpp's module; models/linear.py
// `CastLinear` calls it for a bf16 or int8 GEMM, and the whole compiled draft step for each of its GEMMs).
//
// Why: a drafter step's GEMMs have 1 to ~16 rows (a block per request), where oneDNN's bf16 call costs ~25 us more
// than its arithmetic and fbgemm's float16 one multiplies at float32's rate. A call here costs a few microseconds,
// and its products are narrower than float32's: drafts need not be exact (the target verifies them).
// - bf16 (AVX512-BF16): `vdpbf16ps` multiplies bf16 pairs into float32 sums at twice the FMA's rate; the inputs are
//   rounded to bf16 (nearest even) per call, the weights are bf16 copies. On an AVX2 CPU the same products (exact in
//   float32) go through FMAs (`fma_multiply`), so the drafter's whole compiled step runs there too.
// - int8 (AVX512-VNNI): `vpdpbusd` multiplies groups of four bytes into int32 sums at twice bf16's rate again, from
//   half its weight bytes. Each input row is quantized per call, symmetrically to [-127, 127] with its own scale;
//   each output column's weights once, with theirs, and stored offset by +128 (the instruction takes one unsigned
//   operand), which the epilogue takes back out: sum (qw + 128) qx = sum qw qx + 128 sum qx. On an AVX2 CPU the same
//   layout goes through `vpmaddubsw` (pairs of products into 16-bit sums, which saturate) and `vpmaddwd` (those into
//   32-bit ones): the inputs then lie in [-63, 63] (`kInputLevels`), so no 16-bit sum can saturate. On a CPU with
//   AMX-INT8, calls of 4 rows or more take the same products on AMX tiles (`tile_multiply`), bit for bit.
//
// Layout: the weight W [out, in] is packed once (`dot_pack` in cpu.py) as [out / 16, in / k, 16, k] (k = 2 bf16 or
// 4 bytes: one 32-bit word): for each group of 16 output columns, its words of input rows one after another, so a
// tile streams each group's weights contiguously and one 64-byte load holds 16 columns' words, the operand the
// instruction takes.

#pragma once

#include <torch/extension.h>

#include "../amx_tiles.h"
#include "../scratch.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace dflash_dot {

constexpr int64_t kGroup = 16;  // output columns per packed group (one vector of sums)

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kBuilt = true;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr bool kBuilt = true;  // the same GEMM through FMAs (`fma_multiply`)
#define DFLASH_BF16_BY_FMA 1
#else
constexpr bool kBuilt = false;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kInt8Built = true;
constexpr int kInputLevels = 127;  // an input row's bytes lie in [-kInputLevels, kInputLevels]
#elif defined(__AVX2__)
constexpr bool kInt8Built = true;  // the same GEMM through `vpmaddubsw` (`madd_multiply`)
constexpr int kInputLevels = 63;  // its 16-bit sums of two products, at most 2 x 255 x 63, cannot saturate
#define DFLASH_INT8_BY_MADD 1
#else
constexpr bool kInt8Built = false;
constexpr int kInputLevels = 127;
#endif

// What turns a tile's sums into outputs, from the tile's first row on.
struct Epilogue {
  const float* bias;        // [out] or null
  const float* col_scale;   // int8: [out] the weight columns' scales
  const float* row_scale;   // int8: per input row, its scale
  const int32_t* row_offset;  // int8: per input row, 128 x the sum of its quantized inputs

  Epilogue from_row(int64_t r) const {
    return {bias, col_scale, row_scale ? row_scale + r : nullptr, row_offset ? row_offset + r : nullptr};
  }
};

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// bf16 pairs, float32 sums.
struct Bf16Products {
  static constexpr int64_t kPerWord = 2;
  using Sums = __m512;
  static Sums zero() { return _mm512_setzero_ps(); }
  static Sums add(Sums acc, __m512i x, __m512i w) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(x), reinterpret_cast<__m512bh>(w));
  }
  static void store(Sums acc, const Epilogue& e, int r, int64_t col, float* y) {
    (void)r;
    if (e.bias) acc = _mm512_add_ps(acc, _mm512_loadu_ps(e.bias + col));
    _mm512_storeu_ps(y, acc);
  }
};

// x [in] float32 -> in / 2 bf16 pairs (as 32-bit words), rounded to nearest even; in a multiple of 32.
inline void to_pairs(const float* x, int64_t in, uint32_t* words) {
  for (int64_t i = 0; i < in; i += 32) {
    const __m512bh p = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
    _mm512_storeu_si512(words + i / 2, reinterpret_cast<__m512i>(p));
  }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Unsigned weight bytes (offset by 128) times signed input bytes, int32 sums.
struct Int8Products {
  static constexpr int64_t kPerWord = 4;
  using Sums = __m512i;
  static Sums zero() { return _mm512_setzero_si512(); }
  static Sums add(Sums acc, __m512i x, __m512i w) { return _mm512_dpbusd_epi32(acc, w, x); }
  static void store(Sums acc, const Epilogue& e, int r, int64_t col, float* y) {
    const __m512i exact = _mm512_sub_epi32(acc, _mm512_set1_epi32(e.row_offset[r]));
    const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(e.row_scale[r]), _mm512_loadu_ps(e.col_scale + col));
    const __m512 sums = _mm512_cvtepi32_ps(exact);  // one FMA, not a product the compiler may or may not fuse
    _mm512_storeu_ps(y, e.bias ? _mm512_fmadd_ps(sums, scale, _mm512_loadu_ps(e.bias + col))
                               : _mm512_mul_ps(sums, scale));
  }
};

// x [in] float32 -> in / 4 words of signed bytes round(x / scale), scale = max |x| / 127 (1 for a zero row); returns
// the scale and sets `offset` to 128 x the bytes' sum. in a multiple of 32.
inline float to_bytes(const float* x, int64_t in, uint32_t* words, int32_t* offset) {
  __m512 peak = _mm512_setzero_ps();
  for (int64_t i = 0; i < in; i += 16) peak = _mm512_max_ps(peak, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  const float amax = _mm512_reduce_max_ps(peak);
  const float scale = amax > 0.f ? amax / 127.f : 1.f;
  const __m512 inverse = _mm512_set1_ps(1.f / scale);
  __m512i sum = _mm512_setzero_si512();
  for (int64_t i = 0; i < in; i += 16) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), inverse));  // nearest even
    sum = _mm512_add_epi32(sum, q);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(words + i / 4), _mm512_cvtsepi32_epi8(q));
  }
  *offset = 128 * _mm512_reduce_add_epi32(sum);
  return scale;
}
#endif

#if defined(__AVX512F__)
// y[r][16 g0 : 16 (g0 + NG)] for NR rows: one pass over NG packed groups, NR x NG sums in registers. x: NR rows of
// `words` input words; w: the first group's packed weights, `group_stride` words apart.
template <class P, int NR, int NG>
void tile(const uint32_t* x, int64_t words, const uint32_t* w, int64_t group_stride, const Epilogue& e,
          int64_t col, float* y, int64_t out) {
  typename P::Sums acc[NR][NG];
  for (int r = 0; r < NR; ++r)
    for (int g = 0; g < NG; ++g) acc[r][g] = P::zero();
  for (int64_t p = 0; p < words; ++p) {
    __m512i wv[NG];
    for (int g = 0; g < NG; ++g) wv[g] = _mm512_loadu_si512(w + g * group_stride + p * kGroup);
    for (int r = 0; r < NR; ++r) {
      const __m512i xv = _mm512_set1_epi32(static_cast<int>(x[r * words + p]));
      for (int g = 0; g < NG; ++g) acc[r][g] = P::add(acc[r][g], xv, wv[g]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int g = 0; g < NG; ++g) P::store(acc[r][g], e, r, col + g * kGroup, y + r * out + g * kGroup);
}

// Groups [first, last) for NR rows, NG groups a tile (the register budget: NR x NG sums, NG weights, one input),
// a last tile of single groups.
template <class P, int NR, int NG>
void groups(const uint32_t* x, int64_t words, const uint32_t* w, const Epilogue& e, float* y, int64_t out,
            int64_t first, int64_t last) {
  const int64_t stride = words * kGroup;
  int64_t g = first;
  for (; g + NG <= last; g += NG) tile<P, NR, NG>(x, words, w + g * stride, stride, e, g * kGroup, y + g * kGroup, out);
  for (; g < last; ++g) tile<P, NR, 1>(x, words, w + g * stride, stride, e, g * kGroup, y + g * kGroup, out);
}

// Up to 8 rows at a time: 4 groups a tile for up to 4 rows, 2 for 5 to 8 (at most 16 sums).
template <class P, int NR>
void rows_at(const uint32_t* x, int64_t words, const uint32_t* w, const Epilogue& e, float* y, int64_t out,
             int64_t first, int64_t last) {
  if constexpr (NR <= 4)
    groups<P, NR, 4>(x, words, w, e, y, out, first, last);
  else
    groups<P, NR, 2>(x, words, w, e, y, out, first, last);
}

template <class P>
void block_rows(int64_t rows, const uint32_t* x, int64_t words, const uint32_t* w, const Epilogue& e, float* y,
                int64_t out, int64_t first, int64_t last) {
  switch (rows) {
    case 1: return rows_at<P, 1>(x, words, w, e, y, out, first, last);
    case 2: return rows_at<P, 2>(x, words, w, e, y, out, first, last);
    case 3: return rows_at<P, 3>(x, words, w, e, y, out, first, last);
    case 4: return rows_at<P, 4>(x, words, w, e, y, out, first, last);
    case 5: return rows_at<P, 5>(x, words, w, e, y, out, first, last);
    case 6: return rows_at<P, 6>(x, words, w, e, y, out, first, last);
    case 7: return rows_at<P, 7>(x, words, w, e, y, out, first, last);
    default: return rows_at<P, 8>(x, words, w, e, y, out, first, last);
  }
}

// Every row of x (`rows` x `words` input words) times the packed weight: each thread takes a span of column groups,
// 8 groups at a time for all rows, 8 rows at a time, so a chunk's weights are read from memory once and from cache
// for the next 8 rows.
template <class P>
void multiply(int64_t rows, const uint32_t* x, int64_t words, const uint32_t* w, const Epilogue& e, float* y,
              int64_t out) {
  at::parallel_for(0, out / kGroup, 8, [&](int64_t first, int64_t last) {
    for (int64_t chunk = first; chunk < last; chunk += 8)
      for (int64_t r = 0; r < rows; r += 8)
        block_rows<P>(std::min<int64_t>(8, rows - r), x + r * words, words, w, e.from_row(r), y + r * out, out, chunk,
                      std::min(chunk + 8, last));
  });
}

#endif

#if defined(DFLASH_AMX_TILES) && defined(__AMX_INT8__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define DFLASH_AMX_INT8 1

// Whether `dot_linear` takes the int8 tiles where it can: `set_int8_tiles` says, which plugins/draft_block/cpu.py
// calls as it loads the module (false under TRTLLM_DFLASH_AMX=0) and an A/B timing calls to compare.
inline bool& int8_tiles_wanted() {
  static bool wanted = true;
  return wanted;
}

constexpr int64_t kTileMinRows = 4;  // fewer rows: the AVX512 tiles win (a tile's weight loads serve too few rows)

// The int8 GEMM on AMX tiles: the same packed weights (a group's 16 input words for its 16 columns are one B tile of
// 16 rows x 64 bytes) times up to 16 input rows at a time, 3 column groups a pass, the same int32 sums as
// `Int8Products` and its epilogue, so the same float32 outputs bit for bit. `words` a multiple of 16. On a Xeon VM
// with AMX, drafter shapes, hot caches: 0.6-0.9x the AVX512 time at 4 rows, 0.4-0.7x at 8, 0.35-0.55x at 16; no gain
// inside a lone request's drafter step, which streams its weights from L3 whichever unit multiplies (round 26).
inline void tile_multiply(int64_t rows, const uint32_t* x, int64_t words, const uint32_t* w, const Epilogue& e,
                          float* y, int64_t out) {
  const int64_t chunks = words / 16, group_bytes = words * 64, row_bytes = words * 4;
  at::parallel_for(0, out / kGroup, 3, [&](int64_t first, int64_t last) {
    alignas(64) int32_t sums[16 * 48];  // a pass's 16 rows x 3 groups
    for (int64_t m0 = 0; m0 < rows; m0 += 16) {
      const int64_t m = std::min<int64_t>(16, rows - m0);
      dflash_tiles::configure(m);
      const uint8_t* a = reinterpret_cast<const uint8_t*>(x + m0 * words);
      const Epilogue em = e.from_row(m0);
      for (int64_t g = first; g < last; g += 3) {
        const int64_t n = std::min<int64_t>(3, last - g);
        const uint8_t* b = reinterpret_cast<const uint8_t*>(w) + g * group_bytes;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        for (int64_t c = 0; c < chunks; ++c) {
          _tile_loadd(3, a + c * 64, row_bytes);
          _tile_loadd(4, b + c * 1024, 64);
          if (n > 1) _tile_loadd(5, b + group_bytes + c * 1024, 64);
          if (n > 2) _tile_loadd(6, b + 2 * group_bytes + c * 1024, 64);
          _tile_dpbsud(0, 3, 4);  // signed inputs times unsigned weights, as `vpdpbusd`
          if (n > 1) _tile_dpbsud(1, 3, 5);
          if (n > 2) _tile_dpbsud(2, 3, 6);
        }
        _tile_stored(0, sums, 192);
        if (n > 1) _tile_stored(1, sums + 16, 192);
        if (n > 2) _tile_stored(2, sums + 32, 192);
        for (int64_t r = 0; r < m; ++r)
          for (int64_t j = 0; j < n; ++j)
            Int8Products::store(_mm512_load_si512(sums + r * 48 + j * 16), em, static_cast<int>(r), (g + j) * kGroup,
                                y + (m0 + r) * out + (g + j) * kGroup);
      }
    }
    _tile_release();
  });
}
#endif

#if defined(DFLASH_INT8_BY_MADD) || defined(DFLASH_BF16_BY_FMA)
// The AVX2 GEMMs' walk: each thread a span of column groups, 8 groups at a time for all rows, kMostRows (3 or 4) rows
// at a time (the chunk's weights stay in cache for the next rows); `tile(std::integral_constant<int, NR>, r, g)`
// multiplies rows r .. r + NR - 1 by group g.
template <int kMostRows, class Tile>
void walk_groups(int64_t rows, int64_t out, const Tile& tile) {
  static_assert(kMostRows == 3 || kMostRows == 4);
  at::parallel_for(0, out / kGroup, 8, [&](int64_t first, int64_t last) {
    for (int64_t chunk = first; chunk < last; chunk += 8)
      for (int64_t r = 0; r < rows; r += kMostRows)
        for (int64_t g = chunk; g < std::min(chunk + 8, last); ++g) switch (std::min<int64_t>(kMostRows, rows - r)) {
            case 4:
              if constexpr (kMostRows == 4) tile(std::integral_constant<int, 4>{}, r, g);
              break;
            case 3: tile(std::integral_constant<int, 3>{}, r, g); break;
            case 2: tile(std::integral_constant<int, 2>{}, r, g); break;
            default: tile(std::integral_constant<int, 1>{}, r, g); break;
          }
  });
}
#endif

#if defined(DFLASH_INT8_BY_MADD)
// x [in] float32 -> in / 4 words of signed bytes round(x / scale), scale = max |x| / kInputLevels (1 for a zero row);
// returns the scale and sets `offset` to 128 x the bytes' sum. in a multiple of 32.
inline float to_bytes(const float* x, int64_t in, uint32_t* words, int32_t* offset) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 peak = _mm256_setzero_ps();
  for (int64_t i = 0; i < in; i += 8) peak = _mm256_max_ps(peak, _mm256_and_ps(_mm256_loadu_ps(x + i), magnitude));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, peak);
  const float amax = *std::max_element(lanes, lanes + 8);
  const float scale = amax > 0.f ? amax / kInputLevels : 1.f;
  const __m256 inverse = _mm256_set1_ps(1.f / scale);
  __m256i sum = _mm256_setzero_si256();
  for (int64_t i = 0; i < in; i += 8) {
    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), inverse));  // nearest even
    sum = _mm256_add_epi32(sum, q);
    const __m256i halves = _mm256_packs_epi32(q, q);
    const __m256i bytes = _mm256_packs_epi16(halves, halves);  // per 128-bit half: its 4 bytes first
    words[i / 4] = static_cast<uint32_t>(_mm256_extract_epi32(bytes, 0));
    words[i / 4 + 1] = static_cast<uint32_t>(_mm256_extract_epi32(bytes, 4));
  }
  alignas(32) int32_t sums[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(sums), sum);
  int32_t total = 0;
  for (const int32_t v : sums) total += v;
  *offset = 128 * total;
  return scale;
}

// y[r][col : col + 16] for NR rows from one packed int8 group (`words` words per column): 2 x NR int32 sums of 8
// columns in registers, each step a word of 4 inputs: `vpmaddubsw` (weight bytes unsigned, input bytes signed) into
// 16-bit pair sums, `vpmaddwd` by ones into the 32-bit sum of the four, as `vpdpbusd` gives it.
template <int NR>
void madd_tile(const uint32_t* x, int64_t words, const uint32_t* w, const Epilogue& e, int64_t col, float* y,
               int64_t out) {
  __m256i acc[NR][2];
  for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t p = 0; p < words; ++p)
    for (int h = 0; h < 2; ++h) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * kGroup + h * 8));
      for (int r = 0; r < NR; ++r) {
        const __m256i xv = _mm256_set1_epi32(static_cast<int>(x[r * words + p]));
        acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones));
      }
    }
  for (int r = 0; r < NR; ++r) {
    const __m256 row_scale = _mm256_set1_ps(e.row_scale[r]);
    for (int h = 0; h < 2; ++h) {
      const __m256i exact = _mm256_sub_epi32(acc[r][h], _mm256_set1_epi32(e.row_offset[r]));
      __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(exact),
                               _mm256_mul_ps(row_scale, _mm256_loadu_ps(e.col_scale + col + h * 8)));
      if (e.bias) v = _mm256_add_ps(v, _mm256_loadu_ps(e.bias + col + h * 8));
      _mm256_storeu_ps(y + r * out + col + h * 8, v);
    }
  }
}

// Rows a `madd_tile` takes at most: 3 (4 rows' tile ran the head's 4 rows in 1.6x the time of 3 rows', round 25).
constexpr int kMaddRows = 3;

// Every row of x (`rows` x `words` input words) times the packed int8 weight.
inline void madd_multiply(int64_t rows, const uint32_t* x, int64_t words, const uint32_t* w, const Epilogue& e,
                          float* y, int64_t out) {
  walk_groups<kMaddRows>(rows, out, [&](auto nr, int64_t r, int64_t g) {
    madd_tile<decltype(nr)::value>(x + r * words, words, w + g * words * kGroup, e.from_row(r), g * kGroup,
                                   y + r * out, out);
  });
}
#endif

#if defined(DFLASH_BF16_BY_FMA)
// The bf16 GEMM where the CPU has no bf16 dot product (AVX2): the same products, each exact in float32 (8-bit
// mantissas), summed by FMAs into float32 at the FMA's rate instead of twice it. The packed layout is the AVX512
// kernel's: a word holds inputs 2p (low half) and 2p + 1 (high half) of one column, widened by a shift and a mask.

// x [in] float32 -> the same rounded to bf16 (nearest even; a NaN may come back as an infinity), kept as float32.
inline void to_bf16_floats(const float* x, int64_t in, float* out) {
  const __m256i bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1), high = _mm256_set1_epi32(-65536);
  for (int64_t i = 0; i < in; i += 8) {
    const __m256i bits = _mm256_castps_si256(_mm256_loadu_ps(x + i));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
    const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(bias, odd)), high);
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(rounded));
  }
}

// y[r][col : col + 16] for NR rows from one packed group (`pairs` words per column, 16 columns a pair): 2 x NR sums
// of 8 columns in registers. (Separate sums for the even and the odd inputs, to halve each sum's chain of dependent
// FMAs, spilled 3 rows' 12 sums and ran at half the rate, round 23.)
template <int NR>
void fma_tile(const float* x, int64_t in, const uint32_t* w, int64_t pairs, const float* bias, int64_t col, float* y,
              int64_t out) {
  __m256 acc[NR][2];
  for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(-65536);
  for (int64_t p = 0; p < pairs; ++p)
    for (int h = 0; h < 2; ++h) {
      const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * kGroup + h * 8));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(words, high));
      for (int r = 0; r < NR; ++r) {
        acc[r][h] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * in + 2 * p), even, acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * in + 2 * p + 1), odd, acc[r][h]);
      }
    }
  for (int r = 0; r < NR; ++r)
    for (int h = 0; h < 2; ++h) {
      __m256 v = acc[r][h];
      if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + col + h * 8));
      _mm256_storeu_ps(y + r * out + col + h * 8, v);
    }
}

// Every row of x (bf16-rounded float32 rows of `in`) times the packed weight.
inline void fma_multiply(int64_t rows, const float* x, int64_t in, const uint32_t* w, const float* bias, float* y,
                         int64_t out) {
  const int64_t pairs = in / 2;
  walk_groups<4>(rows, out, [&](auto nr, int64_t r, int64_t g) {
    fma_tile<decltype(nr)::value>(x + r * in, in, w + g * pairs * kGroup, pairs, bias, g * kGroup, y + r * out, out);
  });
}
#endif

}  // namespace dflash_dot

// Whether this build has the bf16 / int8 GEMM (built with -march=native: a CPU with AVX512-BF16 or AVX2 and FMA /
// AVX512-VNNI or AVX2); `dot_linear` raises where not. And the int8 GEMM's input levels (`kInputLevels`).
inline bool dot_available() { return dflash_dot::kBuilt; }
inline bool dot_int8_available() { return dflash_dot::kInt8Built; }
inline int64_t dot_int8_input_levels() { return dflash_dot::kInputLevels; }
#if defined(DFLASH_AMX_INT8)
inline bool dot_int8_tiles_available() { return dflash_dot::int8_tiles_wanted() && dflash_tiles::granted(); }
inline void set_int8_tiles(bool on) { dflash_dot::int8_tiles_wanted() = on; }
#else
inline bool dot_int8_tiles_available() { return false; }
inline void set_int8_tiles(bool) {}
#endif

// x float32 [..., in] (contiguous) times the packed weight plus bias float32 [out] or None -> float32 [..., out]; in a
// multiple of 32. The weight: bf16 [out / 16, in / 2, 16, 2], or uint8 [out / 16, in / 4, 16, 4] (quantized + 128)
// with `scales` float32 [out], its columns' scales. Column groups split over torch's intra-op threads.
inline torch::Tensor dot_linear(const torch::Tensor& x, const torch::Tensor& packed,
                                const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& scales) {
  using namespace dflash_dot;
  const bool int8 = packed.scalar_type() == torch::kUInt8;
  TORCH_CHECK(int8 ? kInt8Built : kBuilt, "this build has no ", int8 ? "int8" : "bf16",
              " GEMM (the CPU lacks the instructions)");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 CPU tensor");
  const int64_t per_word = int8 ? 4 : 2;
  TORCH_CHECK((int8 || packed.scalar_type() == torch::kBFloat16) && packed.dim() == 4 && packed.size(2) == kGroup &&
                  packed.size(3) == per_word && packed.is_contiguous(),
              "the weight must be packed bf16 [out / 16, in / 2, 16, 2] or uint8 [out / 16, in / 4, 16, 4]");
  const int64_t out = packed.size(0) * kGroup, in = packed.size(1) * per_word;
  TORCH_CHECK(x.size(-1) == in, "x's last dimension (", x.size(-1), ") must be the weight's input width (", in, ")");
  TORCH_CHECK(in % 32 == 0, "the input width must be a multiple of 32");
  Epilogue e{nullptr, nullptr, nullptr, nullptr};
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == out,
                "bias must be float32 [out]");
    e.bias = bias->data_ptr<float>();
  }
  TORCH_CHECK(int8 == scales.has_value(), "an int8 weight needs its scales, a bf16 one has none");
  if (int8) {
    TORCH_CHECK(scales->scalar_type() == torch::kFloat32 && scales->is_contiguous() && scales->numel() == out,
                "scales must be float32 [out]");
    e.col_scale = scales->data_ptr<float>();
  }
  auto sizes = x.sizes().vec();
  sizes.back() = out;
  auto y = torch::empty(sizes, x.options());
  const int64_t rows = x.numel() / std::max<int64_t>(in, 1), words = in / per_word;
  const float* xp = x.data_ptr<float>();
  const uint32_t* w = reinterpret_cast<const uint32_t*>(packed.data_ptr());
  float* yp = y.data_ptr<float>();
  if (int8) {
#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || defined(DFLASH_INT8_BY_MADD)
    uint32_t* x_words = dflash_scratch::buffer<uint32_t, struct DotInputWords>(rows * words);
    float* row_scale = dflash_scratch::buffer<float, struct DotRowScales>(rows);
    int32_t* row_offset = dflash_scratch::buffer<int32_t, struct DotRowOffsets>(rows);
    for (int64_t r = 0; r < rows; ++r) row_scale[r] = to_bytes(xp + r * in, in, x_words + r * words, row_offset + r);
    e.row_scale = row_scale;
    e.row_offset = row_offset;
#if defined(DFLASH_INT8_BY_MADD)
    madd_multiply(rows, x_words, words, w, e, yp, out);
#else
#if defined(DFLASH_AMX_INT8)
    if (rows >= kTileMinRows && words % 16 == 0 && dot_int8_tiles_available())
      tile_multiply(rows, x_words, words, w, e, yp, out);
    else
#endif
    multiply<Int8Products>(rows, x_words, words, w, e, yp, out);
#endif
#endif
  } else {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    uint32_t* x_words = dflash_scratch::buffer<uint32_t, struct DotInputWords>(rows * words);
    for (int64_t r = 0; r < rows; ++r) to_pairs(xp + r * in, in, x_words + r * words);
    multiply<Bf16Products>(rows, x_words, words, w, e, yp, out);
#elif defined(DFLASH_BF16_BY_FMA)
    float* rounded = dflash_scratch::buffer<float, struct DotRoundedInputs>(rows * in);
    for (int64_t r = 0; r < rows; ++r) to_bf16_floats(xp + r * in, in, rounded + r * in);
    fma_multiply(rows, rounded, in, w, e.bias, yp, out);
#endif
  }
  return y;
}
