// Decode attention over the paged KV cache, read in place.
//
// Why: a decode step has one query per sequence; gathering every cached K and V row into a dense
// [B, nKV, S, D] copy per layer (so SDPA can run) moves more bytes than the attention itself reads.
// Here each (sequence, KV head) pair walks its block table and reads the pool rows directly.
//
// q [B, nH, Dk] fp32; k_cache [slots, nKV, Dk], v_cache [slots, nKV, Dv] (fp32 or bf16); block_table [B, nb] int64
// (pool block ids); lengths [B] int64 (cached positions, the new token's included); grouped-query
// heads: query head h reads KV head h / (nH / nKV).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "vec.h"

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

template <typename C>
inline float dot(const float* a, const C* b, int64_t n) {
  float s = 0.f;
  for (int64_t d = 0; d < n; ++d) s += a[d] * to_float(b[d]);
  return s;
}

// scores[p] = dot(q, k_p) for 16 positions at once (one transpose-add for the 16 sums)
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// AVX2: two passes of 8 positions, 8 ymm accumulators each (16 v16 accumulators would not fit)
template <typename C>
inline v16 dot16(const float* q, const C* const* k, int64_t n) {
  alignas(64) float out[16];
  for (int half = 0; half < 2; ++half) {
    __m256 acc[8];
    for (int p = 0; p < 8; ++p) acc[p] = _mm256_setzero_ps();
    for (int64_t d = 0; d < n; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int p = 0; p < 8; ++p) acc[p] = _mm256_fmadd_ps(qv, load8(k[8 * half + p] + d), acc[p]);
    }
    _mm256_store_ps(out + 8 * half, sum8(acc));
  }
  return load16(out);
}
#else
template <typename C>
inline v16 dot16(const float* q, const C* const* k, int64_t n) {
  v16 acc[16] = {};
  for (int64_t d = 0; d < n; d += 16) {
    const v16 qv = load16(q + d);
    for (int p = 0; p < 16; ++p) acc[p] += qv * load16(k[p] + d);
  }
  return sum16(acc);
}
#endif

}  // namespace

template <typename C>
void attend(const float* qp, const C* kp, const C* vp, const int64_t* table, const int64_t* len, float* op,
            int64_t B, int64_t nH, int64_t nKV, int64_t Dk, int64_t Dv, int64_t nb, int64_t block_size, float s) {
  const int64_t group = nH / nKV;
  at::parallel_for(0, B * nKV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const C*> krows;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / nKV, g = task % nKV, n = len[b];
      scores.resize(group * n);
      const int64_t padded = (n + 15) / 16 * 16;
      krows.resize(padded);
      for (int64_t p = 0; p < n; ++p) {
        const int64_t slot = table[b * nb + p / block_size] * block_size + p % block_size;
        krows[p] = kp + (slot * nKV + g) * Dk;
      }
      for (int64_t p = n; p < padded; ++p) krows[p] = krows[n - 1];   // the last block of 16, padded
      for (int64_t h = 0; h < group; ++h) {                      // scores[h][p] = q_h . k_p * scale
        const float* qr = qp + (b * nH + g * group + h) * Dk;
        float* sc = scores.data() + h * n;
        if (Dk % 16 == 0) {
          for (int64_t p = 0; p < n; p += 16) {
            const v16 block = dot16(qr, krows.data() + p, Dk) * s;
            if (p + 16 <= n) store16(sc + p, block);
            else for (int64_t i = 0; p + i < n; ++i) sc[p + i] = block[i];
          }
        } else {
          for (int64_t p = 0; p < n; ++p) sc[p] = dot(qr, krows[p], Dk) * s;
        }
      }
      for (int64_t h = 0; h < group; ++h) {                      // softmax over positions
        float* sc = scores.data() + h * n;
        const float mx = *std::max_element(sc, sc + n);
        float sum = 0.f;
        int64_t p = 0;
        v16 sums = {};
        for (; p + 16 <= n; p += 16) {
          const v16 e = exp16(load16(sc + p) - mx);
          store16(sc + p, e);
          sums += e;
        }
        for (int i = 0; i < 16; ++i) sum += sums[i];
        for (; p < n; ++p) sum += (sc[p] = std::exp(sc[p] - mx));
        const float inv = 1.f / sum;
        for (p = 0; p < n; ++p) sc[p] *= inv;
        std::fill(op + (b * nH + g * group + h) * Dv, op + (b * nH + g * group + h + 1) * Dv, 0.f);
      }
      for (int64_t p = 0; p < n; ++p) {                          // out_h = sum_p w_hp v_p
        const int64_t slot = table[b * nb + p / block_size] * block_size + p % block_size;
        const C* vr = vp + (slot * nKV + g) * Dv;
        for (int64_t h = 0; h < group; ++h) {
          const float w = scores[h * n + p];
          float* o = op + (b * nH + g * group + h) * Dv;
          int64_t d = 0;
          for (; d + 16 <= Dv; d += 16) store16(o + d, load16(o + d) + w * load16(vr + d));
          for (; d < Dv; ++d) o[d] += w * to_float(vr[d]);
        }
      }
    }
  });
}

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_table,
                                     const torch::Tensor& lengths, int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q: contiguous fp32 [B, nH, Dk]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              (k_cache.scalar_type() == torch::kFloat32 || k_cache.scalar_type() == torch::kBFloat16),
              "caches: contiguous fp32 or bf16 [slots, nKV, D]");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt64 && block_table.is_contiguous() &&
              lengths.scalar_type() == torch::kInt64 && lengths.is_contiguous(), "block_table, lengths: int64");
  const int64_t B = q.size(0), nH = q.size(1), Dk = q.size(2);
  const int64_t nKV = k_cache.size(1), Dv = v_cache.size(2), nb = block_table.size(1);
  TORCH_CHECK(k_cache.size(2) == Dk && nH % nKV == 0, "head shapes do not match");
  auto out = torch::empty({B, nH, Dv}, q.options());
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(len[b] >= 1 && len[b] <= nb * block_size, "sequence length outside its block table");
  if (k_cache.scalar_type() == torch::kFloat32)
    attend(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), table, len,
           out.data_ptr<float>(), B, nH, nKV, Dk, Dv, nb, block_size, (float)scale);
  else
    attend(q.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), table, len,
           out.data_ptr<float>(), B, nH, nKV, Dk, Dv, nb, block_size, (float)scale);
  return out;
}
