// One decoder layer of a decode step (Qwen-MoE shape) in one to three calls instead of ~25.
// Why: at batch 1 a step is ~150 torch ops from Python, each costing a few microseconds of dispatch
// and interpreter time beside kernels that read a few hundred kilobytes; llama.cpp runs its whole
// graph without returning to a host language. These compose the existing ops (ops.h) in the order
// runtime/decoder.py calls them one by one, and the elementwise steps of the shared expert
// through ATen's own kernels (at::silu, at::sigmoid), so the result is the same, bit for bit.
// fp32 or bf16: a bf16 layer converts where the Python loop converts (the attention and the experts take
// fp32 rows and give back the layer's dtype; the router's logits are selected over in fp32 and its
// weights rounded to bf16 where the stock router rounds them), and its shared expert runs its own
// projections (gate|up stacked, the sigmoid gate) instead of rows of `moe_in`.
//
//   attention_block: (x, h) -> q|k|v, rotary + k/v write, paged attention, o, residual add + norm -> (x, h),
//                    and h through `moe_in` [E + 2I + 1, H] (router | shared gate, up | shared gate logit).
//   moe_block:       routed experts + sigmoid-gated shared expert, residual add + next norm -> (x, h).
//   decode_layer:    both, with the full softmax router's selection between them (no plan, no budgets).
#include <torch/extension.h>

#include <algorithm>

#include "ops.h"

namespace {

at::Tensor head_norm(const at::Tensor& t, const at::Tensor& weight, double eps) {
  // runtime/decoder.py's Norm.heads on [B, heads, D]: per head where the weight holds D values (Qwen3-MoE),
  // else over each token's whole projection (OLMoE), back to the view's shape
  const int64_t width = weight.numel() == t.size(-1) ? t.size(-1) : t.size(1) * t.size(2);
  return rms_norm(t.reshape({-1, width}).contiguous(), weight, eps).view(t.sizes());
}

// the input width of a linear weight: [N, depth] row-major, or packed [N/16, depth/P, 16, P]
int64_t depth_of(const at::Tensor& w) { return w.dim() == 4 ? w.size(1) * w.size(3) : w.size(1); }

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_block(
    const at::Tensor& x, const at::Tensor& h, const at::Tensor& qkv, const c10::optional<at::Tensor>& qkv_bias,
    const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double qk_eps,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_table, const at::Tensor& context_lens,
    int64_t block_size, double scaling, const at::Tensor& o, const at::Tensor& post_norm, double post_eps,
    const at::Tensor& moe_in, int64_t heads, int64_t kv_heads) {
  const int64_t B = h.size(0);
  auto all = rows_linear(h, qkv, qkv_bias);                                       // [B, (nH + 2 nKV) D]
  TORCH_CHECK(all.size(1) % (heads + 2 * kv_heads) == 0, "qkv rows must be (heads + 2 kv_heads) x head size");
  const int64_t D = all.size(1) / (heads + 2 * kv_heads);                         // (qkv may be packed: [N/16, ...])
  all = all.view({B, heads + 2 * kv_heads, D});                                   // [B, nH + 2 nKV, D]
  auto q = all.narrow(1, 0, heads), k = all.narrow(1, heads, kv_heads), v = all.narrow(1, heads + kv_heads, kv_heads);
  if (q_norm.has_value()) {
    q = head_norm(q, *q_norm, qk_eps);
    k = head_norm(k, *k_norm, qk_eps);
  }
  q = rotary_kv_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping);                 // [B, nH, D]
  auto attn = paged_decode_attention(q.to(at::kFloat), k_cache, v_cache, block_table, context_lens, block_size,
                                     scaling).to(x.scalar_type());                          // fp32 inside
  auto [x2, h2] = add_rms_norm(x, rows_linear(attn.reshape({B, heads * D}), o, c10::nullopt), post_norm, post_eps);
  return {x2, h2, rows_linear(h2, moe_in, c10::nullopt)};                                  // [B, H] x2, [B, N]
}

