// The native kernels as torch operators (``torch.ops.moetailor.*``), the way vLLM's
// csrc/cpu/torch_bindings.cpp registers its CPU kernels: a schema per op (mutated arguments marked
// ``(a!)``) and a CPU implementation. Their fake (meta) implementations are in kernels/__init__.py,
// so torch.compile and graph capture see one opaque op per call, and the vLLM plugin can call them.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <tuple>

at::Tensor swiglu_experts(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down,
                             const at::Tensor& index, const at::Tensor& weight, at::Tensor& experts_read,
                             int64_t layer);
at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
std::tuple<at::Tensor, at::Tensor> softmax_topk(const at::Tensor& logits, int64_t k, bool normalise,
                                                const c10::optional<at::Tensor>& allowed);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                              const at::Tensor& weight, double eps);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache, const at::Tensor& block_table,
                                     const at::Tensor& lengths, int64_t block_size, double scale);
at::Tensor rotary_kv_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                           const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                           const at::Tensor& slot_mapping);

TORCH_LIBRARY(moetailor, m) {
  m.def("swiglu_experts(Tensor x, Tensor gate_up, Tensor down, Tensor index, Tensor weight, "
        "Tensor(a!) experts_read, int layer) -> Tensor");
  m.def("rows_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("softmax_topk(Tensor logits, int k, bool normalise, Tensor? allowed=None) -> (Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor lengths, "
        "int block_size, float scale) -> Tensor");
  m.def("rotary_kv_write(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_mapping) -> Tensor");
}

TORCH_LIBRARY_IMPL(moetailor, CPU, m) {
  m.impl("swiglu_experts", &swiglu_experts);
  m.impl("rows_linear", &rows_linear);
  m.impl("softmax_topk", &softmax_topk);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("rotary_kv_write", &rotary_kv_write);
}
