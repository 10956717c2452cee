// The target's greedy tokens exactly, from the int8 dot GEMM (part of cpu_kernel.cpp's module; runtime/accept.py
// `greedy_verify_block` calls it through `ExactGreedyHead` in cpu.py).
//
#pragma once

#include <torch/extension.h>

#include <immintrin.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "dot_gemm.h"
#include "draft_ops.h"

// Why: a verify's LM head is a [V, H] GEMM over its K + 1 rows that a greedy step reads only to take each row's argmax
// (up to the first mismatch), and float32 products run at a quarter of int8's rate. The int8 logits a_j are within a
// bound B_j of the float32 ones L_j (below), so the float32 argmax is among the candidates {j : a_j + B_j >= max_k
// (a_k - B_k)}, usually one or two: those are recomputed in float32 (x . W[j] + b[j]) and the first of their maxima
// wins, which is the argmax of a float32 GEMM (the torch path's up to summation order, as every float32 GEMM here).
//
// The bound, per output j, with x' = s_x q_x and w' = s_w q_w the dequantized operands (|x - x'| <= e_x = 0.5001 s_x,
// |w - w'| <= e_w = 0.5001 s_w: the scales' own rounding inside the margin), u = 2^-24, n = H:
//   |s_x s_w sum q_x q_w - sum x w| <= e_x (|W[j]|_1 + n e_w) + e_w |x|_1             (the quantization)
//   + 4 u (|a_j| + |b_j|)                                                             (the epilogue's roundings)
//   + 1.01 n u (max|x| |W[j]|_1 + |b_j|)                                              (any float32 sum of the products)
// times 1.001 for the bound's own float32 arithmetic.

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
namespace dflash_dot {

// x . w + b in float32 (16 partial sums, then their sum).
inline float exact_dot(const float* x, const float* w, int64_t n, float b) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(w + i), acc);
  return _mm512_reduce_add_ps(acc) + b;
}

// The float32 argmax of x [n] @ W.T + b from the int8 logits `approx` [V] of the same row (see above). `upper`:
// scratch of V floats. Returns the index and counts the candidates recomputed into `recomputed`.
inline int64_t certified_argmax(const float* x, int64_t n, const float* approx, const float* weight,
                                const float* abs_sum, const float* scales, const float* bias, int64_t vocab,
                                float* upper, int64_t* recomputed) {
  constexpr float u = 1.f / 16777216.f;
  __m512 peak = _mm512_setzero_ps(), l1 = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_abs_ps(_mm512_loadu_ps(x + i));
    peak = _mm512_max_ps(peak, v);
    l1 = _mm512_add_ps(l1, v);
  }
  const float amax = _mm512_reduce_max_ps(peak), x1 = _mm512_reduce_add_ps(l1) * (1.f + 1e-4f);
  const float ex = 0.5001f * (amax > 0.f ? amax / 127.f : 1.f);
  const __m512 v_ex = _mm512_set1_ps(ex), v_n = _mm512_set1_ps(static_cast<float>(n)), v_x1 = _mm512_set1_ps(x1);
  const __m512 v_round = _mm512_set1_ps(4.f * u), v_sum = _mm512_set1_ps(1.01f * static_cast<float>(n) * u);
  const __m512 v_amax = _mm512_set1_ps(amax), v_half = _mm512_set1_ps(0.5001f), v_safety = _mm512_set1_ps(1.001f);
  __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < vocab; j += 16) {
    const __m512 a = _mm512_loadu_ps(approx + j), w1 = _mm512_loadu_ps(abs_sum + j);
    const __m512 b = bias ? _mm512_abs_ps(_mm512_loadu_ps(bias + j)) : _mm512_setzero_ps();
    const __m512 ew = _mm512_mul_ps(v_half, _mm512_loadu_ps(scales + j));
    __m512 bound = _mm512_mul_ps(v_ex, _mm512_fmadd_ps(v_n, ew, w1));
    bound = _mm512_fmadd_ps(ew, v_x1, bound);
    bound = _mm512_fmadd_ps(v_round, _mm512_add_ps(_mm512_abs_ps(a), b), bound);
    bound = _mm512_fmadd_ps(v_sum, _mm512_fmadd_ps(v_amax, w1, b), bound);
    bound = _mm512_mul_ps(bound, v_safety);
    lowest = _mm512_max_ps(lowest, _mm512_sub_ps(a, bound));
    _mm512_storeu_ps(upper + j, _mm512_add_ps(a, bound));
  }
  const float threshold = _mm512_reduce_max_ps(lowest);
  // the first maximum of the float32 logits of the words `considered` admits (-1 where it admits none)
  const auto first_best = [&](auto considered) {
    int64_t best_index = -1;
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < vocab; ++j) {
      if (!considered(j)) continue;
      const float logit = exact_dot(x, weight + j * n, n, bias ? bias[j] : 0.f);
      if (best_index < 0 || logit > best) {
        best = logit;
        best_index = j;
      }
    }
    return best_index;
  };
  const int64_t index = first_best([&](int64_t j) { return upper[j] >= threshold && (++*recomputed, true); });
  return index >= 0 ? index : first_best([](int64_t) { return true; });  // no candidate (a NaN somewhere): every logit
}

}  // namespace dflash_dot
#endif

