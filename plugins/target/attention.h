// A gpt-oss target layer's attention on CPU for a step (part of cpu_kernel.cpp's module): RoPE, the K/V arena write
// and the attention with its sink, after the layer's fused q/k/v projection.
#pragma once

#include <torch/extension.h>

#include "../scratch.h"
#include "../vector_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace dflash_attention {

using namespace dflash_vec;

// out[e0 : e0 + kLanes N] = sum over keys k of weights[k] * value[k][e0 : ...] / total: N accumulators, one pass.
template <int N>
void weighted_values(const float* weights, const float* value, int64_t count, int64_t d, int64_t e0, float total,
                     float* out) {
  fvec acc[N] = {};
  for (int64_t k = 0; k < count; ++k)
    for (int n = 0; n < N; ++n) acc[n] += weights[k] * load(value + k * d + e0 + n * kLanes);
  for (int n = 0; n < N; ++n) store(out + e0 + n * kLanes, acc[n] / total);
}

// One target layer's attention for a step, after its fused q/k/v projection: qkv [b, t, (Hq + 2 Hkv) * D]
// (float32, contiguous), cos / sin [b, t, D] (`Rotary`'s, any strides but the last), the layer's arena
// keys / values [b, Hkv, S, D] (contiguous), positions int64 [b, t], sliding_window <= 0 for none, sinks
// float32 [Hq] or None. Writes every token's rotated key and its value at its position, then each query
// head attends to the keys at positions p <= its own (and p > its own - window), with the sink as one more
// logit without a value (gpt-oss) -> [b, t, Hq * D].
inline torch::Tensor sink_attention(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor keys,
                                    torch::Tensor values, torch::Tensor positions, int64_t sliding_window,
                                    c10::optional<torch::Tensor> sinks, double scale) {
  TORCH_CHECK(qkv.scalar_type() == torch::kFloat32 && qkv.is_contiguous() && qkv.dim() == 3,
              "qkv must be float32 [b, t, (Hq + 2 Hkv) * D], contiguous");
  TORCH_CHECK(keys.scalar_type() == torch::kFloat32 && keys.is_contiguous() && keys.dim() == 4 &&
                  values.sizes() == keys.sizes() && values.scalar_type() == torch::kFloat32 && values.is_contiguous(),
              "keys / values must be float32 [b, Hkv, S, D], contiguous");
  const int64_t batch = qkv.size(0), t = qkv.size(1), hkv = keys.size(1), capacity = keys.size(2), d = keys.size(3);
  TORCH_CHECK(keys.size(0) == batch, "the arena must have qkv's batch");
  TORCH_CHECK(d % kSizeMultiple == 0, "head_dim must be a multiple of ", kSizeMultiple, ", got ", d);
  TORCH_CHECK(qkv.size(2) % d == 0 && qkv.size(2) / d > 2 * hkv && (qkv.size(2) / d - 2 * hkv) % hkv == 0,
              "qkv's width must be (Hq + 2 Hkv) * D with Hq a multiple of Hkv");
  const int64_t hq = qkv.size(2) / d - 2 * hkv, group = hq / hkv, width = qkv.size(2);
  for (const auto* table : {&cos, &sin})
    TORCH_CHECK(table->scalar_type() == torch::kFloat32 && table->dim() == 3 && table->size(0) == batch &&
                    table->size(1) == t && table->size(2) == d && table->stride(2) == 1,
                "cos / sin must be float32 [b, t, D]");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.dim() == 2 && positions.size(0) == batch &&
                  positions.size(1) == t, "positions must be int64 [b, t]");
  const auto where = positions.contiguous();
  const int64_t* pos = where.data_ptr<int64_t>();
  torch::Tensor sink_logits;
  if (sinks.has_value()) {
    sink_logits = sinks->contiguous();
    TORCH_CHECK(sink_logits.scalar_type() == torch::kFloat32 && sink_logits.numel() == hq, "sinks must be float32 [Hq]");
  }
  const float* sp = sinks.has_value() ? sink_logits.data_ptr<float>() : nullptr;
  const float *qp = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  float *kp = keys.data_ptr<float>(), *vp = values.data_ptr<float>();
  auto out = torch::empty({batch, t, hq * d}, qkv.options());
  float* op = out.data_ptr<float>();
  const auto cos_at = [&](int64_t i, int64_t j) { return cp + i * cos.stride(0) + j * cos.stride(1); };
  const auto sin_at = [&](int64_t i, int64_t j) { return snp + i * sin.stride(0) + j * sin.stride(1); };
  for (int64_t i = 0; i < batch; ++i)  // the step's keys and values first: its later tokens see its earlier ones
    for (int64_t j = 0; j < t; ++j) {
      const int64_t p = pos[i * t + j];
      TORCH_CHECK(p >= 0 && p < capacity, "position ", p, " lies outside the arena [0, ", capacity, ")");
      const float* token = qp + (i * t + j) * width;
      for (int64_t h = 0; h < hkv; ++h) {
        const int64_t slot = ((i * hkv + h) * capacity + p) * d;
        rotate(token + (hq + h) * d, cos_at(i, j), sin_at(i, j), d, kp + slot);
        std::copy(token + (hq + hkv + h) * d, token + (hq + hkv + h + 1) * d, vp + slot);
      }
    }
  const auto fscale = static_cast<float>(scale);
  // a query [D], then its scores (a window's or the arena's keys, and a vector's slack)
  float* const q = dflash_scratch::buffer<float, struct AttentionFloats>(d + capacity + kLanes);
  float* const scores = q + d;
  for (int64_t i = 0; i < batch; ++i)
    for (int64_t j = 0; j < t; ++j) {
      const int64_t p = pos[i * t + j];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, p - sliding_window + 1) : 0;
      const int64_t count = p - first + 1;
      for (int64_t head = 0; head < hq; ++head) {
        const int64_t h = head / group;
        rotate(qp + (i * t + j) * width + head * d, cos_at(i, j), sin_at(i, j), d, q);
        const float* key = kp + ((i * hkv + h) * capacity + first) * d;
        const float* value = vp + ((i * hkv + h) * capacity + first) * d;
        float most = sp ? sp[head] : -std::numeric_limits<float>::infinity();
        int64_t first_single = 0;
#if defined(__AVX2__)
        // kLanes keys at a time: as many independent sums, reduced together (one key's sum chains its FMAs and ends
        // in a horizontal sum of its own: the whole attention 0.77x its time for 1 or 8 queries on an AVX2 EPYC,
        // round 24). Which keys take this path depends only on the query's position, so a token's scores are the
        // same in an AR step and in a verify.
        fvec peak = splat(most);
        for (; first_single + kLanes <= count; first_single += kLanes) {
          const float* keys = key + first_single * d;
          fvec acc[kLanes];
          for (int u = 0; u < kLanes; ++u) acc[u] = load(q) * load(keys + u * d);
          for (int64_t e = kLanes; e < d; e += kLanes)
            for (int u = 0; u < kLanes; ++u) acc[u] += load(q + e) * load(keys + u * d + e);
          const fvec s = lane_sums(acc) * fscale;
          store(scores + first_single, s);
          peak = s > peak ? s : peak;
        }
        for (int u = 0; u < kLanes; ++u) most = std::max(most, peak[u]);
#endif
        for (int64_t k = first_single; k < count; ++k) {
          fvec acc = load(q) * load(key + k * d);
          for (int64_t e = kLanes; e < d; e += kLanes) acc += load(q + e) * load(key + k * d + e);
          scores[k] = lane_sum(acc) * fscale;
          most = std::max(most, scores[k]);
        }
        float total = sp ? std::exp(sp[head] - most) : 0.f;
        int64_t k = 0;
        fvec lanes{};
        for (; k + kLanes <= count; k += kLanes) {
          const fvec e = vexp(load(scores + k) - most);
          store(scores + k, e);
          lanes += e;
        }
        total += lane_sum(lanes);
        for (; k < count; ++k) total += (scores[k] = std::exp(scores[k] - most));
        float* o = op + (i * t + j) * hq * d + head * d;
        for (int64_t e0 = 0; e0 < d; e0 += 4 * kLanes) switch (std::min<int64_t>(4, (d - e0) / kLanes)) {
            case 4: weighted_values<4>(scores, value, count, d, e0, total, o); break;
            case 3: weighted_values<3>(scores, value, count, d, e0, total, o); break;
            case 2: weighted_values<2>(scores, value, count, d, e0, total, o); break;
            default: weighted_values<1>(scores, value, count, d, e0, total, o); break;
          }
      }
    }
  return out;
}

}  // namespace dflash_attention
