// RMSNorm of a few rows in one call: y = weight * x / sqrt(mean(x^2) + eps), and the same after a
// residual add (x = x + residual; y = norm(x)), which is how every pre-norm decoder layer uses it.
// Why: transformers' RMSNorm is six torch ops (to, pow, mean, add, rsqrt, two muls); at batch 1 a
// decode step runs 13-25 of them and each op's dispatch costs more than its arithmetic.
#include <torch/extension.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "vec.h"

namespace {

// 1 / sqrt(mean(x^2) + eps) of one fp32 row
inline float inverse_rms(const float* xr, int64_t width, float eps) {
  const int64_t vectors = width / 16;
  v16 acc = {};
  for (int64_t i = 0; i < vectors; ++i) {
    const v16 v = load16(xr + 16 * i);
    acc += v * v;
  }
  float squares = 0.f;
  for (int lane = 0; lane < 16; ++lane) squares += acc[lane];
  for (int64_t i = 16 * vectors; i < width; ++i) squares += xr[i] * xr[i];
  return 1.f / std::sqrt(squares / (float)width + eps);
}

// y = weight * (x * inv), inv = 1 / sqrt(mean(x^2) + eps) for one row; both ops share it, so the
// fused add + norm is bit for bit the add followed by the norm.
inline void norm_row(const float* xr, const float* w, float* yr, int64_t width, float eps) {
  const int64_t vectors = width / 16;
  const float inv = inverse_rms(xr, width, eps);
  for (int64_t i = 0; i < vectors; ++i) store16(yr + 16 * i, load16(w + 16 * i) * (load16(xr + 16 * i) * inv));
  for (int64_t i = 16 * vectors; i < width; ++i) yr[i] = w[i] * (xr[i] * inv);
}

// A bf16 row as transformers' RMSNorm computes it in a bf16 model: the row widened to fp32 (`buf`),
// normalised there, rounded to bf16, then times the bf16 weight (one more rounding).
inline void norm_row_bf16(const at::BFloat16* xr, const at::BFloat16* w, at::BFloat16* yr, int64_t width, float eps,
                          float* buf) {
  for (int64_t i = 0; i < width; ++i) buf[i] = static_cast<float>(xr[i]);
  const float inv = inverse_rms(buf, width, eps);
  for (int64_t i = 0; i < width; ++i)
    yr[i] = at::BFloat16(static_cast<float>(w[i]) * static_cast<float>(at::BFloat16(buf[i] * inv)));
}

void check(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous fp32 [T, H]");
  TORCH_CHECK(weight.dim() == 1 && weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() &&
                  weight.size(0) == x.size(1), "weight: contiguous fp32 [H] with x's H");
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), width = x.size(1);
  auto out = torch::empty_like(x);
  if (x.scalar_type() == torch::kBFloat16) {   // a bf16 model's norm: bf16 rows and weight
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.dim() == 1 && weight.is_contiguous() &&
                    weight.scalar_type() == torch::kBFloat16 && weight.size(0) == width,
                "bf16 x: contiguous [T, H] with a contiguous bf16 weight [H]");
    std::vector<float> buf(width);
    for (int64_t r = 0; r < rows; ++r)
      norm_row_bf16(x.data_ptr<at::BFloat16>() + r * width, weight.data_ptr<at::BFloat16>(),
                    out.data_ptr<at::BFloat16>() + r * width, width, (float)eps, buf.data());
    return out;
  }
  check(x, weight);
  for (int64_t r = 0; r < rows; ++r)   // a few rows of a few hundred: one thread
    norm_row(x.data_ptr<float>() + r * width, weight.data_ptr<float>(), out.data_ptr<float>() + r * width, width,
             (float)eps);
  return out;
}

// (x + residual, rms_norm(x + residual)): the residual stream and the next block's input in one call.
// In a bf16 model the sum is rounded to bf16 (torch's bf16 add: the fp32 sum, rounded to nearest even)
// and normed as rms_norm norms a bf16 row, so the fused op is bit for bit the add followed by the norm.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& residual,
                                                      const torch::Tensor& weight, double eps) {
  if (x.scalar_type() == torch::kBFloat16) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.sizes() == x.sizes() && residual.is_contiguous() &&
                    residual.scalar_type() == torch::kBFloat16, "bf16 x and residual: contiguous [T, H]");
    auto sum = (x + residual).contiguous();   // ATen's bf16 add: the module path's own residual add
    return {sum, rms_norm(sum, weight, eps)};
  }
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
