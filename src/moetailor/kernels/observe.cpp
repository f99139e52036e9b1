// A MoE layer's router-side calibration statistics, added to the layer's sums in one call.
//
// Why: a serving engine that observes its traffic (the vLLM plugin's moetailor_observe) adds one
// step's routes to the statistics in every MoE layer of every step. As torch ops that is about thirty
// small ops per layer (softmax, gathers, scatters, a top-2, a histogram), each costing more than its
// arithmetic in a decode step; here it is one pass over the step's rows. The definitions are
// calibration's (calibration/calibrate.py, Collector): the torch form of this op is
// calibration.observe.LayerSums, the fallback on processors and devices without this build.
//
// Sums layout (float64, flat), for E experts and B beta bins; slot E of the first three and slot B of
// the histogram take what is not counted in the torch form (unused here):
//   [0, E+1) frequency | [E+1, 2(E+1)) mass | (E+1) x (E+1) co-selection | B+1 beta histogram |
//   tokens, decode tokens, steps

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops.h"

// logits [T, E] fp32, weights / index [T, K] (the full router's routes, fp32 / int64; index outside
// [0, E): a dropped route), live / decode [T] bool; armed [L] int64: the step is counted in this layer
// only while armed[slot] != 0, which the call clears (a layer counts once per step, and a forward
// the engine did not report adds nothing). Writes routes [>=T, K] int64 (the counted routes, E
// elsewhere) and gates [>=T, K] fp32 (their gate weights): what the experts kernel observes.
// weights / index [*, 0] (softmax routers): the op selects the full router's routes itself, the K
// largest logits of a token (softmax is monotone; the lower expert first on a tie, as softmax_topk),
// so a decode step computes no softmax over every expert twice (the selection and these gates).
void observe_routes(const at::Tensor& logits, const at::Tensor& weights, const at::Tensor& index,
                    const at::Tensor& live, const at::Tensor& decode, at::Tensor& armed, int64_t slot, bool sigmoid,
                    bool renorm, int64_t beta_bins, at::Tensor& sums, at::Tensor& routes, at::Tensor& gates) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits: contiguous fp32 [T, E]");
  const int64_t T = logits.size(0), E = logits.size(1), K = routes.size(1);
  const bool select = index.dim() == 2 && index.size(1) == 0;
  TORCH_CHECK(!select || (!sigmoid && K <= E), "selecting the routes here (index [T, 0]) is for softmax routers, k <= E");
  TORCH_CHECK(index.dim() == 2 && (select || (index.size(0) == T && index.size(1) == K)) &&
                  index.scalar_type() == at::kLong && index.is_contiguous(), "index: contiguous int64 [T, K] or [*, 0]");
  TORCH_CHECK(weights.sizes() == index.sizes() && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              "weights: contiguous fp32, index's shape");
  TORCH_CHECK(live.numel() >= T && decode.numel() >= T && live.scalar_type() == at::kBool &&
                  decode.scalar_type() == at::kBool && live.is_contiguous() && decode.is_contiguous(),
              "live, decode: contiguous bool [T]");
  TORCH_CHECK(armed.scalar_type() == at::kLong && slot >= 0 && slot < armed.numel(), "armed: int64 [L], slot in it");
  const int64_t cos0 = 2 * (E + 1), beta0 = cos0 + (E + 1) * (E + 1), count0 = beta0 + beta_bins + 1;
  TORCH_CHECK(sums.scalar_type() == at::kDouble && sums.is_contiguous() && sums.numel() == count0 + 3,
              "sums: contiguous float64, the layout in observe.cpp");
  TORCH_CHECK(routes.scalar_type() == at::kLong && routes.is_contiguous() && routes.dim() == 2 && routes.size(0) >= T,
              "routes: contiguous int64 [>=T, K]");
  TORCH_CHECK(gates.scalar_type() == at::kFloat && gates.is_contiguous() && gates.sizes() == routes.sizes(),
              "gates: contiguous fp32, routes' shape");
  int64_t* armed_p = armed.data_ptr<int64_t>() + slot;
  const bool counting = *armed_p != 0;
  *armed_p = 0;
  const float* l = logits.data_ptr<float>();
  const float* w = weights.data_ptr<float>();
  const int64_t* ix = index.data_ptr<int64_t>();
  const bool* lv = live.data_ptr<bool>();
  const bool* dc = decode.data_ptr<bool>();
  double* s = sums.data_ptr<double>();
  int64_t* r_out = routes.data_ptr<int64_t>();
  float* g_out = gates.data_ptr<float>();
  std::vector<float> scores(E);
  std::vector<int64_t> kept(K);
  std::vector<float> g(K);
  int64_t tokens = 0, decode_tokens = 0;
  for (int64_t t = 0; t < T; ++t) {
    int64_t* rt = r_out + t * K;
    float* gt = g_out + t * K;
    if (!counting || !lv[t]) {
      std::fill(rt, rt + K, E);
      std::fill(gt, gt + K, 0.f);
      continue;
    }
    ++tokens;
    decode_tokens += dc[t];
    const float* lt = l + t * E;
    float gsum = 0.f, w1 = 0.f, w2 = 0.f;   // the two largest route weights (dropped routes: 0)
    int64_t n = 0;
    if (select) {
      for (int64_t e = 0; e < E; ++e) {      // insertion into the K largest so far, in order
        const float v = lt[e];
        if (n == K && !(v > lt[kept[K - 1]])) continue;
        int64_t p = n < K ? n++ : K - 1;
        for (; p > 0 && v > lt[kept[p - 1]]; --p) kept[p] = kept[p - 1];
        kept[p] = e;
      }
      const float top = lt[kept[0]];
      float total = 0.f;                     // the softmax's denominator (renorm: the kept routes' sum cancels it)
      if (!renorm)
        for (int64_t e = 0; e < E; ++e) total += std::exp(lt[e] - top);
      for (int64_t j = 0; j < K; ++j) {
        rt[j] = kept[j];
        gsum += (g[j] = std::exp(lt[kept[j]] - top));
        if (!renorm) g[j] /= total;
      }
      w1 = g[0];
      w2 = K >= 2 ? g[1] : 0.f;
    } else {
      if (sigmoid) {
        for (int64_t e = 0; e < E; ++e) scores[e] = 1.f / (1.f + std::exp(-lt[e]));
      } else {   // softmax, max-subtracted as torch's
        float top = -INFINITY, total = 0.f;
        for (int64_t e = 0; e < E; ++e) top = std::max(top, lt[e]);
        for (int64_t e = 0; e < E; ++e) total += (scores[e] = std::exp(lt[e] - top));
        for (int64_t e = 0; e < E; ++e) scores[e] /= total;
      }
      for (int64_t j = 0; j < K; ++j) {
        const int64_t e = ix[t * K + j];
        const bool valid = e >= 0 && e < E;
        rt[j] = valid ? e : E;
        g[j] = valid ? scores[e] : 0.f;
        gsum += g[j];
        if (valid) kept[n++] = e;
        const float wj = valid ? w[t * K + j] : 0.f;
        if (wj > w1) {
          w2 = w1;
          w1 = wj;
        } else if (wj > w2) {
          w2 = wj;
        }
      }
    }
    if (renorm)
      for (int64_t j = 0; j < K; ++j) g[j] /= std::max(gsum, 1e-20f);
    for (int64_t j = 0; j < K; ++j) {
      gt[j] = g[j];
      if (rt[j] == E) continue;
      s[rt[j]] += 1.0;
      s[E + 1 + rt[j]] += g[j];
    }
    for (int64_t a = 0; a < n; ++a)
      for (int64_t b = 0; b < n; ++b) s[cos0 + kept[a] * (E + 1) + kept[b]] += 1.0;
    if (K >= 2 && w1 > 0.f) {
      const float ratio = w2 / std::max(w1, 1e-20f);
      const int64_t bin = std::clamp<int64_t>((int64_t)(ratio * (float)beta_bins), 0, beta_bins - 1);
      s[beta0 + bin] += 1.0;
    }
  }
  s[count0] += tokens;
  s[count0 + 1] += decode_tokens;
  s[count0 + 2] += counting;
}
