// The gpt-oss MoE's routed experts on CPU in one call (plugins/moe/cpu.py builds and loads this file;
// models/target.py `routed_experts` holds the torch formulation it replaces).
//
// Why compiled: on a small target the MoE was the largest part of a CPU step, bound by the ~25 tensor ops
// and the Python loop over experts that a block's routing took, not by its GEMMs (docs/benchmarks.md,
// round 17). Here each expert that some token routes to multiplies its rows in one pass over its weights
// (float32, or bf16 copies that hold them exactly, widened in registers), with the bias, gpt-oss's clamped
// SwiGLU on interleaved gate/up columns, the down projection and the routing weight; a token's top-k
// outputs are then summed in slot order, as the torch formulation does. Float32 products and sums
// throughout: the torch formulation's numbers up to summation order and the exp below (< 3e-7 relative).

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

// Sixteen floats as one vector (GCC/Clang vector extensions: AVX-512 where the CPU has it, else pairs of
// AVX2 or SSE registers); `_u` types load and store unaligned.
typedef float f16v __attribute__((vector_size(64)));
typedef float f16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint32_t u16x32 __attribute__((vector_size(64)));
typedef uint16_t bf16x16u __attribute__((vector_size(32), aligned(2)));
constexpr int64_t kLanes = 16;
constexpr int kRows = 4;     // rows sharing one pass over a weight tile
constexpr int kVectors = 4;  // a tile's columns, in vectors

inline f16v load(const float* p) { return *reinterpret_cast<const f16u*>(p); }
inline f16v load(const uint16_t* p) {  // bf16 -> float32: the bits moved to the top half
  const u16x32 wide = __builtin_convertvector(*reinterpret_cast<const bf16x16u*>(p), u16x32) << 16;
  return reinterpret_cast<f16v>(wide);
}
inline void store(float* p, f16v x) { *reinterpret_cast<f16u*>(p) = x; }
inline f16v splat(float x) { return f16v{} + x; }

// e^x as in plugins/draft_block/cpu_kernel.cpp: x = k ln 2 + f, a degree-6 Taylor polynomial for e^f
// (relative error < 3e-7), 2^k through the exponent bits; 0 below -87, e^88 above 88.
inline f16v vexp(f16v x) {
  const i16v dead = x < -87.f;
  x = dead ? splat(-87.f) : x;
  x = x > 88.f ? splat(88.f) : x;
  const f16v y = x * 1.44269504f + 0.5f;
  i16v k = __builtin_convertvector(y, i16v);
  k += __builtin_convertvector(k, f16v) > y;  // floor: true is -1
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

// y[r][c0 : c0 + 16 NV] = x[r] @ w[:, c0 : c0 + 16 NV] + bias for NR rows: one pass over the weight tile,
// NR x NV accumulators in registers.
template <int NR, int NV, typename W>
void tile(const float* const* x, int64_t in, const W* w, int64_t out, const float* bias, float* const* y,
          int64_t c0) {
  f16v acc[NR][NV] = {};
  for (int64_t h = 0; h < in; ++h) {
    f16v wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = load(w + h * out + c0 + v * kLanes);
    for (int r = 0; r < NR; ++r) {
      const f16v xs = splat(x[r][h]);
      for (int v = 0; v < NV; ++v) acc[r][v] += xs * wv[v];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < NV; ++v) store(y[r] + c0 + v * kLanes, acc[r][v] + load(bias + c0 + v * kLanes));
}

template <int NR, typename W>
void row_block(const float* const* x, int64_t in, const W* w, int64_t out, const float* bias, float* const* y) {
  int64_t c0 = 0;
  for (; c0 + kVectors * kLanes <= out; c0 += kVectors * kLanes) tile<NR, kVectors>(x, in, w, out, bias, y, c0);
  for (; c0 < out; c0 += kLanes) tile<NR, 1>(x, in, w, out, bias, y, c0);
}

// rows x[r] [in] (any addresses) times w [in, out] plus bias [out] -> y[r] [out]; out a multiple of 16.
template <typename W>
void linear_rows(const std::vector<const float*>& x, int64_t in, const W* w, int64_t out, const float* bias,
                 const std::vector<float*>& y) {
  const int64_t rows = static_cast<int64_t>(x.size());
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const float* const* xs = x.data() + r0;
    float* const* ys = y.data() + r0;
    switch (std::min<int64_t>(kRows, rows - r0)) {
      case 4: row_block<4>(xs, in, w, out, bias, ys); break;
      case 3: row_block<3>(xs, in, w, out, bias, ys); break;
      case 2: row_block<2>(xs, in, w, out, bias, ys); break;
      default: row_block<1>(xs, in, w, out, bias, ys); break;
    }
  }
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
    f16v g = load(gate + i), u = load(up + i);
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

// One expert's rows `routed` (token * k + slot, in token order): gate_up, the gate, down, the routing weight,
// into slots[token * k + slot].
template <typename W>
void run_expert(const float* xp, const float* sp, const std::vector<int64_t>& routed, int64_t k, int64_t hidden,
                int64_t inter, const W* gu, const float* gub, const W* dn, const float* dnb, float alpha, float limit,
                float* slots) {
  const int64_t rows = static_cast<int64_t>(routed.size());
  std::vector<float> gate_up(rows * 2 * inter), gate(inter), up(inter), act(rows * inter);
  std::vector<const float*> x_rows, act_rows;
  std::vector<float*> gate_up_rows, out_rows;
  for (int64_t r = 0; r < rows; ++r) {
    x_rows.push_back(xp + routed[r] / k * hidden);
    gate_up_rows.push_back(gate_up.data() + r * 2 * inter);
    act_rows.push_back(act.data() + r * inter);
    out_rows.push_back(slots + routed[r] * hidden);
  }
  linear_rows(x_rows, hidden, gu, 2 * inter, gub, gate_up_rows);
  for (int64_t r = 0; r < rows; ++r)
    clamped_swiglu(gate_up_rows[r], inter, alpha, limit, gate.data(), up.data(), act.data() + r * inter);
  linear_rows(act_rows, inter, dn, hidden, dnb, out_rows);
  for (int64_t r = 0; r < rows; ++r) {
    const f16v score = splat(sp[routed[r]]);
    for (int64_t c = 0; c < hidden; c += kLanes) store(out_rows[r] + c, load(out_rows[r] + c) * score);
  }
}

// Every routed expert (in parallel over torch's intra-op threads: their rows write disjoint slots).
template <typename W>
void run_experts(const float* xp, const int64_t* ip, const float* sp, int64_t n, int64_t k, int64_t hidden,
                 int64_t inter, int64_t experts, const W* gu, const float* gub, const W* dn, const float* dnb,
                 float alpha, float limit, float* slots) {
  std::vector<std::vector<int64_t>> routed(experts);
  for (int64_t s = 0; s < n * k; ++s) routed[ip[s]].push_back(s);
  std::vector<int64_t> touched;
  for (int64_t e = 0; e < experts; ++e)
    if (!routed[e].empty()) touched.push_back(e);
  at::parallel_for(0, static_cast<int64_t>(touched.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const int64_t e = touched[i];
      run_expert(xp, sp, routed[e], k, hidden, inter, gu + e * hidden * 2 * inter, gub + e * 2 * inter,
                 dn + e * inter * hidden, dnb + e * hidden, alpha, limit, slots);
    }
  });
}

}  // namespace