std::tuple<at::Tensor, at::Tensor> moe_block(
    const at::Tensor& x, const at::Tensor& h, const at::Tensor& index, const at::Tensor& weight,
    const at::Tensor& gate_up, const at::Tensor& down, at::Tensor& experts_read, int64_t layer,
    const at::Tensor& moe_in_out, int64_t num_experts, const c10::optional<at::Tensor>& shared_down,
    const c10::optional<at::Tensor>& shared_gate_up, const c10::optional<at::Tensor>& shared_gate,
    const at::Tensor& next_norm, double next_eps) {
  auto out = swiglu_experts(h.to(at::kFloat).contiguous(), gate_up, down, index, weight, experts_read, layer)
                 .to(x.scalar_type());                                                       // [B, H]
  if (shared_down.has_value()) {
    // gate | up | the sigmoid gate's logit: rows of moe_in_out (fp32, stacked into moe_in), or projected here
    const int64_t I = depth_of(*shared_down);
    at::Tensor gate_up, gate_logit;
    if (shared_gate_up.has_value()) {
      TORCH_CHECK(shared_gate.has_value(), "shared_gate_up comes with shared_gate");
      gate_up = rows_linear(h, *shared_gate_up, c10::nullopt);                              // [B, 2I]
      gate_logit = rows_linear(h, *shared_gate, c10::nullopt);                              // [B, 1]
    } else {
      TORCH_CHECK(moe_in_out.size(1) == num_experts + 2 * I + 1, "moe_in_out: [B, E + 2I + 1]");
      gate_up = moe_in_out.narrow(1, num_experts, 2 * I);
      gate_logit = moe_in_out.narrow(1, num_experts + 2 * I, 1);
    }
    auto gate = gate_up.narrow(1, 0, I), up = gate_up.narrow(1, I, I);
    auto shared = rows_linear((at::silu(gate) * up).contiguous(), *shared_down, c10::nullopt);   // [B, H]
    out = out + at::sigmoid(gate_logit) * shared;
  }
  auto [x2, h2] = add_rms_norm(x, out, next_norm, next_eps);
  return {x2, h2};
}

std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& x, const at::Tensor& h, const at::Tensor& qkv, const c10::optional<at::Tensor>& qkv_bias,
    const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double qk_eps,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_table, const at::Tensor& context_lens,
    int64_t block_size, double scaling, const at::Tensor& o, const at::Tensor& post_norm, double post_eps,
    const at::Tensor& moe_in, int64_t heads, int64_t kv_heads, int64_t top_k, bool normalise,
    const at::Tensor& gate_up, const at::Tensor& down, at::Tensor& experts_read, int64_t layer,
    int64_t num_experts, const c10::optional<at::Tensor>& shared_down, const c10::optional<at::Tensor>& shared_gate_up,
    const c10::optional<at::Tensor>& shared_gate, const at::Tensor& next_norm, double next_eps, bool round_weights) {
  auto [x2, h2, proj] = attention_block(x, h, qkv, qkv_bias, q_norm, k_norm, qk_eps, cos, sin, k_cache, v_cache,
                                        slot_mapping, block_table, context_lens, block_size, scaling, o, post_norm,
                                        post_eps, moe_in, heads, kv_heads);
  auto [weights, index] = softmax_topk(proj.narrow(1, 0, num_experts).to(at::kFloat).contiguous(), top_k, normalise,
                                      c10::nullopt);
  if (round_weights && proj.scalar_type() != at::kFloat) weights = weights.to(proj.scalar_type()).to(at::kFloat);
  return moe_block(x2, h2, index, weights, gate_up, down, experts_read, layer, proj, num_experts, shared_down,
                   shared_gate_up, shared_gate, next_norm, next_eps);
}

DecodeGraph::DecodeGraph(at::Tensor embed, at::Tensor first_norm, double first_eps, at::Tensor lm_head,
                         at::Tensor cos_table, at::Tensor sin_table, int64_t heads, int64_t kv_heads,
                         int64_t block_size, double scaling)
    : embed(std::move(embed)), first_norm(std::move(first_norm)), lm_head(std::move(lm_head)),
      cos_table(std::move(cos_table)), sin_table(std::move(sin_table)), first_eps(first_eps), scaling(scaling),
      heads(heads), kv_heads(kv_heads), block_size(block_size) {}

