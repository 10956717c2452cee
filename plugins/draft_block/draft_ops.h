// The drafter step's work between its GEMMs, on CPU in float32, one call each (part of cpu_kernel.cpp's module;
// reference.py defines the attention's semantics).
//
// Why compiled: on a small drafter a CPU step is bound by the count of tensor ops torch eager dispatches,
// not by arithmetic. `draft_block_attention` replaces the ~15 ops a layer's QK-norm, RoPE, arena write/read
// and attention took: with `q_norm` given it applies the layer's QK-norm (RMSNorm over each head, times the
// weight) and the rotation by cos/sin (`rope.rotate`: x * cos + roll(x, D/2) * sin, sin signed) to q and k_blk
// first, so the raw q/k/v GEMM output goes in as strided views, and the block's K/V stay in the call (the
// arena is only read, on [0, ctx_lens[i])). The others fuse a residual add with the next RMSNorm, SwiGLU's
// gate, the committed tokens' context K/V writes and the greedy drafts with their confidence (the norms: ../norms.h).

#pragma once

#include <torch/extension.h>

#include "../norms.h"
#include "../scratch.h"
#include "../vector_math.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace dflash_vec;
using dflash_norms::rows_of;

// x [D] (stride 1) -> out: RMSNorm times w, then the rotation; without w, a copy.
void prologue(const float* x, int64_t d, const float* w, const float* cos, const float* sin, float eps,
              float* normed, float* out) {
  if (w == nullptr) {
    std::copy(x, x + d, out);
    return;
  }
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t e = 0; e < d; ++e) sum += x[e] * x[e];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(d) + eps);
#pragma omp simd
  for (int64_t e = 0; e < d; ++e) normed[e] = x[e] * inv * w[e];
  rotate(normed, cos, sin, d, out);
}

constexpr int64_t kKeys = 8;
constexpr int64_t kValueTile = 32;  // keys whose value rows one pass of the weighted sum keeps in L1

void check(const torch::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() == dims, name, " must have ", dims, " dimensions, got ", t.dim());
  TORCH_CHECK(t.stride(-1) == 1, name, "'s last dimension must be contiguous");
}

}  // namespace

