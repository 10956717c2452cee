// The target's greedy tokens exactly, from the int8 dot GEMM (part of cpu_kernel.cpp's module; runtime/accept.py
// `greedy_verify_block` calls it through `ExactGreedyHead` in cpu.py).
//
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>

#include "dot_gemm.h"
#include "draft_ops.h"
#include "../scratch.h"

// Why: a verify's LM head is a [V, H] GEMM over its K + 1 rows that a greedy step reads only to take each row's argmax
// (up to the first mismatch), and float32 products run at a quarter of int8's rate. The int8 logits a_j are within a
// bound B_j of the float32 ones L_j (below), so the float32 argmax is among the candidates {j : a_j + B_j >= max_k
// (a_k - B_k)}, usually one or two: those are recomputed in float32 (x . W[j] + b[j]) and the first of their maxima
// wins, which is the argmax of a float32 GEMM (the torch path's up to summation order, as every float32 GEMM here).
//
// The bound, per output j, with x' = s_x q_x and w' = s_w q_w the dequantized operands (|x - x'| <= e_x = 0.5001 s_x,
// |w - w'| <= e_w = 0.5001 s_w: the scales' own rounding inside the margin; s_x = max|x| / kInputLevels, 127 with
// AVX512-VNNI and 63 on AVX2), u = 2^-24, n = H:
//   |s_x s_w sum q_x q_w - sum x w| <= e_x (|W[j]|_1 + n e_w) + e_w |x|_1             (the quantization)
//   + 4 u (|a_j| + |b_j|)                                                             (the epilogue's roundings)
//   + 1.01 n u (max|x| |W[j]|_1 + |b_j|)                                              (any float32 sum of the products)
// times 1.001 for the bound's own float32 arithmetic.

namespace dflash_dot {

using dflash_vec::fmadd;
using dflash_vec::fvec;
using dflash_vec::ivec;
using dflash_vec::kLanes;
using dflash_vec::lane_sum;
using dflash_vec::load;
using dflash_vec::splat;
using dflash_vec::store;

inline fvec magnitude(fvec v) { return reinterpret_cast<fvec>(reinterpret_cast<ivec>(v) & 0x7fffffff); }
inline fvec larger(fvec a, fvec b) { return a > b ? a : b; }
inline float lane_max(fvec v) {
  float most = v[0];
  for (int64_t l = 1; l < kLanes; ++l) most = std::max(most, v[l]);
  return most;
}

// x . w + b in float32 (kLanes partial sums, then their sum); n a multiple of kLanes.
inline float exact_dot(const float* x, const float* w, int64_t n, float b) {
  fvec acc{};
  for (int64_t i = 0; i < n; i += kLanes) acc = fmadd(load(x + i), load(w + i), acc);
  return lane_sum(acc) + b;
}

// The float32 argmax of x [n] @ W.T + b from the int8 logits `approx` [V] of the same row (see above). `upper`:
// scratch of V floats. Returns the index and counts the candidates recomputed into `recomputed`.
inline int64_t certified_argmax(const float* x, int64_t n, const float* approx, const float* weight,
                                const float* abs_sum, const float* scales, const float* bias, int64_t vocab,
                                float* upper, int64_t* recomputed) {
  constexpr float u = 1.f / 16777216.f;
  fvec peak{}, l1{};
  for (int64_t i = 0; i < n; i += kLanes) {
    const fvec v = magnitude(load(x + i));
    peak = larger(peak, v);
    l1 += v;
  }
  const float amax = lane_max(peak), x1 = lane_sum(l1) * (1.f + 1e-4f);
  const float ex = 0.5001f * (amax > 0.f ? amax / static_cast<float>(kInputLevels) : 1.f);
  const fvec v_ex = splat(ex), v_n = splat(static_cast<float>(n)), v_x1 = splat(x1), v_round = splat(4.f * u);
  const fvec v_sum = splat(1.01f * static_cast<float>(n) * u), v_amax = splat(amax);
  fvec lowest = splat(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < vocab; j += kLanes) {
    const fvec a = load(approx + j), w1 = load(abs_sum + j);
    const fvec b = bias ? magnitude(load(bias + j)) : fvec{};
    const fvec ew = 0.5001f * load(scales + j);
    fvec bound = v_ex * fmadd(v_n, ew, w1);
    bound = fmadd(ew, v_x1, bound);
    bound = fmadd(v_round, magnitude(a) + b, bound);
    bound = fmadd(v_sum, fmadd(v_amax, w1, b), bound);
    bound *= 1.001f;
    lowest = larger(lowest, a - bound);
    store(upper + j, a + bound);
  }
  const float threshold = lane_max(lowest);
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

// The greedy accept rule of a verify from the target's final-normed hidden states [b, K + 1, H] (float32, contiguous)
// and the drafts int64 [b, K] (`check_drafts`), through the LM head W [V, H] float32 (contiguous), its `dot_pack`
// int8 copy (`packed`, `scales`), its bias float32 [V] or None and `abs_sum` float32 [V] (each row's sum of |W|): per
// request the drafts accepted (the leading ones equal to the target's argmax after the position before them) and the
// bonus, each argmax the float32 one (above). -> (num_accepted int64 [b], bonus int64 [b], how many candidates were
// recomputed: a plain integer, not a tensor, to spare every step an allocation and an `item`).
inline std::tuple<torch::Tensor, torch::Tensor, int64_t> exact_greedy_verify(
    const torch::Tensor& hidden, const torch::Tensor& drafts, const torch::Tensor& weight, const torch::Tensor& packed,
    const torch::Tensor& scales, const c10::optional<torch::Tensor>& bias, const torch::Tensor& abs_sum) {
  TORCH_CHECK(hidden.scalar_type() == torch::kFloat32 && hidden.dim() == 3 && hidden.is_contiguous(),
              "hidden must be contiguous float32 [b, K + 1, H]");
  check_drafts(drafts, hidden.size(0), hidden.size(1), "hidden [b, K + 1, H]");
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
  const float *hp = hidden.data_ptr<float>(), *ap = approx.data_ptr<float>(), *wp = weight.data_ptr<float>();
  const float *sp = scales.data_ptr<float>(), *asp = abs_sum.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t* dp = drafts.data_ptr<int64_t>();
  float* const upper = dflash_scratch::buffer<float, struct GreedyHeadBounds>(vocab);
  const auto argmax = [&](int64_t row) {
    return dflash_dot::certified_argmax(hp + row * n, n, ap + row * vocab, wp, asp, sp, bp, vocab, upper,
                                        &recomputed);
  };
  accept_scan(batch, width, dp, drafts.stride(0), argmax, accepted.data_ptr<int64_t>(), bonus.data_ptr<int64_t>());
  return {accepted, bonus, recomputed};
}
