// The gpt-oss target's MoE and attention on CPU, one call each, and its decoder layers in one call (plugins/target/cpu.py
// builds and loads this file; models/target.py holds the torch formulations they replace: `routed_experts`,
// `GptOssTarget.attention`).
//
// Why compiled: on a small target a CPU step is bound by the count of tensor ops torch eager dispatches and by
// Python, not by its GEMMs (docs/benchmarks.md, round 17).
// - `route` and `routed_experts` replace a layer's router (3 ops) and the ~25 ops and the Python loop over
//   routed experts of its MoE: each expert that some token routes to multiplies its rows in one pass over its weights (float32,
//   or bf16 pairs that hold them exactly, widened in registers), with the bias, gpt-oss's clamped SwiGLU on
//   interleaved gate/up columns, the down projection and the routing weight; a token's top-k outputs are then
//   summed in slot order, as the torch formulation does. `linear` serves the attention's q/k/v and o_proj with
//   the same tiles.
// - `sink_attention` (attention.h) replaces a layer's RoPE, K/V arena write and read, per-step masks and the fused attention
//   with its sink rescaling: it rotates and writes the step's keys, then each query attends to the positions
//   at or before its own (within the sliding window), the sink one more logit without a value.
// - `TargetStep` chains them (with the norms of ../norms.h) over every layer of a step.
// Float32 products and sums throughout: the torch formulations' numbers up to summation order and the exp
// (vector_math.h: < 3e-7 relative).

#include <torch/extension.h>

#include "../vector_math.h"
#include "amx_gemm.h"
#include "attention.h"
#include "../norms.h"
#include "../scratch.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using namespace dflash_vec;
using dflash_vec::load;  // beside the int8 overload below (an overload here would hide it otherwise)
constexpr int64_t kTile = 64;  // a weight tile's columns (int8 experts are stored tile by tile: cpu.py `TILE`)
constexpr int64_t kTail = kSizeMultiple;  // the columns of the tiles after the last whole one (cpu.py `LANES`)
constexpr int64_t kAhead = 16;  // weight rows a tile prefetches ahead
// A GEMM pass: kRows rows times kPassColumns columns of accumulators, held in registers with the pass's weights
#if defined(__AVX512F__)
constexpr int kRows = 4;
constexpr int64_t kPassColumns = 64;  // 16 accumulators, 4 weights of 32 registers
constexpr int kPairRows = 4;  // the same on bf16 pairs: 16 accumulators and 8 widened weights
#else
constexpr int kRows = 2;
constexpr int64_t kPassColumns = 32;  // 8 accumulators, 4 weights of 16 (AVX2; 4 rows or 64 columns spilled, round 23)
constexpr int kPairRows = 3;  // bf16 pairs: 3 rows the fastest from 1 to 16 rows though 12 + 8 vectors spill (round 24)
#endif
inline fvec load(const int8_t* p) {  // int8 -> float32, exactly
#if defined(__AVX512F__)
  return reinterpret_cast<fvec>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  return reinterpret_cast<fvec>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else  // an x86-64 CPU without AVX2: whatever the compiler makes of it, so that the module still builds
  typedef int8_t bytes_u __attribute__((vector_size(kLanes), aligned(1)));
  return __builtin_convertvector(*reinterpret_cast<const bytes_u*>(p), fvec);
#endif
}