// q [R, Hq, D], k_blk / v_blk [R, Hkv, D] (R = b * B; any strides but the last), ctx_k / ctx_v
// [b, Hkv, S, D], ctx_lens int64 [b]; sliding_window <= 0 for none. Optional prologue: q_norm, k_norm
// [D] and cos / sin [R, D] (all or none). -> [R, Hq * D], contiguous.
inline torch::Tensor draft_block_attention(torch::Tensor q, torch::Tensor k_blk, torch::Tensor v_blk, torch::Tensor ctx_k,
                                    torch::Tensor ctx_v, torch::Tensor ctx_lens, double scale, int64_t sliding_window,
                                    c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm,
                                    c10::optional<torch::Tensor> cos, c10::optional<torch::Tensor> sin, double eps) {
  check(q, "q", 3);
  check(k_blk, "k_blk", 3);
  check(v_blk, "v_blk", 3);
  check(ctx_k, "ctx_k", 4);
  check(ctx_v, "ctx_v", 4);
  TORCH_CHECK(ctx_lens.scalar_type() == torch::kInt64 && ctx_lens.dim() == 1, "ctx_lens must be int64 [b]");
  const int64_t rows = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t batch = ctx_k.size(0), hkv = ctx_k.size(1), capacity = ctx_k.size(2);
  TORCH_CHECK(batch > 0 && rows % batch == 0, "q's rows must be a multiple of the batch");
  TORCH_CHECK(hq % hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k_blk.size(0) == rows && k_blk.size(1) == hkv && k_blk.size(2) == d, "k_blk does not match q / ctx_k");
  TORCH_CHECK(v_blk.sizes() == k_blk.sizes() && ctx_v.sizes() == ctx_k.sizes() && ctx_k.size(3) == d,
              "v_blk / ctx_v do not match k_blk / ctx_k");
  TORCH_CHECK(ctx_lens.size(0) == batch, "ctx_lens must have one entry per request");
  TORCH_CHECK(d % kSizeMultiple == 0, "head_dim must be a multiple of ", kSizeMultiple, ", got ", d);
  const bool normed = q_norm.has_value();
  TORCH_CHECK(normed == k_norm.has_value() && normed == cos.has_value() && normed == sin.has_value(),
              "give q_norm, k_norm, cos and sin together, or none of them");
  if (normed) {
    for (const auto* t : {&*q_norm, &*k_norm})
      TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->numel() == d && t->is_contiguous(),
                  "norm weights must be float32 [D]");
    check(*cos, "cos", 2);
    check(*sin, "sin", 2);
    TORCH_CHECK(cos->size(0) == rows && cos->size(1) == d && sin->sizes() == cos->sizes(), "cos / sin must be [R, D]");
  }
  const int64_t block = rows / batch, group = hq / hkv;
  auto out = torch::empty({rows, hq * d}, q.options());
  const auto lens = ctx_lens.contiguous();
  const int64_t* len = lens.data_ptr<int64_t>();
  const float *qp = q.data_ptr<float>(), *kp = k_blk.data_ptr<float>(), *vp = v_blk.data_ptr<float>();
  const float *ckp = ctx_k.data_ptr<float>(), *cvp = ctx_v.data_ptr<float>();
  const float* qw = normed ? q_norm->data_ptr<float>() : nullptr;
  const float* kw = normed ? k_norm->data_ptr<float>() : nullptr;
  const float* cp = normed ? cos->data_ptr<float>() : nullptr;
  const float* sp = normed ? sin->data_ptr<float>() : nullptr;
  const int64_t cs = normed ? cos->stride(0) : 0, ss = normed ? sin->stride(0) : 0;
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale), feps = static_cast<float>(eps);

  // Per request and KV head, the tile is the group's rows = (query head, slot) pairs, padded to whole vectors
  // and held transposed ([D][rows]: a key's scores for every row are a few vector FMAs per dimension); the
  // scores [keys][rows] likewise.
  const int64_t tile = group * block, width = (tile + kLanes - 1) / kLanes * kLanes;
  // keys [B][D], scratch [D], query [D], queries_t and out_t [D][width], scores [keys][width], total [width], zeros [D]
  float* const keys = dflash_scratch::buffer<float, struct DraftAttentionFloats>(
      block * d + 3 * d + 2 * d * width + (capacity + block) * width + width);
  float *scratch = keys + block * d, *query = scratch + d, *queries_t = query + d, *out_t = queries_t + d * width;
  float *scores = out_t + d * width, *total = scores + (capacity + block) * width, *zeros = total + width;
  std::fill(queries_t, queries_t + d * width, 0.f);  // the padding rows stay zero
  std::fill(zeros, zeros + d, 0.f);
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t n = len[i];
    TORCH_CHECK(n >= 0 && n <= capacity, "ctx_lens[", i, "] = ", n, " lies outside [0, ", capacity, "]");
    // slot j at position n + j sees context p > n + j - W (slot 0 the fewest), and every block key
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, n - sliding_window + 1) : 0;
    const int64_t context = n - first, seen = context + block;  // keys: context [first, n), then the block's
    for (int64_t g = 0; g < hkv; ++g) {
      const float* ck = ckp + i * ctx_k.stride(0) + g * ctx_k.stride(1) + first * ctx_k.stride(2);
      const float* cv = cvp + i * ctx_v.stride(0) + g * ctx_v.stride(1) + first * ctx_v.stride(2);
      for (int64_t j = 0; j < block; ++j) {  // the block's keys, normed and rotated once for the group
        const int64_t r = i * block + j;
        prologue(kp + r * k_blk.stride(0) + g * k_blk.stride(1), d, kw, cp + r * cs, sp + r * ss, feps,
                 scratch, keys + j * d);
        for (int64_t h = 0; h < group; ++h) {
          prologue(qp + r * q.stride(0) + (g * group + h) * q.stride(1), d, qw, cp + r * cs, sp + r * ss, feps,
                   scratch, query);
          for (int64_t e = 0; e < d; ++e) queries_t[e * width + h * block + j] = query[e] * fscale;
        }
      }
      // scores, eight keys at a time: eight independent FMA chains (one would wait on its own latency)
      for (int64_t p0 = 0; p0 < seen; p0 += kKeys) {
        const float* key[kKeys];
        for (int64_t u = 0; u < kKeys; ++u) {
          const int64_t p = p0 + u;
          key[u] = p >= seen ? zeros : p < context ? ck + p * ctx_k.stride(2) : keys + (p - context) * d;
        }
        for (int64_t t = 0; t < width; t += kLanes) {
          fvec s[kKeys] = {};
          for (int64_t e = 0; e < d; ++e) {
            const fvec qe = load(queries_t + e * width + t);
            for (int64_t u = 0; u < kKeys; ++u) s[u] += qe * key[u][e];
          }
          for (int64_t u = 0; u < kKeys && p0 + u < seen; ++u) store(scores + (p0 + u) * width + t, s[u]);
        }
      }
      if (sliding_window > 0) {  // slot j sees context from max(0, n + j - W + 1): later slots lose a few more
        for (int64_t j = 1; j < block; ++j)
          for (int64_t p = first; p < std::min(n, std::max<int64_t>(0, n + j - sliding_window + 1)); ++p)
            for (int64_t h = 0; h < group; ++h)
              scores[(p - first) * width + h * block + j] = -std::numeric_limits<float>::infinity();
      }
      for (int64_t t = 0; t < width; t += kLanes) {
        fvec most = splat(-std::numeric_limits<float>::infinity());
        for (int64_t p = 0; p < seen; ++p) {
          const fvec x = load(scores + p * width + t);
          most = x > most ? x : most;
        }
        fvec sum{};
        for (int64_t p = 0; p < seen; ++p) {
          const fvec w = vexp(load(scores + p * width + t) - most);
          store(scores + p * width + t, w);
          sum += w;
        }
        store(total + t, sum);
      }
      // out^T [D][rows] = sum over keys of v_p^T * weights_p: per tile of kValueTile keys, eight
      // dimensions at a time in registers (accumulators in L1 cost a store per FMA, which bounds the loop)
      std::fill(out_t, out_t + d * width, 0.f);
      for (int64_t p0 = 0; p0 < seen; p0 += kValueTile) {
        const int64_t p1 = std::min<int64_t>(seen, p0 + kValueTile);
        const float* rows_v[kValueTile];
        for (int64_t p = p0; p < p1; ++p)
          rows_v[p - p0] = p < context ? cv + p * ctx_v.stride(2)
                                       : vp + (i * block + p - context) * v_blk.stride(0) + g * v_blk.stride(1);
        for (int64_t t = 0; t < width; t += kLanes)
          for (int64_t e = 0; e < d; e += 8) {
            float* o = out_t + e * width + t;
            fvec a0 = load(o), a1 = load(o + width), a2 = load(o + 2 * width), a3 = load(o + 3 * width),
                 a4 = load(o + 4 * width), a5 = load(o + 5 * width), a6 = load(o + 6 * width), a7 = load(o + 7 * width);
            for (int64_t p = p0; p < p1; ++p) {
              const float* value = rows_v[p - p0] + e;
              const fvec w = load(scores + p * width + t);
              a0 += w * value[0]; a1 += w * value[1]; a2 += w * value[2]; a3 += w * value[3];
              a4 += w * value[4]; a5 += w * value[5]; a6 += w * value[6]; a7 += w * value[7];
            }
            store(o, a0); store(o + width, a1); store(o + 2 * width, a2); store(o + 3 * width, a3);
            store(o + 4 * width, a4); store(o + 5 * width, a5); store(o + 6 * width, a6); store(o + 7 * width, a7);
          }
      }
      for (int64_t h = 0; h < group; ++h)
        for (int64_t j = 0; j < block; ++j) {
          const int64_t t = h * block + j;
          const float inv = 1.f / total[t];
          float* o = op + (i * block + j) * hq * d + (g * group + h) * d;
          for (int64_t e = 0; e < d; ++e) o[e] = out_t[e * width + t] * inv;
        }
    }
  }
  return out;
}

