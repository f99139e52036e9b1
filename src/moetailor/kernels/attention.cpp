// Decode attention over the paged KV cache, read in place.
//
// Why: a decode step has one query per sequence; gathering every cached K and V row into a dense
// [B, nKV, S, D] copy per layer (so SDPA can run) moves more bytes than the attention itself reads.
// Here each (sequence, KV head) pair walks its block table and reads the pool rows directly.
//
// q [B, nH, Dk]; k_cache [slots, nKV, Dk], v_cache [slots, nKV, Dv] (fp32); block_table [B, nb] int64
// (pool block ids); lengths [B] int64 (cached positions, the new token's included); grouped-query
// heads: query head h reads KV head h / (nH / nKV).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

typedef float v16 __attribute__((vector_size(64)));

inline float dot(const float* a, const float* b, int64_t n) {
  if (n % 16 == 0) {
    v16 acc = {};
    for (int64_t d = 0; d < n; d += 16) {
      v16 x, y;
      std::memcpy(&x, a + d, sizeof(x));
      std::memcpy(&y, b + d, sizeof(y));
      acc += x * y;
    }
    float s = 0.f;
    for (int i = 0; i < 16; ++i) s += acc[i];
    return s;
  }
  float s = 0.f;
  for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor lengths, int64_t block_size,
                                     double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q: contiguous fp32 [B, nH, Dk]");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 && v_cache.scalar_type() == torch::kFloat32 &&
              k_cache.is_contiguous() && v_cache.is_contiguous(), "caches: contiguous fp32 [slots, nKV, D]");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt64 && block_table.is_contiguous() &&
              lengths.scalar_type() == torch::kInt64 && lengths.is_contiguous(), "block_table, lengths: int64");
  const int64_t B = q.size(0), nH = q.size(1), Dk = q.size(2);
  const int64_t nKV = k_cache.size(1), Dv = v_cache.size(2), nb = block_table.size(1);
  TORCH_CHECK(k_cache.size(2) == Dk && nH % nKV == 0, "head shapes do not match");
  const int64_t group = nH / nKV;
  auto out = torch::empty({B, nH, Dv}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float s = (float)scale;

  at::parallel_for(0, B * nKV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / nKV, g = task % nKV, n = len[b];
      TORCH_CHECK(n >= 1 && n <= nb * block_size, "sequence length outside its block table");
      scores.resize(group * n);
      for (int64_t p = 0; p < n; ++p) {                          // scores[h][p] = q_h . k_p * scale
        const int64_t slot = table[b * nb + p / block_size] * block_size + p % block_size;
        const float* kr = kp + (slot * nKV + g) * Dk;
        for (int64_t h = 0; h < group; ++h) {
          scores[h * n + p] = dot(qp + (b * nH + g * group + h) * Dk, kr, Dk) * s;
        }
      }
      for (int64_t h = 0; h < group; ++h) {                      // softmax over positions
        float* sc = scores.data() + h * n;
        const float mx = *std::max_element(sc, sc + n);
        float sum = 0.f;
        for (int64_t p = 0; p < n; ++p) sum += (sc[p] = std::exp(sc[p] - mx));
        const float inv = 1.f / sum;
        for (int64_t p = 0; p < n; ++p) sc[p] *= inv;
        std::fill(op + (b * nH + g * group + h) * Dv, op + (b * nH + g * group + h + 1) * Dv, 0.f);
      }
      for (int64_t p = 0; p < n; ++p) {                          // out_h = sum_p w_hp v_p
        const int64_t slot = table[b * nb + p / block_size] * block_size + p % block_size;
        const float* vr = vp + (slot * nKV + g) * Dv;
        for (int64_t h = 0; h < group; ++h) {
          const float w = scores[h * n + p];
          float* o = op + (b * nH + g * group + h) * Dv;
          for (int64_t d = 0; d < Dv; ++d) o[d] += w * vr[d];
        }
      }
    }
  });
  return out;
}