void DecodeGraph::add_layer(at::Tensor qkv, c10::optional<at::Tensor> qkv_bias, c10::optional<at::Tensor> q_norm,
                            c10::optional<at::Tensor> k_norm, double qk_eps, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor o, at::Tensor post_norm, double post_eps, at::Tensor moe_in, int64_t top_k,
                            bool normalise, at::Tensor gate_up, at::Tensor down, int64_t experts_layer,
                            int64_t num_experts, c10::optional<at::Tensor> shared_down,
                            c10::optional<at::Tensor> shared_gate_up, c10::optional<at::Tensor> shared_gate,
                            at::Tensor next_norm, double next_eps, bool round_weights) {
  layers.push_back({qkv, qkv_bias, q_norm, k_norm, qk_eps, k_cache, v_cache, o, post_norm, post_eps, moe_in, top_k,
                    normalise, gate_up, down, experts_layer, num_experts, shared_down, shared_gate_up, shared_gate,
                    next_norm, next_eps, round_weights});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> DecodeGraph::attention(
    int64_t i, const at::Tensor& x, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& slot_mapping, const at::Tensor& block_table, const at::Tensor& context_lens) {
  auto& l = layers.at(i);
  return attention_block(x, h, l.qkv, l.qkv_bias, l.q_norm, l.k_norm, l.qk_eps, cos, sin, l.k_cache, l.v_cache,
                         slot_mapping, block_table, context_lens, block_size, scaling, l.o, l.post_norm, l.post_eps,
                         l.moe_in, heads, kv_heads);
}

std::tuple<at::Tensor, at::Tensor> DecodeGraph::moe(int64_t i, const at::Tensor& x, const at::Tensor& h,
                                                    const at::Tensor& index, const at::Tensor& weight,
                                                    at::Tensor experts_read, const at::Tensor& moe_in_out) {
  auto& l = layers.at(i);
  return moe_block(x, h, index, weight, l.gate_up, l.down, experts_read, l.experts_layer, moe_in_out, l.num_experts,
                   l.shared_down, l.shared_gate_up, l.shared_gate, l.next_norm, l.next_eps);
}

std::tuple<at::Tensor, at::Tensor> DecodeGraph::layer(int64_t i, const at::Tensor& x, const at::Tensor& h,
                                                      const at::Tensor& cos, const at::Tensor& sin,
                                                      const at::Tensor& slot_mapping, const at::Tensor& block_table,
                                                      const at::Tensor& context_lens, at::Tensor experts_read,
                                                      int64_t top_k) {
  auto& l = layers.at(i);
  return decode_layer(x, h, l.qkv, l.qkv_bias, l.q_norm, l.k_norm, l.qk_eps, cos, sin, l.k_cache, l.v_cache,
                      slot_mapping, block_table, context_lens, block_size, scaling, l.o, l.post_norm, l.post_eps,
                      l.moe_in, heads, kv_heads, top_k > 0 ? std::min(l.top_k, top_k) : l.top_k, l.normalise,
                      l.gate_up, l.down, experts_read, l.experts_layer, l.num_experts, l.shared_down,
                      l.shared_gate_up, l.shared_gate, l.next_norm, l.next_eps, l.round_weights);
}

// runtime/decoder.py's loop, in the same order: embedding, cos/sin rows of the table, the first norm,
// each layer's decode_layer, the LM head. top_k > 0: every layer routes min(its k, top_k) experts (a step whose
// requests all share one budget); 0: each layer's own k.
at::Tensor DecodeGraph::forward(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& slot_mapping,
                                const at::Tensor& block_table, const at::Tensor& context_lens,
                                at::Tensor experts_read, int64_t top_k) {
  auto x = at::embedding(embed, ids);                                                      // [B, H]
  auto cos = cos_table.index_select(0, positions), sin = sin_table.index_select(0, positions);  // [B, D]
  auto h = rms_norm(x, first_norm, first_eps);
  for (int64_t i = 0; i < static_cast<int64_t>(layers.size()); ++i)
    std::tie(x, h) = layer(i, x, h, cos, sin, slot_mapping, block_table, context_lens, experts_read, top_k);
  return rows_linear(h, lm_head, c10::nullopt);                                           // [B, V]
}