// y[r][c0 : c0 + NV kLanes] = x[r] @ w[:, c0 : ...] (+ bias) for NR rows: one pass over the weight tile, NR x NV
// accumulators in registers. `w` points at the tile's first column, input rows `ld` apart: the matrix's width, or
// the tile's own where the matrix is stored tile by tile (`tile_major`).
template <int NR, int NV, typename W>
void tile(const float* const* x, int64_t in, const W* w, int64_t ld, const float* bias, float* const* y, int64_t c0) {
  fvec acc[NR][NV] = {};
  constexpr int64_t kLine = 64 / sizeof(W);  // weights per cache line
  for (int64_t h = 0; h < in; ++h) {
    // a tile reads one short run per weight row, rows `ld` apart: fetch a few rows ahead, which the hardware
    // prefetcher does not do for such strides (a lone token's experts come from memory: -35% of their time)
    for (int64_t e = 0; e < NV * kLanes; e += kLine) __builtin_prefetch(w + (h + kAhead) * ld + e);
    fvec wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = load(w + h * ld + v * kLanes);
    for (int r = 0; r < NR; ++r) {
      const fvec xs = splat(x[r][h]);
      for (int v = 0; v < NV; ++v) acc[r][v] = fmadd(xs, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v)
      store(y[r] + c0 + v * kLanes, bias ? acc[r][v] + load(bias + c0 + v * kLanes) : acc[r][v]);
}

// A matrix [in, out] in bf16, two input rows a word (cpu.py `Bf16Pairs`): word [p][c] holds w[2p][c] in its low
// half and w[2p + 1][c] in its high half, so one load and a shift and a mask widen two weight vectors, where a bf16
// matrix [in, out] costs a widening load and a shift each (a q/k/v GEMM 0.6x the time, at 1 row as at 8, on an
// AVX2 EPYC; round 24). The products and the order of the sums are the plain tile's.
struct Bf16Pairs {
  const uint32_t* words;
};

template <int NR, int NV>
void tile(const float* const* x, int64_t in, Bf16Pairs w, int64_t ld, const float* bias, float* const* y,
          int64_t c0) {
  fvec acc[NR][NV] = {};
  const ivec high_half = ivec{} + static_cast<int32_t>(0xFFFF0000u);
  for (int64_t h = 0; h < in; h += 2) {
    const uint32_t* row = w.words + h / 2 * ld;
    for (int64_t e = 0; e < NV * kLanes; e += 16) __builtin_prefetch(row + kAhead / 2 * ld + e);
    fvec even[NV], odd[NV];
    for (int v = 0; v < NV; ++v) {
      const ivec word = reinterpret_cast<ivec>(load(reinterpret_cast<const float*>(row + v * kLanes)));
      even[v] = reinterpret_cast<fvec>(word << 16);
      odd[v] = reinterpret_cast<fvec>(word & high_half);
    }
    for (int r = 0; r < NR; ++r) {
      const fvec xe = splat(x[r][h]), xo = splat(x[r][h + 1]);
      for (int v = 0; v < NV; ++v) acc[r][v] = fmadd(xo, odd[v], fmadd(xe, even[v], acc[r][v]));
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v)
      store(y[r] + c0 + v * kLanes, bias ? acc[r][v] + load(bias + c0 + v * kLanes) : acc[r][v]);
}

// One column tile for every row, NR rows at a time (the tile stays in cache between row blocks). `W`: a weight
// pointer at the tile's first column, or `Bf16Pairs` there.
template <int NV, int NR = kRows, typename W>
void rows_tile(const float* const* x, int64_t rows, int64_t in, W w, int64_t ld, const float* bias,
               float* const* y, int64_t c0) {
  int64_t r0 = 0;
  for (; r0 + NR <= rows; r0 += NR) tile<NR, NV>(x + r0, in, w, ld, bias, y + r0, c0);
  if constexpr (NR > 1)
    if (r0 < rows) rows_tile<NV, NR - 1>(x + r0, rows - r0, in, w, ld, bias, y + r0, c0);
}

// Rows x[r] [in] (any addresses) times w [in, out] plus bias [out] (or none) -> y[r] [out], columns
// [c_begin, c_end) (multiples of 16). `tile_major`: w stored tile by tile (64 columns, then 16 at a time), each
// tile's rows contiguous, so a tile streams from memory instead of reading a short run every `out` weights (then
// [c_begin, c_end) must be whole tiles).
template <typename W>
void linear_rows(const float* const* x, int64_t rows, int64_t in, const W* w, int64_t out, const float* bias,
                 float* const* y, int64_t c_begin, int64_t c_end, bool tile_major = false) {
  const auto at = [&](int64_t c0, int64_t width) {  // a tile: its first weight, its row stride, its passes
    const W* first = tile_major ? w + c0 * in : w + c0;
    const int64_t ld = tile_major ? width : out;
    int64_t v = 0;
    for (; v + kPassColumns <= width; v += kPassColumns)
      rows_tile<kPassColumns / kLanes>(x, rows, in, first + v, ld, bias, y, c0 + v);
    for (; v < width; v += kLanes) rows_tile<1>(x, rows, in, first + v, ld, bias, y, c0 + v);
  };
  int64_t c0 = c_begin;
  for (; c0 + kTile <= c_end; c0 += kTile) at(c0, kTile);
  for (; c0 < c_end; c0 += kTail) at(c0, kTail);
}

// The same on bf16 pairs (`tile_major` does not apply).
void linear_rows(const float* const* x, int64_t rows, int64_t in, Bf16Pairs w, int64_t out, const float* bias,
                 float* const* y, int64_t c_begin, int64_t c_end, bool = false) {
  int64_t c0 = c_begin;
  for (; c0 + kPassColumns <= c_end; c0 += kPassColumns)
    rows_tile<kPassColumns / kLanes, kPairRows>(x, rows, in, Bf16Pairs{w.words + c0}, out, bias, y, c0);
  for (; c0 < c_end; c0 += kLanes) rows_tile<1, kPairRows>(x, rows, in, Bf16Pairs{w.words + c0}, out, bias, y, c0);
}

// Expert e's matrix of `size` weights in a stack of them.
template <typename W>
W expert_at(W w, int64_t e, int64_t size) {
  return w + e * size;
}
inline Bf16Pairs expert_at(Bf16Pairs w, int64_t e, int64_t size) { return {w.words + e * size / 2}; }

// The same on AMX tiles (`amx_gemm.h`; `tile_major` does not apply: the tiles are their own layout).
void linear_rows(const float* const* x, int64_t rows, int64_t in, dflash_amx::Tiles w, int64_t /* out */,
                 const float* bias, float* const* y, int64_t c_begin, int64_t c_end, bool = false) {
  dflash_amx::rows_times(x, rows, in, w, bias, y, c_begin, c_end);
}

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

}  // namespace

// gpt-oss's router on x float32 [n, H]: logits x @ weight.T + bias (weight float32 [E, H], bias [E]), each token's
// top_k of them (largest first; of equal ones the lower expert) -> (indices int64 [n, k], their softmax float32 [n, k]).
std::vector<torch::Tensor> route(torch::Tensor x, torch::Tensor weight, torch::Tensor bias, int64_t top_k) {
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
torch::Tensor routed_experts(torch::Tensor x, torch::Tensor indices, torch::Tensor scores, torch::Tensor gate_up,
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
torch::Tensor moe(torch::Tensor x, torch::Tensor router_weight, torch::Tensor router_bias, int64_t top_k,
                  torch::Tensor gate_up, torch::Tensor gate_up_bias, torch::Tensor down, torch::Tensor down_bias,
                  double alpha, double limit, c10::optional<torch::Tensor> gate_up_scales,
                  c10::optional<torch::Tensor> down_scales, bool tiles) {
  const auto routed = route(x, router_weight, router_bias, top_k);
  return routed_experts(x, routed[0], routed[1], gate_up, gate_up_bias, down, down_bias, alpha, limit, gate_up_scales,
                        down_scales, tiles);
}

// x float32 [..., in] (contiguous) times weight [in, out] (float32, or bf16 pairs: int32 [in / 2, out] words,
// `Bf16Pairs`; contiguous) plus bias float32 [out] or None -> float32 [..., out]; out a multiple of 16. `tiles`:
// weight is bf16 AMX tiles (`amx_gemm.h`) viewed as [in, out], in a multiple of 32. Columns split over torch's
// intra-op threads.
torch::Tensor linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias, bool tiles) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 CPU tensor");
  const bool pairs = weight.scalar_type() == torch::kInt32;
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.is_contiguous() &&
                  (weight.scalar_type() == torch::kFloat32 || pairs ||
                   (tiles && weight.scalar_type() == torch::kBFloat16)),
              "weight must be a contiguous float32 CPU tensor [in, out], int32 bf16 pairs [in / 2, out] or AMX tiles");
  const int64_t in = pairs ? 2 * weight.size(0) : weight.size(0), out = weight.size(1);
  TORCH_CHECK(x.size(-1) == in, "x's last dimension must be weight's inputs");
  TORCH_CHECK(out % kSizeMultiple == 0, "the output width must be a multiple of ", kSizeMultiple);
  TORCH_CHECK(!tiles || (weight.scalar_type() == torch::kBFloat16 && in % dflash_amx::kTileK == 0 &&
                         dflash_amx::available()),
              "AMX tiles need a bf16 weight, in a multiple of 32 and a CPU with AMX-BF16");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == out,
                "bias must be float32 [out]");
    bp = bias->data_ptr<float>();
  }
  const int64_t rows = x.numel() / std::max<int64_t>(in, 1);
  auto sizes = x.sizes().vec();
  sizes.back() = out;
  auto y = torch::empty(sizes, x.options());
  const float** x_rows = dflash_scratch::buffer<const float*, struct LinearInputs>(rows);
  float** y_rows = dflash_scratch::buffer<float*, struct LinearOutputs>(rows);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    x_rows[r] = xp + r * in;
    y_rows[r] = yp + r * out;
  }
  at::parallel_for(0, out / kTail, 256 / kTail, [&](int64_t first, int64_t last) {
    if (tiles)
      linear_rows(x_rows, rows, in, dflash_amx::Tiles{static_cast<const uint16_t*>(weight.data_ptr())}, out, bp, y_rows,
                  first * kTail, last * kTail);
    else if (pairs)
      linear_rows(x_rows, rows, in, Bf16Pairs{static_cast<const uint32_t*>(weight.data_ptr())}, out, bp, y_rows,
                  first * kTail, last * kTail);
    else
      linear_rows(x_rows, rows, in, weight.data_ptr<float>(), out, bp, y_rows, first * kTail, last * kTail);
  });
  return y;
}

