// Float vectors of the CPU's width, the exp and RoPE's rotation both compiled CPU kernel files use (plugins/draft_block/cpu_kernel.cpp,
// plugins/target/cpu_kernel.cpp; `plugins/compiled.py` rebuilds a kernel when this file changes).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace dflash_vec {

// One register of floats (GCC/Clang vector extensions): 16 with AVX-512, else 8. A wider vector than the registers
// is not split into registers by GCC but kept in memory, so every loop-carried vector went through the stack: on an
// AVX2 VM 16-float vectors made the target's MoE 8-16x and its attention ~5x slower (round 23). The `_u` type loads
// and stores unaligned.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
constexpr int64_t kSizeMultiple = 16;  // what the kernels' sizes must be multiples of, alike on every CPU
typedef float fvec __attribute__((vector_size(kLanes * 4)));
typedef float fvec_u __attribute__((vector_size(kLanes * 4), aligned(4)));
typedef int32_t ivec __attribute__((vector_size(kLanes * 4)));

inline fvec load(const float* p) { return *reinterpret_cast<const fvec_u*>(p); }
inline void store(float* p, fvec x) { *reinterpret_cast<fvec_u*>(p) = x; }
inline fvec splat(float x) { return fvec{} + x; }

// a * b + c rounded once where the CPU has FMA. GCC fuses `a * b + c` only where its optimizer chooses (it left a
// float32 GEMM tile's unfused and fused the int8 one beside it, round 23), so code whose results must agree bit for
// bit says it.
inline fvec fmadd(fvec a, fvec b, fvec c) {
#if defined(__AVX512F__)
  return reinterpret_cast<fvec>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                                reinterpret_cast<__m512>(c)));
#elif defined(__FMA__)
  return reinterpret_cast<fvec>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                                reinterpret_cast<__m256>(c)));
#else
  return a * b + c;
#endif
}

// The sum of a vector's lanes as a tree (a sequential sum would chain dependent adds).
inline float lane_sum(fvec v) {
  typedef float f8v __attribute__((vector_size(32)));
  typedef float f4v __attribute__((vector_size(16)));
#if defined(__AVX512F__)
  const f8v a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const f8v a = v;
#endif
  const f4v b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

#if defined(__AVX512F__)
// The lane sums of 16 vectors as one vector (lane u: the sum of v[u]'s lanes), by a transposing tree of adds:
// unpacks pair vectors' lanes, in-block shuffles pair those, and 128-bit block shuffles sum the blocks (~30
// instructions for what 16 `lane_sum`s do in ~130).
inline fvec lane_sums(const fvec v[16]) {
  const auto m = [&](int u) { return reinterpret_cast<__m512>(v[u]); };
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // block j of pairs[i]: partial sums of v[2i], v[2i+1], v[2i], v[2i+1]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(m(2 * i), m(2 * i + 1)), _mm512_unpackhi_ps(m(2 * i), m(2 * i + 1)));
  for (int i = 0; i < 4; ++i)  // block j of quads[i]: block j's sums of v[4i] .. v[4i+3]
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const auto halves = [](__m512 a, __m512 b) {  // [a's blocks 0+2, 1+3, b's blocks 0+2, 1+3]
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  };
  const __m512 low = halves(quads[0], quads[1]), high = halves(quads[2], quads[3]);
  return reinterpret_cast<fvec>(_mm512_add_ps(_mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(2, 0, 2, 0)),
                                              _mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(3, 1, 3, 1))));
}
#elif defined(__AVX2__)
// The lane sums of 8 vectors as one vector (lane u: the sum of v[u]'s lanes), by horizontal adds: ~10 instructions
// for what 8 `lane_sum`s do in ~40.
inline fvec lane_sums(const fvec v[8]) {
  const auto m = [&](int u) { return reinterpret_cast<__m256>(v[u]); };
  const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(m(0), m(1)), _mm256_hadd_ps(m(2), m(3)));
  const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(m(4), m(5)), _mm256_hadd_ps(m(6), m(7)));
  return reinterpret_cast<fvec>(_mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                                              _mm256_permute2f128_ps(low, high, 0x31)));
}
#endif

// e^x, in a form the compiler vectorizes: x = k ln 2 + f, e^f by a degree-6 Taylor polynomial on
// |f| <= ln2 / 2 (relative error < 3e-7), 2^k through the exponent bits; below -87 (-inf included) 0, above 88
// e^88.
inline fvec vexp(fvec x) {
  const ivec dead = x < -87.f;
  x = dead ? splat(-87.f) : x;
  x = x > 88.f ? splat(88.f) : x;
  const fvec y = x * 1.44269504f + 0.5f;
  ivec k = __builtin_convertvector(y, ivec);  // toward zero: floor is one less where y < 0 is inexact
  k += __builtin_convertvector(k, fvec) > y;  // true is -1
  const fvec f = x - __builtin_convertvector(k, fvec) * 0.693147181f;
  fvec p = splat(1.f / 720.f);
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const fvec scale = reinterpret_cast<fvec>((k + 127) << 23);
  return dead ? fvec{} : p * scale;
}

// x [D] rotated by cos / sin [D] (rope.rotate: x * cos + roll(x, D/2) * sin, sin signed) -> out [D].
inline void rotate(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
#pragma omp simd
  for (int64_t e = 0; e < half; ++e) out[e] = x[e] * cos[e] + x[e + half] * sin[e];
#pragma omp simd
  for (int64_t e = half; e < d; ++e) out[e] = x[e] * cos[e] + x[e - half] * sin[e];
}

}  // namespace dflash_vec
