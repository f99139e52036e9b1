// The native kernels' Python bindings (one extension module, built by kernels/__init__.py).
#include <torch/extension.h>

#include <vector>

std::vector<torch::Tensor> swiglu_experts(torch::Tensor x, torch::Tensor gate_up, torch::Tensor down,
                                          torch::Tensor index, torch::Tensor weight);
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor lengths, int64_t block_size,
                                     double scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("swiglu_experts", &swiglu_experts, "routed SwiGLU experts of a decode step (CPU)");
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over the paged KV cache (CPU)");
}
