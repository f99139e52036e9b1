// RMSNorm of a few rows in one call: y = weight * x / sqrt(mean(x^2) + eps).
// Why: transformers' RMSNorm is six torch ops (to, pow, mean, add, rsqrt, two muls); at batch 1 a
// decode step runs 13-25 of them and each op's dispatch costs more than its arithmetic.
#include <torch/extension.h>

#include <cmath>

#include "vec.h"

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous fp32 [T, H]");
  TORCH_CHECK(weight.dim() == 1 && weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() &&
                  weight.size(0) == x.size(1), "weight: contiguous fp32 [H] with x's H");
  const int64_t rows = x.size(0), width = x.size(1), vectors = width / 16;
  auto out = torch::empty_like(x);
  const float* w = weight.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {   // a few rows of a few hundred: one thread
    const float* xr = x.data_ptr<float>() + r * width;
    float* yr = out.data_ptr<float>() + r * width;
    v16 acc = {};
    for (int64_t i = 0; i < vectors; ++i) {
      const v16 v = load16(xr + 16 * i);
      acc += v * v;
    }
    float squares = 0.f;
    for (int lane = 0; lane < 16; ++lane) squares += acc[lane];
    for (int64_t i = 16 * vectors; i < width; ++i) squares += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(squares / (float)width + (float)eps);
    for (int64_t i = 0; i < vectors; ++i) store16(yr + 16 * i, load16(w + 16 * i) * (load16(xr + 16 * i) * inv));
    for (int64_t i = 16 * vectors; i < width; ++i) yr[i] = w[i] * (xr[i] * inv);
  }
  return out;
}