namespace {

template <typename T>
void silu_mul_rows(const T* gate_up, int64_t rows, int64_t half, T* out) {
  float gate[kLanes], up[kLanes], result[kLanes];
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * 2 * half;
    T* o = out + r * half;
    for (int64_t e = 0; e < half; e += kLanes) {
      const int64_t lanes = std::min(kLanes, half - e);
      if constexpr (std::is_same_v<T, float>) {
        if (lanes == kLanes) {  // whole float32 vectors straight from and to memory: 6x fewer instructions
          const fvec x = load(g + e);
          store(o + e, x / (1.f + vexp(-x)) * load(g + half + e));
          continue;
        }
      }
      for (int64_t l = 0; l < kLanes; ++l) {
        gate[l] = l < lanes ? static_cast<float>(g[e + l]) : 0.f;
        up[l] = l < lanes ? static_cast<float>(g[half + e + l]) : 0.f;
      }
      const fvec x = load(gate);
      store(result, x / (1.f + vexp(-x)) * load(up));
      for (int64_t l = 0; l < lanes; ++l) o[e + l] = static_cast<T>(result[l]);
    }
  }
}

}  // namespace

// SwiGLU's gate: gate_up [..., 2I] (float32 or bf16; gate, then up) -> silu(gate) * up [..., I], same dtype
// (computed in float32, rounded once).
inline torch::Tensor silu_mul(torch::Tensor gate_up) {
  const int64_t width = gate_up.size(-1), half = width / 2, rows = gate_up.numel() / std::max<int64_t>(width, 1);
  TORCH_CHECK(width % 2 == 0, "gate_up's last dimension must be even");
  auto sizes = gate_up.sizes().vec();
  sizes.back() = half;
  auto out = torch::empty(sizes, gate_up.options());
  if (gate_up.scalar_type() == torch::kFloat32) {
    silu_mul_rows(rows_of<float>(gate_up, width, "gate_up"), rows, half, out.data_ptr<float>());
  } else {
    TORCH_CHECK(gate_up.scalar_type() == torch::kBFloat16, "gate_up must be float32 or bfloat16");
    silu_mul_rows(rows_of<c10::BFloat16>(gate_up, width, "gate_up"), rows, half, out.data_ptr<c10::BFloat16>());
  }
  return out;
}