// A linear map as `linear` takes it: weight [in, out] (float32, bf16 pairs or AMX tiles), bias or None, whether tiles.
using Linear = std::tuple<torch::Tensor, c10::optional<torch::Tensor>, bool>;
// A layer's MoE as `moe` takes it, after x: router weight and bias, top_k, gate_up and its bias, down and its bias,
// alpha, limit, the int8 experts' two scales or Nones, whether tiles (cpu.py `MoeCall`).
using Moe = std::tuple<torch::Tensor, torch::Tensor, int64_t, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                       double, double, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, bool>;

// The target's decoder layers for a step in one call (models/target.py `GptOssTarget.forward`'s lean path with every
// part compiled): the first RMSNorm, then per layer the q/k/v GEMM, `sink_attention`, o_proj, the residual add with
// the post-attention norm, `moe`, and the residual add with the next norm; the same kernels in the same order as the
// per-call path, so the same numbers. Why: the ~24 calls a step made from Python, each with its argument parsing
// and checks, took ~0.2 ms of a ~0.5 ms lone-token forward on an AVX2 EPYC (round 25).
class TargetStep {
 public:
  // Per layer: the fused q/k/v and o_proj, the sinks float32 [Hq] (or None), the sliding window (<= 0: none), the
  // post-attention norm's weight, the MoE, the norm after the layer (the next layer's input norm; after the last,
  // the final norm); norm weights float32 with at least H entries.
  TargetStep(torch::Tensor first_norm, std::vector<Linear> qkv, std::vector<Linear> o_proj,
             std::vector<c10::optional<torch::Tensor>> sinks, std::vector<int64_t> windows,
             std::vector<torch::Tensor> post_attention_norms, std::vector<Moe> moe, std::vector<torch::Tensor> next_norms,
             double eps, double scale)
      : first_norm_(std::move(first_norm)), qkv_(std::move(qkv)), o_proj_(std::move(o_proj)), sinks_(std::move(sinks)),
        windows_(std::move(windows)), post_attention_norms_(std::move(post_attention_norms)), moe_(std::move(moe)),
        next_norms_(std::move(next_norms)), eps_(eps), scale_(scale) {
    const size_t layers = qkv_.size();
    TORCH_CHECK(layers > 0 && o_proj_.size() == layers && sinks_.size() == layers && windows_.size() == layers &&
                    post_attention_norms_.size() == layers && moe_.size() == layers && next_norms_.size() == layers,
                "every per-layer list must have one entry per layer");
  }

