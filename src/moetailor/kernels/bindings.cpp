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
  m.class_<DecodeGraph>("DecodeGraph")
      .def(torch::init<at::Tensor, at::Tensor, double, at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t, int64_t,
                       double>())
      .def("add_layer", &DecodeGraph::add_layer)
      .def("attention", &DecodeGraph::attention)
      .def("moe", &DecodeGraph::moe)
      .def("layer", &DecodeGraph::layer)
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
}
