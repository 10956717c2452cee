// The drafter's GEMMs on CPUs with AVX512-BF16 dot products (part of cpu_kernel.cpp's module; models/linear.py
// `CastLinear` calls it for a bf16 GEMM, and the whole compiled draft step for each of its GEMMs).
//
// Why: a drafter step's GEMMs have 1 to ~16 rows (a block per request), where oneDNN's bf16 call costs ~25 us more
// than its arithmetic and fbgemm's float16 one multiplies at float32's rate. `vdpbf16ps` multiplies bf16 pairs
// into float32 sums at twice the FMA's rate, and a call here costs a few microseconds. Drafts need not be exact (the
// target verifies them), so the inputs are rounded to bf16 (nearest even) and the weights are bf16 copies; products
// and sums are float32.
//
// Layout: the weight W [out, in] is packed once (`pack` in cpu.py) as [out / 16, in / 2, 16, 2] bf16: for each
// group of 16 output columns, its pairs of input rows one after another, so a tile streams each group's weights
// contiguously and one 64-byte load holds 16 columns x 2 inputs, the operand `vdpbf16ps` takes.

#pragma once

#include <torch/extension.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace dflash_dot {

constexpr int64_t kGroup = 16;  // output columns per packed group (one vector of float32 sums)

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kBuilt = true;

// x [in] float32 -> in / 2 bf16 pairs (as 32-bit words), rounded to nearest even; in a multiple of 32.
void to_pairs(const float* x, int64_t in, uint32_t* pairs) {
  for (int64_t i = 0; i < in; i += 32) {
    const __m512bh p = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
    _mm512_storeu_si512(pairs + i / 2, reinterpret_cast<__m512i>(p));
  }
}

// y[r][16 g0 : 16 (g0 + NG)] = x[r] @ W (+ bias) for NR rows: one pass over NG packed groups, NR x NG sums in
// registers. x: NR rows of `pairs` words; w: the first group's packed weights, `group_stride` words apart.
template <int NR, int NG>
void tile(const uint32_t* x, int64_t pairs, const uint32_t* w, int64_t group_stride, const float* bias,
          float* y, int64_t out) {
  __m512 acc[NR][NG];
  for (int g = 0; g < NG; ++g) {
    const __m512 b = bias ? _mm512_loadu_ps(bias + g * kGroup) : _mm512_setzero_ps();
    for (int r = 0; r < NR; ++r) acc[r][g] = b;
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[NG];
    for (int g = 0; g < NG; ++g)
      wv[g] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + g * group_stride + p * kGroup));
    for (int r = 0; r < NR; ++r) {
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[r * pairs + p])));
      for (int g = 0; g < NG; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], xv, wv[g]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int g = 0; g < NG; ++g) _mm512_storeu_ps(y + r * out + g * kGroup, acc[r][g]);
}

// Groups [first, last) for NR rows, NG groups a tile (the register budget: NR x NG sums, NG weights, one input),
// a last tile of single groups.
template <int NR, int NG>
void groups(const uint32_t* x, int64_t pairs, const uint32_t* w, const float* bias, float* y, int64_t out,
            int64_t first, int64_t last) {
  const int64_t stride = pairs * kGroup;
  int64_t g = first;
  for (; g + NG <= last; g += NG)
    tile<NR, NG>(x, pairs, w + g * stride, stride, bias ? bias + g * kGroup : nullptr, y + g * kGroup, out);
  for (; g < last; ++g)
    tile<NR, 1>(x, pairs, w + g * stride, stride, bias ? bias + g * kGroup : nullptr, y + g * kGroup, out);
}

// Up to 8 rows at a time: 4 groups a tile for up to 4 rows, 2 for 5 to 8 (at most 16 sums).
template <int NR>
void rows_at(const uint32_t* x, int64_t pairs, const uint32_t* w, const float* bias, float* y, int64_t out,
             int64_t first, int64_t last) {
  if constexpr (NR <= 4)
    groups<NR, 4>(x, pairs, w, bias, y, out, first, last);
  else
    groups<NR, 2>(x, pairs, w, bias, y, out, first, last);
}

void block_rows(int64_t rows, const uint32_t* x, int64_t pairs, const uint32_t* w, const float* bias, float* y,
                int64_t out, int64_t first, int64_t last) {
  switch (rows) {
    case 1: return rows_at<1>(x, pairs, w, bias, y, out, first, last);
    case 2: return rows_at<2>(x, pairs, w, bias, y, out, first, last);
    case 3: return rows_at<3>(x, pairs, w, bias, y, out, first, last);
    case 4: return rows_at<4>(x, pairs, w, bias, y, out, first, last);
    case 5: return rows_at<5>(x, pairs, w, bias, y, out, first, last);
    case 6: return rows_at<6>(x, pairs, w, bias, y, out, first, last);
    case 7: return rows_at<7>(x, pairs, w, bias, y, out, first, last);
    default: return rows_at<8>(x, pairs, w, bias, y, out, first, last);
  }
}
#else
constexpr bool kBuilt = false;
#endif

}  // namespace dflash_dot

// Whether this build has the kernel (a CPU with AVX512-BF16, built with -march=native); `dot_linear` raises where not.
inline bool dot_available() { return dflash_dot::kBuilt; }

// x float32 [..., in] (contiguous) times the packed bf16 weight [out / 16, in / 2, 16, 2] plus bias float32 [out] or
// None -> float32 [..., out]; in a multiple of 32. Column groups split over torch's intra-op threads.
inline torch::Tensor dot_linear(const torch::Tensor& x, const torch::Tensor& packed,
                                const c10::optional<torch::Tensor>& bias) {
  using namespace dflash_dot;
  TORCH_CHECK(kBuilt, "this build has no AVX512-BF16 GEMM (the CPU lacks avx512_bf16)");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 CPU tensor");
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && packed.dim() == 4 && packed.size(2) == kGroup &&
                  packed.size(3) == 2 && packed.is_contiguous(),
              "the weight must be packed bf16 [out / 16, in / 2, 16, 2]");
  const int64_t out = packed.size(0) * kGroup, in = packed.size(1) * 2;
  TORCH_CHECK(x.size(-1) == in, "x's last dimension (", x.size(-1), ") must be the weight's input width (", in, ")");
  TORCH_CHECK(in % 32 == 0, "the input width must be a multiple of 32");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == out,
                "bias must be float32 [out]");
    bp = bias->data_ptr<float>();
  }
  auto sizes = x.sizes().vec();
  sizes.back() = out;
  auto y = torch::empty(sizes, x.options());
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const int64_t rows = x.numel() / std::max<int64_t>(in, 1), pairs = in / 2;
  std::vector<uint32_t> x_pairs(rows * pairs);
  for (int64_t r = 0; r < rows; ++r) to_pairs(x.data_ptr<float>() + r * in, in, x_pairs.data() + r * pairs);
  const uint32_t* w = reinterpret_cast<const uint32_t*>(packed.data_ptr());
  float* yp = y.data_ptr<float>();
  // each thread takes a span of column groups, 8 groups at a time for all rows, 8 rows at a time: a chunk's weights
  // (8 x in x 32 bytes) are read from memory once and from cache for the next 8 rows
  at::parallel_for(0, out / kGroup, 8, [&](int64_t first, int64_t last) {
    for (int64_t chunk = first; chunk < last; chunk += 8)
      for (int64_t r = 0; r < rows; r += 8)
        block_rows(std::min<int64_t>(8, rows - r), x_pairs.data() + r * pairs, pairs, w, bp, yp + r * out, out, chunk,
                   std::min(chunk + 8, last));
  });
#endif
  return y;
}