// x float32 [n, H]; indices int64 [n, k] and scores float32 [n, k] (the router's top-k and their softmax);
// gate_up [E, H, 2I] and down [E, I, H], both float32 or both bf16; biases float32 [E, 2I], [E, H].
// H and I multiples of 16. -> float32 [n, H]: sum over slots j of scores[t, j] * expert(indices[t, j], x[t]).
torch::Tensor routed_experts(torch::Tensor x, torch::Tensor indices, torch::Tensor scores, torch::Tensor gate_up,
                             torch::Tensor gate_up_bias, torch::Tensor down, torch::Tensor down_bias, double alpha,
                             double limit) {
  for (const auto& [t, name, dims] : {std::tuple{&x, "x", 2}, {&indices, "indices", 2}, {&scores, "scores", 2},
                                      {&gate_up, "gate_up", 3}, {&gate_up_bias, "gate_up_bias", 2},
                                      {&down, "down", 3}, {&down_bias, "down_bias", 2}})
    check(*t, name, dims);
  const int64_t n = x.size(0), hidden = x.size(1), k = indices.size(1);
  const int64_t experts = gate_up.size(0), inter = down.size(1);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && scores.scalar_type() == torch::kFloat32 &&
                  gate_up_bias.scalar_type() == torch::kFloat32 && down_bias.scalar_type() == torch::kFloat32,
              "x, scores and the biases must be float32");
  TORCH_CHECK(indices.scalar_type() == torch::kInt64 && indices.size(0) == n && scores.sizes() == indices.sizes(),
              "indices (int64) and scores must both be [n, k]");
  TORCH_CHECK(gate_up.scalar_type() == down.scalar_type() &&
                  (gate_up.scalar_type() == torch::kFloat32 || gate_up.scalar_type() == torch::kBFloat16),
              "gate_up and down must both be float32 or both bf16");
  TORCH_CHECK(gate_up.size(1) == hidden && gate_up.size(2) == 2 * inter && down.size(0) == experts &&
                  down.size(2) == hidden && gate_up_bias.size(0) == experts && gate_up_bias.size(1) == 2 * inter &&
                  down_bias.size(0) == experts && down_bias.size(1) == hidden,
              "expert shapes must be gate_up [E, H, 2I], down [E, I, H], biases [E, 2I] and [E, H]");
  TORCH_CHECK(hidden % kLanes == 0 && inter % kLanes == 0, "hidden and intermediate sizes must be multiples of ",
              kLanes);
  const int64_t* ip = indices.data_ptr<int64_t>();
  for (int64_t s = 0; s < n * k; ++s)
    TORCH_CHECK(ip[s] >= 0 && ip[s] < experts, "expert index ", ip[s], " outside [0, ", experts, ")");
  auto slots = torch::empty({n, k, hidden}, x.options());
  const float *xp = x.data_ptr<float>(), *sp = scores.data_ptr<float>();
  const float *gub = gate_up_bias.data_ptr<float>(), *dnb = down_bias.data_ptr<float>();
  float* out_slots = slots.data_ptr<float>();
  const auto a = static_cast<float>(alpha), l = static_cast<float>(limit);
  if (gate_up.scalar_type() == torch::kFloat32)
    run_experts(xp, ip, sp, n, k, hidden, inter, experts, gate_up.data_ptr<float>(), gub, down.data_ptr<float>(), dnb,
                a, l, out_slots);
  else
    run_experts(xp, ip, sp, n, k, hidden, inter, experts, reinterpret_cast<const uint16_t*>(gate_up.data_ptr()), gub,
                reinterpret_cast<const uint16_t*>(down.data_ptr()), dnb, a, l, out_slots);
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("routed_experts", &routed_experts, "gpt-oss routed experts (float32 or bf16 weights)");
}
