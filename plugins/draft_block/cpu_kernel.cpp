// The drafter's CPU kernels as one extension module (plugins/draft_block/cpu.py builds and loads this file): the draft
// step's float32 ops between GEMMs (draft_ops.h), the bf16 and int8 GEMMs (dot_gemm.h), and `DraftStep`, a whole
// drafter step in one call.
//
// Why a whole step: with each GEMM and op compiled, a lone request's drafter step still made ~25 calls from Python,
// each with its argument parsing, views and output allocation; the step's own arithmetic is ~0.25 ms.

#include <torch/extension.h>

#include "dot_gemm.h"
#include "draft_ops.h"
#include "greedy_head.h"

#include <tuple>
#include <utility>
#include <vector>

// A GEMM's weight as `dot_pack` lays it out (cpu.py), its float32 bias or None, and an int8 weight's scales or None.
using PackedLinear = std::tuple<torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>>;

namespace {

torch::Tensor gemm(const PackedLinear& linear, const torch::Tensor& x) {
  return dot_linear(x.contiguous(), std::get<0>(linear), std::get<1>(linear), std::get<2>(linear));
}

// The cos/sin table's rows [positions, 2, D] of each slot of a block at its request's context length: [b * B, 2, D].
torch::Tensor block_rope(const torch::Tensor& rope, const torch::Tensor& context_lens, int64_t width) {
  if (context_lens.size(0) == 1) return rope.narrow(0, context_lens.item<int64_t>(), width);  // a view, no gather
  const auto positions = context_lens.unsqueeze(1) + torch::arange(width, context_lens.options());
  return rope.index_select(0, positions.reshape(-1));
}

// The table's rows of committed tokens at `positions` [b, n], or at start, start + 1, ... in every row: [b, n, 2, D].
torch::Tensor context_rope(const torch::Tensor& rope, const c10::optional<torch::Tensor>& positions, int64_t start,
                           int64_t batch, int64_t n) {
  if (positions.has_value()) return rope.index_select(0, positions->reshape(-1)).view({batch, n, 2, rope.size(2)});
  return rope.narrow(0, start, n).unsqueeze(0).expand({batch, n, 2, rope.size(2)});
}

// The verify's block [b, B]: each row's anchor (the first column of tokens [b, B]), then its drafts [b, B - 1] (the
// loop verifies it as it is: no `cat` in Python, an op that runs cold after the drafter's weights streamed).
torch::Tensor verify_block(const torch::Tensor& tokens, const torch::Tensor& drafts) {
  const int64_t batch = drafts.size(0), width = drafts.size(1) + 1;
  auto block = torch::empty({batch, width}, drafts.options());
  int64_t* out = block.data_ptr<int64_t>();
  const int64_t* drafted = drafts.data_ptr<int64_t>();
  const auto anchors = tokens.accessor<int64_t, 2>();
  for (int64_t r = 0; r < batch; ++r) {
    out[r * width] = anchors[r][0];
    std::copy(drafted + r * (width - 1), drafted + (r + 1) * (width - 1), out + r * width + 1);
  }
  return block;
}

}  // namespace

// A drafter step of the lean path (models/drafter.py `compiled_layers`, then the draft logits and greedy drafts) in
// one call, over weights held from construction: the committed tokens' context K/V written to the arena, the block
// through every layer, the LM head on slots 1..B-1. The same kernels in the same order as the per-call path, so the
// same numbers. Every GEMM is `dot_linear`'s, bf16 or int8 (each GEMM's weight says which).
class DraftStep {
 public:
  // fc, first_qkv (the first layer's q, then every layer's k, then v), per layer qkv / o_proj / gate_up / down, and
  // the LM head; norm weights float32 (hidden-size ones with at least H entries), context_k_norm [L, D].
  DraftStep(PackedLinear fc, PackedLinear first_qkv, std::vector<PackedLinear> qkv, std::vector<PackedLinear> o_proj,
            std::vector<PackedLinear> gate_up, std::vector<PackedLinear> down, PackedLinear head,
            torch::Tensor hidden_norm, torch::Tensor context_k_norm, std::vector<torch::Tensor> input_norm,
            std::vector<torch::Tensor> post_attention_norm, std::vector<torch::Tensor> q_norm,
            std::vector<torch::Tensor> k_norm, torch::Tensor final_norm, int64_t query_heads, int64_t kv_heads,
            int64_t head_dim, double eps, double scale, int64_t sliding_window)
      : fc_(std::move(fc)), first_qkv_(std::move(first_qkv)), qkv_(std::move(qkv)), o_proj_(std::move(o_proj)),
        gate_up_(std::move(gate_up)), down_(std::move(down)), head_(std::move(head)),
        hidden_norm_(std::move(hidden_norm)), context_k_norm_(std::move(context_k_norm)),
        input_norm_(std::move(input_norm)), post_attention_norm_(std::move(post_attention_norm)),
        q_norm_(std::move(q_norm)), k_norm_(std::move(k_norm)), final_norm_(std::move(final_norm)), hq_(query_heads),
        hkv_(kv_heads), d_(head_dim), eps_(eps), scale_(scale), window_(sliding_window) {
    const size_t layers = qkv_.size();
    TORCH_CHECK(layers > 0 && o_proj_.size() == layers && gate_up_.size() == layers && down_.size() == layers &&
                    input_norm_.size() == layers && post_attention_norm_.size() == layers &&
                    q_norm_.size() == layers && k_norm_.size() == layers,
                "every per-layer list must have one entry per layer");
  }

