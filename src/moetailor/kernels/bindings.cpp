// The native kernels as torch operators (``torch.ops.moetailor.*``), the way vLLM's
// csrc/cpu/torch_bindings.cpp registers its CPU kernels: a schema per op (mutated arguments marked
// ``(a!)``) and a CPU implementation. Their fake (meta) implementations are in kernels/__init__.py,
// so torch.compile and graph capture see one opaque op per call, and the vLLM plugin can call them.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(moetailor, m) {
  m.def("swiglu_experts(Tensor x, Tensor gate_up, Tensor down, Tensor index, Tensor weight, "
        "Tensor(a!) experts_read, int layer) -> Tensor");
  m.def("swiglu_experts_observed(Tensor x, Tensor gate_up, Tensor down, Tensor index, Tensor weight, "
        "Tensor observe, Tensor gate, Tensor(a!) sums) -> Tensor");
  m.def("observe_routes(Tensor logits, Tensor weights, Tensor index, Tensor live, Tensor decode, Tensor(a!) armed, "
        "int slot, bool sigmoid, bool renorm, int beta_bins, Tensor(b!) sums, Tensor(c!) routes, Tensor(d!) gates) -> ()");
  m.def("rows_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("softmax_topk(Tensor logits, int k, bool normalise, Tensor? allowed=None) -> (Tensor, Tensor)");
  m.def("experts_round_to_bf16() -> bool", &experts_round_to_bf16);   // no tensor: one kernel for every key
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor lengths, "
        "int block_size, float scale) -> Tensor");
  m.def("rotary_kv_write(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_mapping) -> Tensor");
  m.def("attention_block(Tensor x, Tensor h, Tensor qkv, Tensor? qkv_bias, Tensor? q_norm, Tensor? k_norm, "
        "float qk_eps, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor block_table, Tensor context_lens, int block_size, float scaling, Tensor o, Tensor post_norm, "
        "float post_eps, Tensor moe_in, int heads, int kv_heads) -> (Tensor, Tensor, Tensor)");
  m.def("moe_block(Tensor x, Tensor h, Tensor index, Tensor weight, Tensor gate_up, Tensor down, "
        "Tensor(a!) experts_read, int layer, Tensor moe_in_out, int num_experts, Tensor? shared_down, "
        "Tensor? shared_gate_up, Tensor? shared_gate, Tensor next_norm, float next_eps) -> (Tensor, Tensor)");
  m.def("decode_layer(Tensor x, Tensor h, Tensor qkv, Tensor? qkv_bias, Tensor? q_norm, Tensor? k_norm, "
        "float qk_eps, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor block_table, Tensor context_lens, int block_size, float scaling, Tensor o, Tensor post_norm, "
        "float post_eps, Tensor moe_in, int heads, int kv_heads, int top_k, bool normalise, Tensor gate_up, "
        "Tensor down, Tensor(c!) experts_read, int layer, int num_experts, Tensor? shared_down, "
        "Tensor? shared_gate_up, Tensor? shared_gate, Tensor next_norm, float next_eps, bool round_weights) "
        "-> (Tensor, Tensor)");
  m.class_<DecodeGraph>("DecodeGraph")
      .def(torch::init<at::Tensor, at::Tensor, double, at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t, int64_t,
                       double>())
      .def("add_layer", &DecodeGraph::add_layer)
      .def("forward", &DecodeGraph::forward);
}

TORCH_LIBRARY_IMPL(moetailor, CPU, m) {
  m.impl("swiglu_experts", &swiglu_experts);
  m.impl("swiglu_experts_observed", &swiglu_experts_observed);
  m.impl("observe_routes", &observe_routes);
  m.impl("rows_linear", &rows_linear);
  m.impl("softmax_topk", &softmax_topk);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("rotary_kv_write", &rotary_kv_write);
  m.impl("attention_block", &attention_block);
  m.impl("moe_block", &moe_block);
  m.impl("decode_layer", &decode_layer);
}