  // tokens int64 [b, t], embedding float32 [V, H] (the target's), rope: `Rotary.table` float32 [P, 2, D] covering
  // every position, the arena's per-layer keys / values [b, Hkv, S, D], positions int64 [b, t], feature_layers:
  // layers whose output (the residual stream after them) to return. Looks the tokens' embeddings and cos / sin up
  // itself (two Python module calls less a step), writes the tokens' K/V -> (the final-normed hidden states [b, t, H],
  // the feature layers' outputs side by side [b, t, len * H], or an empty tensor without feature layers).
  std::vector<torch::Tensor> step(const torch::Tensor& tokens, const torch::Tensor& embedding, const torch::Tensor& rope,
                                  const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                                  const torch::Tensor& positions, const std::vector<int64_t>& feature_layers) const {
    const int64_t layers = qkv_.size();
    TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == torch::kInt64, "tokens must be int64 [b, t]");
    TORCH_CHECK(positions.sizes() == tokens.sizes() && positions.scalar_type() == torch::kInt64,
                "positions must be int64 [b, t], as tokens");
    TORCH_CHECK(embedding.dim() == 2 && embedding.scalar_type() == torch::kFloat32, "embedding must be float32 [V, H]");
    TORCH_CHECK(rope.dim() == 3 && rope.size(1) == 2 && rope.scalar_type() == torch::kFloat32,
                "rope must be the float32 cos/sin table [P, 2, D]");
    TORCH_CHECK(static_cast<int64_t>(keys.size()) == layers && static_cast<int64_t>(values.size()) == layers,
                "keys / values must hold one arena tensor per layer");
    for (const int64_t layer : feature_layers)
      TORCH_CHECK(layer >= 0 && layer < layers, "feature layer ", layer, " is not a layer of this target");
    const int64_t batch = tokens.size(0), t = tokens.size(1), hidden = embedding.size(1);
    auto x = embedding.index_select(0, tokens.reshape(-1)).view({batch, t, hidden});
    const auto picked = rope.index_select(0, positions.reshape(-1)).view({batch, t, 2, rope.size(2)});
    const auto cos = picked.select(2, 0), sin = picked.select(2, 1);
    auto h = rms_norm(x, first_norm_, eps_);
    std::vector<torch::Tensor> outputs;  // each layer's residual stream after it
    for (int64_t i = 0; i < layers; ++i) {
      const auto attended = dflash_attention::sink_attention(apply(qkv_[i], h), cos, sin, keys[i], values[i], positions,
                                                             windows_[i], sinks_[i], scale_);
      auto mid = add_rms_norm(x, apply(o_proj_[i], attended), post_attention_norms_[i], eps_);
      const auto rows = mid[1].view({batch * t, hidden});
      const auto experts = std::apply([&](const auto&... weights) { return moe(rows, weights...); }, moe_[i]);
      auto next = add_rms_norm(mid[0], experts.view({batch, t, hidden}), next_norms_[i], eps_);
      x = next[0];
      h = next[1];
      outputs.push_back(x);
    }
    std::vector<torch::Tensor> features;
    for (const int64_t layer : feature_layers) features.push_back(outputs[layer]);
    return {h, features.empty() ? torch::Tensor() : torch::cat(features, -1)};
  }

 private:
  static torch::Tensor apply(const Linear& map, const torch::Tensor& x) {
    return linear(x, std::get<0>(map), std::get<1>(map), std::get<2>(map));
  }

  torch::Tensor first_norm_;
  std::vector<Linear> qkv_, o_proj_;
  std::vector<c10::optional<torch::Tensor>> sinks_;
  std::vector<int64_t> windows_;
  std::vector<torch::Tensor> post_attention_norms_;
  std::vector<Moe> moe_;
  std::vector<torch::Tensor> next_norms_;
  double eps_, scale_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "x @ weight [in, out] + bias (float32 math; float32 weight, bf16 pairs or AMX tiles)");
  m.def("route", &route, "gpt-oss router: top-k experts and their softmax (float32)");
  m.def("routed_experts", &routed_experts, "gpt-oss routed experts (float32, bf16 pairs, int8 rows or AMX tiles)");
  m.def("moe", &moe, "a gpt-oss layer's router and routed experts in one call");
  m.def("amx_available", &dflash_amx::available, "whether this build and CPU run the AMX-BF16 GEMM");
  m.def("sink_attention", &dflash_attention::sink_attention, "a target layer's RoPE, K/V write and attention with sinks (float32)");
  pybind11::class_<TargetStep>(m, "TargetStep")
      .def(pybind11::init<torch::Tensor, std::vector<Linear>, std::vector<Linear>, std::vector<c10::optional<torch::Tensor>>,
                          std::vector<int64_t>, std::vector<torch::Tensor>, std::vector<Moe>, std::vector<torch::Tensor>,
                          double, double>())
      .def("step", &TargetStep::step, "the decoder layers for a step: final-normed hidden states and features");
}
