// RMSNorm of a few rows in one call: y = weight * x / sqrt(mean(x^2) + eps), and the same after a
// residual add (x = x + residual; y = norm(x)), which is how every pre-norm decoder layer uses it.
// Why: transformers' RMSNorm is six torch ops (to, pow, mean, add, rsqrt, two muls); at batch 1 a
// decode step runs 13-25 of them and each op's dispatch costs more than its arithmetic.
#include <torch/extension.h>

#include <cmath>
#include <tuple>

#include "vec.h"

namespace {

// y = weight * (x * inv), inv = 1 / sqrt(mean(x^2) + eps) for one row; both ops share it, so the
// fused add + norm is bit for bit the add followed by the norm.
inline void norm_row(const float* xr, const float* w, float* yr, int64_t width, float eps) {
  const int64_t vectors = width / 16;
  v16 acc = {};
  for (int64_t i = 0; i < vectors; ++i) {
    const v16 v = load16(xr + 16 * i);
    acc += v * v;
  }
  float squares = 0.f;
  for (int lane = 0; lane < 16; ++lane) squares += acc[lane];
  for (int64_t i = 16 * vectors; i < width; ++i) squares += xr[i] * xr[i];
  const float inv = 1.f / std::sqrt(squares / (float)width + eps);
  for (int64_t i = 0; i < vectors; ++i) store16(yr + 16 * i, load16(w + 16 * i) * (load16(xr + 16 * i) * inv));
  for (int64_t i = 16 * vectors; i < width; ++i) yr[i] = w[i] * (xr[i] * inv);
}

void check(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous fp32 [T, H]");
  TORCH_CHECK(weight.dim() == 1 && weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() &&
                  weight.size(0) == x.size(1), "weight: contiguous fp32 [H] with x's H");
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check(x, weight);
  const int64_t rows = x.size(0), width = x.size(1);
  auto out = torch::empty_like(x);
  for (int64_t r = 0; r < rows; ++r)   // a few rows of a few hundred: one thread
    norm_row(x.data_ptr<float>() + r * width, weight.data_ptr<float>(), out.data_ptr<float>() + r * width, width,
             (float)eps);
  return out;
}

// (x + residual, rms_norm(x + residual)): the residual stream and the next block's input in one call.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& residual,
                                                      const torch::Tensor& weight, double eps) {
  check(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == torch::kFloat32 && residual.is_contiguous(),
              "residual: contiguous fp32 with x's shape");
  const int64_t rows = x.size(0), width = x.size(1);
  auto sum = torch::empty_like(x), out = torch::empty_like(x);
  for (int64_t r = 0; r < rows; ++r) {
    const float *a = x.data_ptr<float>() + r * width, *b = residual.data_ptr<float>() + r * width;
    float* s = sum.data_ptr<float>() + r * width;
    for (int64_t i = 0; i < width; ++i) s[i] = a[i] + b[i];
    norm_row(s, weight.data_ptr<float>(), out.data_ptr<float>() + r * width, width, (float)eps);
  }
  return {sum, out};
}