// Committed tokens' context K/V into the arena, every layer at once: keys_raw / values_raw [b, n, L * Hkv, D]
// (the context projection's output, layer-major heads; any strides but the last), k_norm [L, D] (each layer's
// k_norm weight), cos / sin [b, n, D]; keys / values: the arena [L, b, Hkv, S, D] (contiguous). Each key head
// gets its layer's RMSNorm and the rotation, as `write_context` applies them. Token t of row i goes to
// position positions[i, t] or, without positions, start + t.
inline void write_context_kv(torch::Tensor keys_raw, torch::Tensor values_raw, torch::Tensor k_norm, torch::Tensor cos,
                      torch::Tensor sin, torch::Tensor keys, torch::Tensor values, c10::optional<torch::Tensor> positions,
                      int64_t start, double eps) {
  check(keys_raw, "keys_raw", 4);
  check(values_raw, "values_raw", 4);
  check(cos, "cos", 3);
  check(sin, "sin", 3);
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.dim() == 5 && keys.sizes() == values.sizes() &&
                  keys.scalar_type() == torch::kFloat32 && values.scalar_type() == torch::kFloat32,
              "the arena must be float32 [L, b, Hkv, S, D], contiguous");
  const int64_t layers = keys.size(0), batch = keys.size(1), hkv = keys.size(2), capacity = keys.size(3), d = keys.size(4);
  const int64_t n = keys_raw.size(1);
  TORCH_CHECK(keys_raw.size(0) == batch && keys_raw.size(2) == layers * hkv && keys_raw.size(3) == d &&
                  values_raw.sizes() == keys_raw.sizes(), "keys_raw / values_raw must be [b, n, L * Hkv, D]");
  TORCH_CHECK(cos.size(0) == batch && cos.size(1) == n && cos.size(2) == d && sin.sizes() == cos.sizes(),
              "cos / sin must be [b, n, D]");
  TORCH_CHECK(k_norm.scalar_type() == torch::kFloat32 && k_norm.is_contiguous() && k_norm.numel() == layers * d,
              "k_norm must be float32 [L, D]");
  torch::Tensor where;
  if (positions.has_value()) {
    where = positions->contiguous();
    TORCH_CHECK(where.scalar_type() == torch::kInt64 && where.dim() == 2 && where.size(0) == batch && where.size(1) == n,
                "positions must be int64 [b, n]");
  }
  const int64_t* pos = positions.has_value() ? where.data_ptr<int64_t>() : nullptr;
  const float *kr = keys_raw.data_ptr<float>(), *vr = values_raw.data_ptr<float>(), *wn = k_norm.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *kp = keys.data_ptr<float>(), *vp = values.data_ptr<float>();
  std::vector<float> scratch(d);
  for (int64_t i = 0; i < batch; ++i)
    for (int64_t t = 0; t < n; ++t) {
      const int64_t p = pos ? pos[i * n + t] : start + t;
      TORCH_CHECK(p >= 0 && p < capacity, "position ", p, " lies outside the arena [0, ", capacity, ")");
      const float* c = cp + i * cos.stride(0) + t * cos.stride(1);
      const float* s = sp + i * sin.stride(0) + t * sin.stride(1);
      for (int64_t l = 0; l < layers; ++l)
        for (int64_t h = 0; h < hkv; ++h) {
          const int64_t head = l * hkv + h, slot = (((l * batch + i) * hkv + h) * capacity + p) * d;
          prologue(kr + i * keys_raw.stride(0) + t * keys_raw.stride(1) + head * keys_raw.stride(2), d, wn + l * d, c, s,
                   static_cast<float>(eps), scratch.data(), kp + slot);
          const float* v = vr + i * values_raw.stride(0) + t * values_raw.stride(1) + head * values_raw.stride(2);
          std::copy(v, v + d, vp + slot);
        }
    }
}

