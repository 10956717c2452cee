// The gpt-oss target's MoE on CPU (part of cpu_kernel.cpp's module): the router's top-k, and every routed expert's
// rows in one pass over its weights (gemm_tiles.h) with gpt-oss's clamped SwiGLU and the routing weights; see
// cpu_kernel.cpp.
#pragma once

#include <torch/extension.h>

#include "../scratch.h"
#include "../vector_math.h"
#include "amx_gemm.h"
#include "gemm_tiles.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

namespace dflash_moe {

using namespace dflash_vec;
using namespace dflash_gemm;

// Expert e's matrix of `size` weights in a stack of them.
template <typename W>
W expert_at(W w, int64_t e, int64_t size) {
  return w + e * size;
}
inline Bf16Pairs expert_at(Bf16Pairs w, int64_t e, int64_t size) { return {w.words + e * size / 2}; }

// gpt-oss's gate on gate_up [2I] with gate and up interleaved (even, odd columns) -> act [I]:
// (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, limit).
void clamped_swiglu(const float* gate_up, int64_t inter, float alpha, float limit, float* gate, float* up,
                    float* act) {
  for (int64_t i = 0; i < inter; ++i) {
    gate[i] = gate_up[2 * i];
    up[i] = gate_up[2 * i + 1];
  }
  for (int64_t i = 0; i < inter; i += kLanes) {
    fvec g = load(gate + i), u = load(up + i);
    g = g > limit ? splat(limit) : g;
    u = u > limit ? splat(limit) : u;
    u = u < -limit ? splat(-limit) : u;
    store(act + i, (u + 1.f) * (g / (1.f + vexp(-alpha * g))));
  }
}

void check(const torch::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.dim() == dims, name, " must be a contiguous CPU tensor with ",
              dims, " dimensions");
}

// out = row * scales, elementwise over `width` (a multiple of 16); out may be row.
void scale_row(const float* row, const float* scales, int64_t width, float* out) {
  for (int64_t c = 0; c < width; c += kLanes) store(out + c, load(row + c) * load(scales + c));
}

// One expert's `rows` rows `routed` (token * k + slot, in token order): gate_up, the gate, down, the routing weight,
// into slots[token * k + slot]. int8 experts: `gus` [H] and `dns` [I] are the power-of-two scales of their
// matrices' input rows, which multiply the inputs instead of the weights: x_h s_h exactly, so each product
// (x_h s_h) q_hc is the float32 original's x_h w_hc bit for bit, and the weights need no multiply (-15% of the
// MoE's time against a scale per weight, round 20). `W`: a weight pointer (float32 or int8), bf16 pairs or AMX tiles.
template <typename W>
void run_expert(const float* xp, const float* sp, const int64_t* routed, int64_t rows, int64_t k, int64_t hidden,
                int64_t inter, W gu, const float* gus, const float* gub, W dn, const float* dns,
                const float* dnb, float alpha, float limit, float* slots) {
  using dflash_scratch::buffer;
  // gate_up [rows, 2I], act [rows, I], gate [I], up [I] and the scaled inputs [rows, H] in one buffer
  float* gate_up = buffer<float, struct ExpertFloats>(rows * (3 * inter + hidden) + 2 * inter);
  float *act = gate_up + rows * 2 * inter, *gate = act + rows * inter, *up = gate + inter, *scaled = up + inter;
  const float** inputs = buffer<const float*, struct ExpertInputs>(2 * rows);  // x rows, then act rows
  float** outputs = buffer<float*, struct ExpertOutputs>(2 * rows);            // gate_up rows, then slot rows
  const float **x_rows = inputs, **act_rows = inputs + rows;
  float **gate_up_rows = outputs, **out_rows = outputs + rows;
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = xp + routed[r] / k * hidden;
    if (gus) {
      scale_row(x, gus, hidden, scaled + r * hidden);
      x = scaled + r * hidden;
    }
    x_rows[r] = x;
    gate_up_rows[r] = gate_up + r * 2 * inter;
    act_rows[r] = act + r * inter;
    out_rows[r] = slots + routed[r] * hidden;
  }
  const bool tile_major = std::is_same_v<W, const int8_t*>;  // int8 experts come stored tile by tile (`int8_rows`)
  linear_rows(x_rows, rows, hidden, gu, 2 * inter, gub, gate_up_rows, 0, 2 * inter, tile_major);
  for (int64_t r = 0; r < rows; ++r) {
    clamped_swiglu(gate_up_rows[r], inter, alpha, limit, gate, up, act + r * inter);
    if (dns) scale_row(act + r * inter, dns, inter, act + r * inter);
  }
  linear_rows(act_rows, rows, inter, dn, hidden, dnb, out_rows, 0, hidden, tile_major);
  for (int64_t r = 0; r < rows; ++r) {
    const fvec score = splat(sp[routed[r]]);
    for (int64_t c = 0; c < hidden; c += kLanes) store(out_rows[r] + c, load(out_rows[r] + c) * score);
  }
}

