// Rotary position embedding of a decode step's q and k, and the new k and v written into the paged
// KV pool, in one call.
//
// Why: transformers' apply_rotary_pos_emb is seven torch ops per tensor (two slices, a negation, a
// cat, two products, a sum) and the cache write two index copies with their transposes and casts:
// at batch 1 each op's dispatch costs more than its arithmetic, about 20 dispatches per layer.
//
// Arithmetic equal to transformers' bit for bit: out = (x * cos) + (rotate_half(x) * sin) with
// rotate_half(x) = cat(-x[D/2:], x[:D/2]), each product and the sum rounded to the inputs' dtype in
// that order (fp32; or bf16, as torch's bf16 ops compute in fp32 and round to nearest even; no fused
// multiply-add: the function is compiled with fp-contract off), so the engine's decoder and
// transformers' modules write the same cache and attend with the same query.
//
// q [B, nH, D], k [B, nKV, D], v [B, nKV, Dv] fp32 or bf16, one dtype (any row and head strides, last
// dim contiguous); cos, sin [B, D] of that dtype; k_cache [slots, nKV, D], v_cache [slots, nKV, Dv] fp32
// or bf16 (contiguous); slot_mapping [B] int64 -> the rotated q [B, nH, D] in q's dtype (contiguous, as
// the paged attention kernel reads it).

#include <torch/extension.h>

#include <cstdint>

namespace {

template <typename C>
inline C to_cache(float x) { return static_cast<C>(x); }

// a result of torch's op on T inputs: fp32 as computed, bf16 rounded to nearest even
template <typename T>
inline float round_to(float x) { return static_cast<float>(static_cast<T>(x)); }

template <typename T, typename C>
__attribute__((optimize("fp-contract=off")))
void rotate_row(const T* x, const T* cos, const T* sin, int64_t dim, C* out) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = round_to<T>(float(x[i]) * float(cos[i])), b = round_to<T>((-float(x[i + half])) * float(sin[i]));
    out[i] = to_cache<C>(round_to<T>(a + b));
  }
  for (int64_t i = half; i < dim; ++i) {
    const float a = round_to<T>(float(x[i]) * float(cos[i])), b = round_to<T>(float(x[i - half]) * float(sin[i]));
    out[i] = to_cache<C>(round_to<T>(a + b));
  }
}

template <typename T, typename C>
void write_kv(const torch::Tensor& k, const torch::Tensor& v, const T* cos, const T* sin, int64_t b,
              int64_t slot, torch::Tensor& k_cache, torch::Tensor& v_cache) {
  const int64_t kv_heads = k.size(1), dk = k.size(2), dv = v.size(2);
  C* kc = k_cache.data_ptr<C>() + slot * kv_heads * dk;
  C* vc = v_cache.data_ptr<C>() + slot * kv_heads * dv;
  for (int64_t h = 0; h < kv_heads; ++h) {
    rotate_row<T, C>(k.data_ptr<T>() + b * k.stride(0) + h * k.stride(1), cos, sin, dk, kc + h * dk);
    const T* vr = v.data_ptr<T>() + b * v.stride(0) + h * v.stride(1);
    for (int64_t i = 0; i < dv; ++i) vc[h * dv + i] = to_cache<C>(float(vr[i]));
  }
}

template <typename T>
void rotate_and_write(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& cos,
                      const torch::Tensor& sin, torch::Tensor& k_cache, torch::Tensor& v_cache,
                      const torch::Tensor& slot_mapping, torch::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {   // a decode step's few rows: one thread
    const T* c = cos.data_ptr<T>() + b * dim;
    const T* s = sin.data_ptr<T>() + b * dim;
    for (int64_t h = 0; h < heads; ++h)
      rotate_row<T, T>(q.data_ptr<T>() + b * q.stride(0) + h * q.stride(1), c, s, dim,
                       out.data_ptr<T>() + (b * heads + h) * dim);
    TORCH_CHECK(slots[b] >= 0 && slots[b] < k_cache.size(0), "slot_mapping holds a slot outside the cache");
    if (k_cache.scalar_type() == torch::kFloat32)
      write_kv<T, float>(k, v, c, s, b, slots[b], k_cache, v_cache);
    else if (k_cache.scalar_type() == torch::kBFloat16)
      write_kv<T, c10::BFloat16>(k, v, c, s, b, slots[b], k_cache, v_cache);
    else
      TORCH_CHECK(false, "the KV cache must be fp32 or bf16");
  }
}

}  // namespace

torch::Tensor rotary_kv_write(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& k_cache,
                              torch::Tensor& v_cache, const torch::Tensor& slot_mapping) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "q, k, v: fp32 or bf16");
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == dtype && t->stride(2) == 1,
                "q, k, v: [B, heads, D] of one dtype with a contiguous last dimension");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  TORCH_CHECK(k.size(0) == batch && v.size(0) == batch && k.size(2) == dim && v.size(1) == k.size(1),
              "q, k and v must share the batch, q and k the head size, k and v the heads");
  TORCH_CHECK(dim % 2 == 0, "the head size must be even");
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(0) == batch && cos.size(1) == dim &&
                  cos.scalar_type() == dtype && sin.scalar_type() == dtype &&
                  cos.is_contiguous() && sin.is_contiguous(), "cos, sin: contiguous [B, D] of q's dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  k_cache.dim() == 3 && v_cache.dim() == 3 && k_cache.size(1) == k.size(1) &&
                  k_cache.size(2) == dim && v_cache.size(1) == v.size(1) && v_cache.size(2) == v.size(2),
              "k_cache [slots, nKV, D] and v_cache [slots, nKV, Dv]: contiguous, one dtype, k's and v's heads");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == batch, "slot_mapping: contiguous int64 [B]");
  auto out = torch::empty({batch, heads, dim}, q.options());
  if (dtype == torch::kFloat32)
    rotate_and_write<float>(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, out);
  else
    rotate_and_write<c10::BFloat16>(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, out);
  return out;
}