// Whether this build has `exact_greedy_verify` (AVX512-VNNI: its bound assumes inputs quantized to 127 levels).
inline bool greedy_head_available() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

// The greedy accept rule of a verify from the target's final-normed hidden states [b, K + 1, H] (float32, contiguous)
// and the drafts int64 [b, K], through the LM head W [V, H] float32 (contiguous), its `dot_pack` int8 copy (`packed`,
// `scales`), its bias float32 [V] or None and `abs_sum` float32 [V] (each row's sum of |W|): per request the drafts
// accepted (the leading ones equal to the target's argmax after the position before them) and the bonus, each argmax
// the float32 one (above). -> (num_accepted int64 [b], bonus int64 [b], candidates recomputed int64 []).
inline std::vector<torch::Tensor> exact_greedy_verify(const torch::Tensor& hidden, const torch::Tensor& drafts,
                                                      const torch::Tensor& weight, const torch::Tensor& packed,
                                                      const torch::Tensor& scales, const c10::optional<torch::Tensor>& bias,
                                                      const torch::Tensor& abs_sum) {
  TORCH_CHECK(greedy_head_available(), "this build has no exact greedy head (the CPU lacks AVX512-VNNI)");
  TORCH_CHECK(hidden.scalar_type() == torch::kFloat32 && hidden.dim() == 3 && hidden.is_contiguous(),
              "hidden must be contiguous float32 [b, K + 1, H]");
  TORCH_CHECK(drafts.scalar_type() == torch::kInt64 && drafts.dim() == 2 && drafts.is_contiguous() &&
                  drafts.size(0) == hidden.size(0) && drafts.size(1) + 1 == hidden.size(1),
              "drafts must be contiguous int64 [b, K] beside hidden [b, K + 1, H]");
  const int64_t batch = hidden.size(0), width = hidden.size(1), n = hidden.size(2);
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.size(1) == n, "weight must be contiguous float32 [V, H]");
  const int64_t vocab = weight.size(0);
  TORCH_CHECK(abs_sum.scalar_type() == torch::kFloat32 && abs_sum.is_contiguous() && abs_sum.numel() == vocab,
              "abs_sum must be float32 [V]");
  const auto approx = dot_linear(hidden, packed, bias, scales);  // checks packed, scales, bias against [V, H]
  TORCH_CHECK(approx.size(2) == vocab, "the packed head must be the weight's");
  auto accepted = torch::empty({batch}, drafts.options()), bonus = torch::empty({batch}, drafts.options());
  int64_t recomputed = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const float *hp = hidden.data_ptr<float>(), *ap = approx.data_ptr<float>(), *wp = weight.data_ptr<float>();
  const float *sp = scales.data_ptr<float>(), *asp = abs_sum.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t* dp = drafts.data_ptr<int64_t>();
  std::vector<float> upper(vocab);
  const auto argmax = [&](int64_t row) {
    return dflash_dot::certified_argmax(hp + row * n, n, ap + row * vocab, wp, asp, sp, bp, vocab, upper.data(),
                                        &recomputed);
  };
  accept_scan(batch, width, dp, argmax, accepted.data_ptr<int64_t>(), bonus.data_ptr<int64_t>());
#endif
  return {accepted, bonus, torch::tensor(recomputed)};
}
