// Sixteen-float vectors, the exp and RoPE's rotation both compiled CPU kernel files use (plugins/draft_block/cpu_kernel.cpp,
// plugins/target/cpu_kernel.cpp; `plugins/compiled.py` rebuilds a kernel when this file changes).
#pragma once

#include <cstdint>

namespace dflash_vec {

// Sixteen floats as one vector (GCC/Clang vector extensions: AVX-512 where the CPU has it, else pairs of
// AVX2 or SSE registers); the `_u` type loads and stores unaligned.
typedef float f16v __attribute__((vector_size(64)));
typedef float f16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16v __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;

inline f16v load(const float* p) { return *reinterpret_cast<const f16u*>(p); }
inline void store(float* p, f16v x) { *reinterpret_cast<f16u*>(p) = x; }
inline f16v splat(float x) { return f16v{} + x; }

// e^x, in a form the compiler vectorizes: x = k ln 2 + f, e^f by a degree-6 Taylor polynomial on
// |f| <= ln2 / 2 (relative error < 3e-7), 2^k through the exponent bits; below -87 (-inf included) 0, above 88
// e^88.
inline f16v vexp(f16v x) {
  const i16v dead = x < -87.f;
  x = dead ? splat(-87.f) : x;
  x = x > 88.f ? splat(88.f) : x;
  const f16v y = x * 1.44269504f + 0.5f;
  i16v k = __builtin_convertvector(y, i16v);  // toward zero: floor is one less where y < 0 is inexact
  k += __builtin_convertvector(k, f16v) > y;  // true is -1
  const f16v f = x - __builtin_convertvector(k, f16v) * 0.693147181f;
  f16v p = splat(1.f / 720.f);
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const f16v scale = reinterpret_cast<f16v>((k + 127) << 23);
  return dead ? f16v{} : p * scale;
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