  // tokens int64 [b, B] (the anchor, then mask ids); embedding float32 [V, H] (the target's); features float32
  // [b, n, F]: committed tokens' target features (n may be 0), at arena positions `positions` int64 [b, n] or, without
  // them, start, start + 1, ... in every row; keys / values: the draft arena [L, b, Hkv, S, D]; context_lens int64 [b]
  // counting the features (slot j of row i sits at position context_lens[i] + j); rope: `Rotary.table` [P, 2, D],
  // covering every position. -> logits float32 [b, B - 1, V] of slots 1..B-1 and, with `greedy`, the verify's block
  // (int64 [b, B]: the anchors, then the logits' argmaxes) and the argmaxes' softmax peak (float32 [b, B - 1]).
  std::vector<torch::Tensor> step(const torch::Tensor& tokens, const torch::Tensor& embedding,
                                  const torch::Tensor& features, const c10::optional<torch::Tensor>& positions,
                                  int64_t start, const torch::Tensor& keys, const torch::Tensor& values,
                                  const torch::Tensor& context_lens, const torch::Tensor& rope, bool greedy) const {
    TORCH_CHECK(tokens.dim() == 2 && tokens.scalar_type() == torch::kInt64 && tokens.size(1) >= 2,
                "tokens must be int64 [b, B] with B >= 2");
    TORCH_CHECK(embedding.dim() == 2 && embedding.scalar_type() == torch::kFloat32, "embedding must be float32 [V, H]");
    TORCH_CHECK(features.dim() == 3 && features.scalar_type() == torch::kFloat32 && features.size(0) == tokens.size(0),
                "features must be float32 [b, n, F]");
    TORCH_CHECK(rope.dim() == 3 && rope.size(1) == 2 && rope.size(2) == d_ && rope.scalar_type() == torch::kFloat32,
                "rope must be the float32 cos/sin table [P, 2, D]");
    TORCH_CHECK(keys.dim() == 5 && keys.size(0) == static_cast<int64_t>(qkv_.size()), "keys must be [L, b, Hkv, S, D]");
    const int64_t batch = tokens.size(0), width = tokens.size(1), n = features.size(1), hidden = embedding.size(1);
    const int64_t layers = qkv_.size(), rows = batch * width;
    auto x = embedding.index_select(0, tokens.reshape(-1));  // [R, H]
    const auto slot_rope = block_rope(rope, context_lens, width);
    const auto cos = slot_rope.select(1, 0), sin = slot_rope.select(1, 1);
    auto h = rms_norm(x, input_norm_[0], eps_);
    torch::Tensor qkv;  // this layer's projection [b, B, heads, D]: q heads first, its k heads at k_at, v at v_at
    int64_t k_at = hq_, v_at = hq_ + hkv_;
    if (n > 0) {  // the first layer's GEMM projects the context rows' K/V of every layer too (`first_layer_with_context`)
      const auto out = gemm(first_qkv_, torch::cat({context_rows(features), h.view({batch, width, hidden})}, 1))
                           .view({batch, n + width, -1, d_});
      write_committed(out.narrow(1, 0, n), positions, start, keys, values, rope);
      qkv = out.narrow(1, n, width);
      v_at = hq_ + layers * hkv_;
    } else {
      qkv = gemm(qkv_[0], h).view({batch, width, -1, d_});
    }
    for (int64_t i = 0; i < layers; ++i) {
      if (i > 0) {
        qkv = gemm(qkv_[i], h).view({batch, width, -1, d_});
        v_at = hq_ + hkv_;
      }
      const auto attended = draft_block_attention(
          qkv.narrow(2, 0, hq_).reshape({rows, hq_, d_}), qkv.narrow(2, k_at, hkv_).reshape({rows, hkv_, d_}),
          qkv.narrow(2, v_at, hkv_).reshape({rows, hkv_, d_}), keys.select(0, i), values.select(0, i), context_lens,
          scale_, window_, q_norm_[i], k_norm_[i], cos, sin, eps_);
      const auto mid = add_rms_norm(x, gemm(o_proj_[i], attended), post_attention_norm_[i], eps_);
      const auto next = add_rms_norm(mid[0], gemm(down_[i], silu_mul(gemm(gate_up_[i], mid[1]))),
                                     i + 1 < layers ? input_norm_[i + 1] : final_norm_, eps_);
      x = next[0];
      h = next[1];
    }
    auto logits = gemm(head_, h.view({batch, width, hidden}).narrow(1, 1, width - 1));
    if (!greedy) return {logits};
    const auto drafted = greedy_peak(logits);
    return {logits, verify_block(tokens, drafted[0]), drafted[1]};
  }