// Every routed expert (in parallel over torch's intra-op threads: their rows write disjoint slots).
template <typename W>
void run_experts(const float* xp, const int64_t* ip, const float* sp, int64_t n, int64_t k, int64_t hidden,
                 int64_t inter, int64_t experts, W gu, const float* gus, const float* gub, W dn,
                 const float* dns, const float* dnb, float alpha, float limit, float* slots) {
  using dflash_scratch::buffer;
  // each expert's routed slots (token * k + slot, in token order) side by side: a counting sort
  int64_t* first = buffer<int64_t, struct RoutedFirst>(experts + 1);  // expert e's run: [first[e], first[e + 1])
  int64_t* routed = buffer<int64_t, struct RoutedSlots>(n * k);
  int64_t* touched = buffer<int64_t, struct TouchedExperts>(experts);
  std::fill(first, first + experts + 1, 0);
  for (int64_t s = 0; s < n * k; ++s) ++first[ip[s] + 1];
  int64_t count = 0;
  for (int64_t e = 0; e < experts; ++e) {
    if (first[e + 1] > 0) touched[count++] = e;
    first[e + 1] += first[e];
  }
  for (int64_t e = experts; e > 0; --e) first[e] = first[e - 1];  // each run's start, advanced as it fills
  for (int64_t s = 0; s < n * k; ++s) routed[first[ip[s] + 1]++] = s;
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = touched[i];
      run_expert(xp, sp, routed + first[e], first[e + 1] - first[e], k, hidden, inter, expert_at(gu, e, hidden * 2 * inter),
                 gus ? gus + e * hidden : nullptr, gub + e * 2 * inter, expert_at(dn, e, inter * hidden),
                 dns ? dns + e * inter : nullptr, dnb + e * hidden, alpha, limit, slots);
    }
  });
}

// gpt-oss's router on x float32 [n, H]: logits x @ weight.T + bias (weight float32 [E, H], bias [E]), each token's
// top_k of them (largest first; of equal ones the lower expert) -> (indices int64 [n, k], their softmax float32 [n, k]).
inline std::vector<torch::Tensor> route(torch::Tensor x, torch::Tensor weight, torch::Tensor bias, int64_t top_k) {
  check(x, "x", 2);
  check(weight, "weight", 2);
  check(bias, "bias", 1);
  const int64_t n = x.size(0), hidden = x.size(1), experts = weight.size(0);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32 &&
                  bias.scalar_type() == torch::kFloat32, "x, weight and bias must be float32");
  TORCH_CHECK(weight.size(1) == hidden && bias.size(0) == experts, "weight must be [E, H] and bias [E]");
  TORCH_CHECK(hidden % kSizeMultiple == 0, "the hidden size must be a multiple of ", kSizeMultiple);
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "top_k must lie in [1, E]");
  auto indices = torch::empty({n, top_k}, x.options().dtype(torch::kInt64));
  auto scores = torch::empty({n, top_k}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>(), *bp = bias.data_ptr<float>();
  int64_t* ip = indices.data_ptr<int64_t>();
  float* sp = scores.data_ptr<float>();
  float* logits = dflash_scratch::buffer<float, struct RouterLogits>(experts);
  int64_t* order = dflash_scratch::buffer<int64_t, struct RouterOrder>(experts);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t e = 0; e < experts; ++e) {
      fvec acc{};
      for (int64_t c = 0; c < hidden; c += kLanes) acc += load(xp + t * hidden + c) * load(wp + e * hidden + c);
      logits[e] = lane_sum(acc) + bp[e];
      order[e] = e;
    }
    std::partial_sort(order, order + top_k, order + experts, [&](int64_t a, int64_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    const float most = logits[order[0]];
    float total = 0.f;
    for (int64_t j = 0; j < top_k; ++j) total += (sp[t * top_k + j] = std::exp(logits[order[j]] - most));
    for (int64_t j = 0; j < top_k; ++j) {
      sp[t * top_k + j] /= total;
      ip[t * top_k + j] = order[j];
    }
  }
  return {indices, scores};
}

