// The native ops' C++ entry points (one declaration each): bindings.cpp registers them as torch
// operators, decode_layer.cpp composes them into a decode layer.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <tuple>
#include <vector>

at::Tensor swiglu_experts(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                          const at::Tensor& index, const at::Tensor& weight, at::Tensor& experts_read, int64_t layer);
at::Tensor swiglu_experts_observed(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                                   const at::Tensor& index, const at::Tensor& weight, const at::Tensor& observe,
                                   const at::Tensor& gate, at::Tensor& sums);
// observe.cpp
void observe_routes(const at::Tensor& logits, const at::Tensor& weights, const at::Tensor& index,
                    const at::Tensor& live, const at::Tensor& decode, at::Tensor& armed, int64_t slot, bool sigmoid,
                    bool renorm, int64_t beta_bins, at::Tensor& sums, at::Tensor& routes, at::Tensor& gates);
// whether bf16 expert / packed weights meet rows rounded to bf16 in the bf16 dot product (experts.cpp: kDotBf16)
bool experts_round_to_bf16();
at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
std::tuple<at::Tensor, at::Tensor> softmax_topk(const at::Tensor& logits, int64_t k, bool normalise,
                                                const c10::optional<at::Tensor>& allowed);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table, const at::Tensor& lengths, int64_t block_size,
                                  double scale);
at::Tensor rotary_kv_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                           const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                           const at::Tensor& slot_mapping);

// decode_layer.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_block(
    const at::Tensor& x, const at::Tensor& h, const at::Tensor& qkv, const c10::optional<at::Tensor>& qkv_bias,
    const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double qk_eps,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_table, const at::Tensor& context_lens,
    int64_t block_size, double scaling, const at::Tensor& o, const at::Tensor& post_norm, double post_eps,
    const at::Tensor& moe_in, int64_t heads, int64_t kv_heads);
std::tuple<at::Tensor, at::Tensor> moe_block(
    const at::Tensor& x, const at::Tensor& h, const at::Tensor& index, const at::Tensor& weight,
    const at::Tensor& gate_up, const at::Tensor& down, at::Tensor& experts_read, int64_t layer,
    const at::Tensor& moe_in_out, int64_t num_experts, const c10::optional<at::Tensor>& shared_down,
    const c10::optional<at::Tensor>& shared_gate_up, const c10::optional<at::Tensor>& shared_gate,
    const at::Tensor& next_norm, double next_eps);
std::tuple<at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& x, const at::Tensor& h, const at::Tensor& qkv, const c10::optional<at::Tensor>& qkv_bias,
    const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, double qk_eps,
    const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_table, const at::Tensor& context_lens,
    int64_t block_size, double scaling, const at::Tensor& o, const at::Tensor& post_norm, double post_eps,
    const at::Tensor& moe_in, int64_t heads, int64_t kv_heads, int64_t top_k, bool normalise,
    const at::Tensor& gate_up, const at::Tensor& down, at::Tensor& experts_read, int64_t layer,
    int64_t num_experts, const c10::optional<at::Tensor>& shared_down, const c10::optional<at::Tensor>& shared_gate_up,
    const c10::optional<at::Tensor>& shared_gate, const at::Tensor& next_norm, double next_eps, bool round_weights);

// A model's decode step under the full router, built once: the weights, norms, rotary table and KV
// cache bound at construction (add_layer per decoder layer), so a step passes only its own inputs and
// runs embedding, every decode_layer and the LM head without returning to Python.
struct DecodeGraph : torch::CustomClassHolder {
  struct Layer {
    at::Tensor qkv;
    c10::optional<at::Tensor> qkv_bias, q_norm, k_norm;
    double qk_eps;
    at::Tensor k_cache, v_cache, o, post_norm;
    double post_eps;
    at::Tensor moe_in;
    int64_t top_k;
    bool normalise;
    at::Tensor gate_up, down;
    int64_t experts_layer, num_experts;
    c10::optional<at::Tensor> shared_down, shared_gate_up, shared_gate;   // the last two: bf16 (unstacked)
    at::Tensor next_norm;
    double next_eps;
    bool round_weights;   // bf16: the router's weights rounded to bf16, as the stock router returns them
  };
  at::Tensor embed, first_norm, lm_head, cos_table, sin_table;
  double first_eps, scaling;
  int64_t heads, kv_heads, block_size;
  std::vector<Layer> layers;

  DecodeGraph(at::Tensor embed, at::Tensor first_norm, double first_eps, at::Tensor lm_head, at::Tensor cos_table,
              at::Tensor sin_table, int64_t heads, int64_t kv_heads, int64_t block_size, double scaling);
  void add_layer(at::Tensor qkv, c10::optional<at::Tensor> qkv_bias, c10::optional<at::Tensor> q_norm,
                 c10::optional<at::Tensor> k_norm, double qk_eps, at::Tensor k_cache, at::Tensor v_cache, at::Tensor o,
                 at::Tensor post_norm, double post_eps, at::Tensor moe_in, int64_t top_k, bool normalise,
                 at::Tensor gate_up, at::Tensor down, int64_t experts_layer, int64_t num_experts,
                 c10::optional<at::Tensor> shared_down, c10::optional<at::Tensor> shared_gate_up,
                 c10::optional<at::Tensor> shared_gate, at::Tensor next_norm, double next_eps, bool round_weights);
  // One bound layer (its index in add_layer order) of a decode step, the step's own inputs only:
  // cos, sin [B, D]; slot_mapping, context_lens [B], block_table [B, nb] int64; experts_read [L] (written).
  // `attention`: attention_block -> (x, h, h through moe_in); `moe`: moe_block on the step's routes
  // (index [B, K] int64, weight [B, K] fp32) -> (x, h); `layer`: both with the full router's selection
  // between them (top_k > 0: min(the layer's k, top_k)).
  std::tuple<at::Tensor, at::Tensor, at::Tensor> attention(int64_t i, const at::Tensor& x, const at::Tensor& h,
                                                           const at::Tensor& cos, const at::Tensor& sin,
                                                           const at::Tensor& slot_mapping, const at::Tensor& block_table,
                                                           const at::Tensor& context_lens);
  std::tuple<at::Tensor, at::Tensor> moe(int64_t i, const at::Tensor& x, const at::Tensor& h, const at::Tensor& index,
                                         const at::Tensor& weight, at::Tensor experts_read, const at::Tensor& moe_in_out);
  std::tuple<at::Tensor, at::Tensor> layer(int64_t i, const at::Tensor& x, const at::Tensor& h, const at::Tensor& cos,
                                           const at::Tensor& sin, const at::Tensor& slot_mapping,
                                           const at::Tensor& block_table, const at::Tensor& context_lens,
                                           at::Tensor experts_read, int64_t top_k);
  // ids, positions, slot_mapping, context_lens [B], block_table [B, nb] int64; experts_read [L] (written)
  at::Tensor forward(const at::Tensor& ids, const at::Tensor& positions, const at::Tensor& slot_mapping,
                     const at::Tensor& block_table, const at::Tensor& context_lens, at::Tensor experts_read,
                     int64_t top_k);
};
