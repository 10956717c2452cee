// The gpt-oss target's MoE and attention on CPU, one call each, and its decoder layers in one call (plugins/target/cpu.py
// builds and loads this file; models/target.py holds the torch formulations they replace: `routed_experts`,
// `GptOssTarget.attention`).
//
// Why compiled: on a small target a CPU step is bound by the count of tensor ops torch eager dispatches and by
// Python, not by its GEMMs (docs/benchmarks.md, round 17).
// - `route` and `routed_experts` (moe.h, on gemm_tiles.h's GEMM) replace a layer's router (3 ops) and the ~25 ops and
//   the Python loop over routed experts of its MoE: each expert that some token routes to multiplies its rows in one
//   pass over its weights (float32,
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
#include "gemm_tiles.h"
#include "moe.h"
#include "../norms.h"
#include "../scratch.h"

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

using namespace dflash_vec;
using namespace dflash_gemm;
using dflash_moe::moe;
using dflash_moe::route;
using dflash_moe::routed_experts;

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