// The first index of the maximum of row[0, vocab) (argmax's answer; NaNs are skipped), and the maximum.
inline int64_t first_max(const float* row, int64_t vocab, float* most_out) {
  const int64_t whole = vocab / kLanes * kLanes;
  fvec lane_max = splat(-std::numeric_limits<float>::infinity());
  for (int64_t e = 0; e < whole; e += kLanes) {
    const fvec x = load(row + e);
    lane_max = x > lane_max ? x : lane_max;
  }
  float most = -std::numeric_limits<float>::infinity();
  for (int64_t l = 0; l < kLanes; ++l) most = std::max(most, lane_max[l]);
  for (int64_t e = whole; e < vocab; ++e) most = std::max(most, row[e]);
  int64_t index = 0;
  while (index < vocab && !(row[index] == most)) ++index;
  *most_out = most;
  return std::min(index, vocab - 1);
}

// Drafts int64 [b, K] beside a verify's `batch` x `width` = K + 1 rows (`beside` names that tensor in the error),
// each row's K contiguous, rows any distance apart: the drafts of a verify block [b, K + 1] are its view [:, 1:].
inline void check_drafts(const torch::Tensor& drafts, int64_t batch, int64_t width, const char* beside) {
  TORCH_CHECK(drafts.scalar_type() == torch::kInt64 && drafts.dim() == 2 && drafts.size(0) == batch &&
                  drafts.size(1) + 1 == width && (drafts.size(1) < 2 || drafts.stride(1) == 1),
              "drafts must be int64 [b, K], each row contiguous, beside ", beside);
}