// x float32 [n, H]; indices int64 [n, k] and scores float32 [n, k] (the router's top-k and their softmax);
// gate_up [E, H, 2I] and down [E, I, H], both float32, both bf16 pairs (int32 [E, H / 2, 2I] and [E, I / 2, H],
// `Bf16Pairs`) or both int8 (then stored tile by tile, see `linear_rows`, with float32 scales [E, H] and [E, I]: each
// weight is its int8 times its input row's scale, a power of two);
// biases float32 [E, 2I], [E, H]. H and I multiples of 16. `tiles`: gate_up and down are bf16 AMX tiles (`amx_gemm.h`)
// viewed as [E, H, 2I] and [E, I, H]; H and I multiples of 32.
// -> float32 [n, H]: sum over slots j of scores[t, j] * expert(indices[t, j], x[t]).
inline torch::Tensor routed_experts(torch::Tensor x, torch::Tensor indices, torch::Tensor scores, torch::Tensor gate_up,
                             torch::Tensor gate_up_bias, torch::Tensor down, torch::Tensor down_bias, double alpha,
                             double limit, c10::optional<torch::Tensor> gate_up_scales,
                             c10::optional<torch::Tensor> down_scales, bool tiles) {
  for (const auto& [t, name, dims] : {std::tuple{&x, "x", 2}, {&indices, "indices", 2}, {&scores, "scores", 2},
                                      {&gate_up, "gate_up", 3}, {&gate_up_bias, "gate_up_bias", 2},
                                      {&down, "down", 3}, {&down_bias, "down_bias", 2}})
    check(*t, name, dims);
  const int64_t n = x.size(0), hidden = x.size(1), k = indices.size(1);
  const auto kind = gate_up.scalar_type();
  const int64_t pair = kind == torch::kInt32 ? 2 : 1;  // input rows a stored row
  const int64_t experts = gate_up.size(0), inter = down.size(1) * pair;
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && scores.scalar_type() == torch::kFloat32 &&
                  gate_up_bias.scalar_type() == torch::kFloat32 && down_bias.scalar_type() == torch::kFloat32,
              "x, scores and the biases must be float32");
  TORCH_CHECK(indices.scalar_type() == torch::kInt64 && indices.size(0) == n && scores.sizes() == indices.sizes(),
              "indices (int64) and scores must both be [n, k]");
  TORCH_CHECK(kind == down.scalar_type() && (kind == torch::kFloat32 || kind == torch::kInt32 ||
                                              kind == torch::kChar || (tiles && kind == torch::kBFloat16)),
              "gate_up and down must both be float32, both bf16 pairs (int32), both int8 or both AMX tiles");
  const bool int8 = kind == torch::kChar;
  TORCH_CHECK(int8 == gate_up_scales.has_value() && int8 == down_scales.has_value(),
              "int8 experts need both scales, others none");
  TORCH_CHECK(gate_up.size(1) * pair == hidden && gate_up.size(2) == 2 * inter && down.size(0) == experts &&
                  down.size(2) == hidden && gate_up_bias.size(0) == experts && gate_up_bias.size(1) == 2 * inter &&
                  down_bias.size(0) == experts && down_bias.size(1) == hidden,
              "expert shapes must be gate_up [E, H, 2I], down [E, I, H], biases [E, 2I] and [E, H]");
  TORCH_CHECK(hidden % kSizeMultiple == 0 && inter % kSizeMultiple == 0,
              "hidden and intermediate sizes must be multiples of ", kSizeMultiple);
  TORCH_CHECK(!tiles || (kind == torch::kBFloat16 && hidden % dflash_amx::kTileK == 0 &&
                          inter % dflash_amx::kTileK == 0 && dflash_amx::available()),
              "AMX tiles need bf16 experts, H and I multiples of 32 and a CPU with AMX-BF16");
  if (int8) {
    for (const auto& [t, name, rows] : {std::tuple{&*gate_up_scales, "gate_up_scales", hidden},
                                        {&*down_scales, "down_scales", inter}}) {
      check(*t, name, 2);
      TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->size(0) == experts && t->size(1) == rows, name,
                  " must be float32 [E, in]");
    }
  }
  const int64_t* ip = indices.data_ptr<int64_t>();
  for (int64_t s = 0; s < n * k; ++s)
    TORCH_CHECK(ip[s] >= 0 && ip[s] < experts, "expert index ", ip[s], " outside [0, ", experts, ")");
  auto slots = torch::empty({n, k, hidden}, x.options());
  const float *xp = x.data_ptr<float>(), *sp = scores.data_ptr<float>();
  const float *gub = gate_up_bias.data_ptr<float>(), *dnb = down_bias.data_ptr<float>();
  float* out_slots = slots.data_ptr<float>();
  const auto a = static_cast<float>(alpha), l = static_cast<float>(limit);
  const auto bf16 = [](const torch::Tensor& t) { return static_cast<const uint16_t*>(t.data_ptr()); };
  if (tiles)
    run_experts(xp, ip, sp, n, k, hidden, inter, experts, dflash_amx::Tiles{bf16(gate_up)}, nullptr, gub,
                dflash_amx::Tiles{bf16(down)}, nullptr, dnb, a, l, out_slots);
  else if (kind == torch::kFloat32)
    run_experts(xp, ip, sp, n, k, hidden, inter, experts, static_cast<const float*>(gate_up.data_ptr<float>()),
                nullptr, gub, static_cast<const float*>(down.data_ptr<float>()), nullptr, dnb, a, l, out_slots);
  else if (kind == torch::kInt32)
    run_experts(xp, ip, sp, n, k, hidden, inter, experts, Bf16Pairs{static_cast<const uint32_t*>(gate_up.data_ptr())},
                nullptr, gub, Bf16Pairs{static_cast<const uint32_t*>(down.data_ptr())}, nullptr, dnb, a, l, out_slots);
  else
    run_experts(xp, ip, sp, n, k, hidden, inter, experts, static_cast<const int8_t*>(gate_up.data_ptr<int8_t>()),
                gate_up_scales->data_ptr<float>(), gub, static_cast<const int8_t*>(down.data_ptr<int8_t>()),
                down_scales->data_ptr<float>(), dnb, a, l, out_slots);
  auto out = torch::empty({n, hidden}, x.options());
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < n; ++t) {  // the top-k outputs summed in slot order
    const float* first = out_slots + t * k * hidden;
    std::copy(first, first + hidden, op + t * hidden);
    for (int64_t j = 1; j < k; ++j)
      for (int64_t c = 0; c < hidden; c += kLanes)
        store(op + t * hidden + c, load(op + t * hidden + c) + load(first + j * hidden + c));
  }
  return out;
}

// A layer's whole MoE in one call: `route`, then `routed_experts` on its top-k (the same numbers as the two calls).
inline torch::Tensor moe(torch::Tensor x, torch::Tensor router_weight, torch::Tensor router_bias, int64_t top_k,
                  torch::Tensor gate_up, torch::Tensor gate_up_bias, torch::Tensor down, torch::Tensor down_bias,
                  double alpha, double limit, c10::optional<torch::Tensor> gate_up_scales,
                  c10::optional<torch::Tensor> down_scales, bool tiles) {
  const auto routed = route(x, router_weight, router_bias, top_k);
  return routed_experts(x, routed[0], routed[1], gate_up, gate_up_bias, down, down_bias, alpha, limit, gate_up_scales,
                        down_scales, tiles);
}

}  // namespace dflash_moe
