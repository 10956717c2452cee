// RMSNorm and the residual add fused with it, as both compiled CPU kernels use them (the drafter's steps, the target's
// whole step: one source, so the two modules' norms are the same numbers).
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace dflash_norms {

template <typename T>
const T* rows_of(const torch::Tensor& t, int64_t width, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.size(-1) == width, name, " must be a contiguous CPU tensor [..., ",
              width, "]");
  return t.data_ptr<T>();
}

template <typename T>
void add_rms_norm_rows(const float* x, const T* delta, const float* w, float eps, int64_t rows, int64_t width,
                       float* sum, float* normed) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * width;
    const T* dr = delta + r * width;
    float* sr = sum + r * width;
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t e = 0; e < width; ++e) {
      sr[e] = xr[e] + static_cast<float>(dr[e]);
      squares += sr[e] * sr[e];
    }
    const float inv = 1.f / std::sqrt(squares / static_cast<float>(width) + eps);
    float* nr = normed + r * width;
#pragma omp simd
    for (int64_t e = 0; e < width; ++e) nr[e] = sr[e] * inv * w[e];
  }
}

}  // namespace dflash_norms

// The residual add and the next RMSNorm in one pass: x float32 [..., H], delta float32 or bf16 [..., H]
// (a GEMM's output), weight: the norm's [H] (or more: the first H entries are read). -> (x + delta, RMSNorm
// of it times the weight), both float32.
inline std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "x must be float32");
  const int64_t width = x.size(-1), rows = x.numel() / std::max<int64_t>(width, 1);
  TORCH_CHECK(delta.sizes() == x.sizes(), "delta must have x's shape");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() && weight.numel() >= width,
              "weight must be float32 with at least H entries");
  auto sum = torch::empty_like(x), normed = torch::empty_like(x);
  const float* xp = dflash_norms::rows_of<float>(x, width, "x");
  const float* wp = weight.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  if (delta.scalar_type() == torch::kFloat32) {
    dflash_norms::add_rms_norm_rows(xp, dflash_norms::rows_of<float>(delta, width, "delta"), wp, feps, rows, width, sum.data_ptr<float>(),
                      normed.data_ptr<float>());
  } else {
    TORCH_CHECK(delta.scalar_type() == torch::kBFloat16, "delta must be float32 or bfloat16");
    dflash_norms::add_rms_norm_rows(xp, dflash_norms::rows_of<c10::BFloat16>(delta, width, "delta"), wp, feps, rows, width, sum.data_ptr<float>(),
                      normed.data_ptr<float>());
  }
  return {sum, normed};
}

// RMSNorm of x [..., H] (float32, contiguous) times weight (at least H entries; the first H are read).
inline torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32, "x and weight must be float32");
  const int64_t width = x.size(-1), rows = x.numel() / std::max<int64_t>(width, 1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() >= width, "weight must have at least H entries");
  auto out = torch::empty_like(x);
  const float *xp = dflash_norms::rows_of<float>(x, width, "x"), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * width;
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t e = 0; e < width; ++e) squares += xr[e] * xr[e];
    const float inv = 1.f / std::sqrt(squares / static_cast<float>(width) + static_cast<float>(eps));
#pragma omp simd
    for (int64_t e = 0; e < width; ++e) op[r * width + e] = xr[e] * inv * wp[e];
  }
  return out;
}