// The greedy accept rule over a verify of `width` = K + 1 rows per request, drafts [batch, K] with rows
// `drafts_stride` apart: argmax(row) gives the target's token of block row `row` (request r's rows are r * width ...),
// read only up to each request's first mismatch.
template <typename Argmax>
void accept_scan(int64_t batch, int64_t width, const int64_t* drafts, int64_t drafts_stride, Argmax argmax,
                 int64_t* accepted, int64_t* bonus) {
  for (int64_t r = 0; r < batch; ++r) {
    int64_t j = 0, token = argmax(r * width);
    while (j + 1 < width && token == drafts[r * drafts_stride + j]) {
      ++j;
      token = argmax(r * width + j);
    }
    accepted[r] = j;
    bonus[r] = token;
  }
}

// The greedy accept rule on the verify's logits [b, K + 1, V] (float32, contiguous) and the drafts int64 [b, K]
// (`check_drafts`): per request, the drafts accepted (the leading ones equal to the target's argmax after the position
// before them) and the bonus (the target's argmax at the first mismatch, or after the last draft). Rows past a
// request's first mismatch are not read. -> (num_accepted int64 [b], bonus int64 [b]).
inline std::vector<torch::Tensor> greedy_verify(torch::Tensor logits, torch::Tensor drafts) {
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32 && logits.dim() == 3, "logits must be float32 [b, K + 1, V]");
  check_drafts(drafts, logits.size(0), logits.size(1), "logits [b, K + 1, V]");
  const int64_t batch = logits.size(0), width = logits.size(1), vocab = logits.size(2);
  const float* lp = rows_of<float>(logits, vocab, "logits");
  auto accepted = torch::empty({batch}, drafts.options()), bonus = torch::empty({batch}, drafts.options());
  float most;
  accept_scan(batch, width, drafts.data_ptr<int64_t>(), drafts.stride(0),
              [&](int64_t row) { return first_max(lp + row * vocab, vocab, &most); },
              accepted.data_ptr<int64_t>(), bonus.data_ptr<int64_t>());
  return {accepted, bonus};
}

// Greedy drafts and their confidence in one pass over logits [..., V] (float32, contiguous): per row the first
// index of the maximum (argmax's answer) and the softmax's peak, 1 / sum(e^(l - max)).
inline std::vector<torch::Tensor> greedy_peak(torch::Tensor logits) {
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32, "logits must be float32");
  const int64_t vocab = logits.size(-1), rows = logits.numel() / std::max<int64_t>(vocab, 1);
  const float* lp = rows_of<float>(logits, vocab, "logits");
  auto sizes = logits.sizes().vec();
  sizes.pop_back();
  auto tokens = torch::empty(sizes, logits.options().dtype(torch::kInt64));
  auto peak = torch::empty(sizes, logits.options());
  int64_t* tp = tokens.data_ptr<int64_t>();
  float* pp = peak.data_ptr<float>();
  const int64_t whole = vocab / kLanes * kLanes;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = lp + r * vocab;
    float most;
    const int64_t index = first_max(row, vocab, &most);
    fvec lane_sum{};
    for (int64_t e = 0; e < whole; e += kLanes) lane_sum += vexp(load(row + e) - most);
    float total = 0.f;
    for (int64_t l = 0; l < kLanes; ++l) total += lane_sum[l];
    for (int64_t e = whole; e < vocab; ++e) total += std::exp(row[e] - most);
    tp[r] = index;
    pp[r] = 1.f / total;
  }
  return {tokens, peak};
}