  // Only the committed tokens' context K/V (a step whose drafts come from elsewhere): `step`'s arguments of the same
  // names, through the same first GEMM, so the arena holds what a drafter step would have written.
  void write(const torch::Tensor& features, const c10::optional<torch::Tensor>& positions, int64_t start,
             const torch::Tensor& keys, const torch::Tensor& values, const torch::Tensor& rope) const {
    TORCH_CHECK(features.dim() == 3 && features.scalar_type() == torch::kFloat32, "features must be float32 [b, n, F]");
    if (features.size(1) == 0) return;
    write_committed(gemm(first_qkv_, context_rows(features)).view({features.size(0), features.size(1), -1, d_}),
                    positions, start, keys, values, rope);
  }

 private:
  // fc, then hidden_norm: the committed rows' input to every layer's context K/V.
  torch::Tensor context_rows(const torch::Tensor& features) const {
    return rms_norm(gemm(fc_, features), hidden_norm_, eps_);
  }

  // The first GEMM's output for committed rows [b, n, heads, D] (q heads first, then every layer's k heads, then
  // their v heads) -> each layer's normed, rotated K and V in the arena.
  void write_committed(const torch::Tensor& committed, const c10::optional<torch::Tensor>& positions, int64_t start,
                       const torch::Tensor& keys, const torch::Tensor& values, const torch::Tensor& rope) const {
    const int64_t stacked = static_cast<int64_t>(qkv_.size()) * hkv_;
    const auto committed_rope = context_rope(rope, positions, start, committed.size(0), committed.size(1));
    write_context_kv(committed.narrow(2, hq_, stacked), committed.narrow(2, hq_ + stacked, stacked), context_k_norm_,
                     committed_rope.select(2, 0), committed_rope.select(2, 1), keys, values, positions, start, eps_);
  }

  PackedLinear fc_, first_qkv_;
  std::vector<PackedLinear> qkv_, o_proj_, gate_up_, down_;
  PackedLinear head_;
  torch::Tensor hidden_norm_, context_k_norm_;
  std::vector<torch::Tensor> input_norm_, post_attention_norm_, q_norm_, k_norm_;
  torch::Tensor final_norm_;
  int64_t hq_, hkv_, d_;
  double eps_, scale_;
  int64_t window_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm (float32)");
  m.def("write_context_kv", &write_context_kv, "context K/V of committed tokens into the arena (float32)");
  m.def("greedy_peak", &greedy_peak, "argmax and softmax peak per row (float32)");
  m.def("greedy_verify", &greedy_verify, "the greedy accept rule on the verify's logits (float32)");
  m.def("exact_greedy_verify", &exact_greedy_verify,
        "the greedy accept rule from the target's hidden states: float32 argmaxes through the int8 head");
  m.def("add_rms_norm", &add_rms_norm, "residual add and RMSNorm (float32)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
  m.def("draft_block_attention", &draft_block_attention, "draft-block attention on CPU (float32)");
  m.def("dot_available", &dot_available, "whether this build has the bf16 GEMM (AVX512-BF16, or FMAs on AVX2)");
  m.def("dot_int8_available", &dot_int8_available, "whether this build has the int8 GEMM (AVX512-VNNI, or AVX2)");
  m.def("dot_int8_input_levels", &dot_int8_input_levels, "the int8 GEMM's input levels: 127, or 63 on AVX2");
  m.def("dot_int8_tiles_available", &dot_int8_tiles_available,
        "whether the int8 GEMM runs on AMX tiles here (from 4 rows): built for AMX-INT8, tiles granted and wanted");
  m.def("set_int8_tiles", &set_int8_tiles, "let the int8 GEMM take AMX tiles (true) or not, as TRTLLM_DFLASH_AMX");
  m.def("dot_linear", &dot_linear,
        "x @ W.T + bias from bf16 or int8 products (as the packed weight's dtype says), float32 sums");
  pybind11::class_<DraftStep>(m, "DraftStep")
      .def(pybind11::init<PackedLinear, PackedLinear, std::vector<PackedLinear>, std::vector<PackedLinear>,
                          std::vector<PackedLinear>, std::vector<PackedLinear>, PackedLinear, torch::Tensor, torch::Tensor,
                          std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, torch::Tensor, int64_t, int64_t, int64_t, double, double, int64_t>())
      .def("step", &DraftStep::step, "one drafter step: logits of slots 1..B-1 (and the greedy verify block, peaks)")
      .def("write", &DraftStep::write, "the committed tokens' context K/V only");
}
