"""A probe of the experts-kernel layout: bf16 weights packed in 16-column panels, activations broadcast.

    flock /tmp/moetailor-heavy.lock .venv/bin/python scripts/packed_weights_probe.py

Times one [2048 x 2048] bf16 linear at 1-64 rows two ways, side by side: the
engine's op (`kernels.rows_linear`: each weight row a dot product against each activation row, the
pair tile of `experts.cpp`) and a microkernel on the same weights repacked as [cols/16][depth/2][16][2]
(one 64-byte load = 16 columns x 2 depths, widened by a shift and an and; each activation value
broadcast; 8 rows x 3 panels of accumulators, no horizontal sums), as torch's and llama.cpp's GEMMs
repack. "hot": one weight (8 MB, in L3); "cold": 16 copies in turn (128 MB). AVX-512 only. What it
measured was the case for holding experts packed (docs/benchmarks.md, 2026-12-04); the engine has held
them so since (``kernels.pack_weight``, the panel tile in ``kernels/experts.cpp``), and this stays as the
microkernel's own yardstick.
"""
from __future__ import annotations

import time

import torch
from torch.utils import cpp_extension

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <vector>
#include <algorithm>
// packed bf16 weights: [cols/16][depth/2][16 cols][2 depths] -> one 64-byte load = 16 columns x 2 depths
template <int RB, int CP>
inline void panel_kernel(const float* a, int lda, const uint16_t* w, int64_t panel_stride, int depth, float* out, int ldo) {
  __m512 acc[RB][CP];
  for (int r = 0; r < RB; ++r) for (int p = 0; p < CP; ++p) acc[r][p] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
  for (int d = 0; d < depth; d += 2) {
    __m512 ev[CP], od[CP];
    for (int p = 0; p < CP; ++p) {
      const __m512i both = _mm512_loadu_si512(w + p * panel_stride + (int64_t)d * 16);
      ev[p] = _mm512_castsi512_ps(_mm512_slli_epi32(both, 16));
      od[p] = _mm512_castsi512_ps(_mm512_and_si512(both, high));
    }
    for (int r = 0; r < RB; ++r) {
      const __m512 b0 = _mm512_set1_ps(a[(int64_t)r * lda + d]), b1 = _mm512_set1_ps(a[(int64_t)r * lda + d + 1]);
      for (int p = 0; p < CP; ++p) acc[r][p] = _mm512_fmadd_ps(b1, od[p], _mm512_fmadd_ps(b0, ev[p], acc[r][p]));
    }
  }
  for (int r = 0; r < RB; ++r) for (int p = 0; p < CP; ++p) _mm512_storeu_ps(out + (int64_t)r * ldo + p * 16, acc[r][p]);
}
template <int RB, int CP>
void run_block(const float* a, int lda, const uint16_t* w, int cols, int depth, float* out, int ldo) {
  const int64_t ps = (int64_t)depth * 16;
  const int panels = cols / 16;
  int p = 0;
  for (; p + CP <= panels; p += CP) panel_kernel<RB, CP>(a, lda, w + p * ps, ps, depth, out + p * 16, ldo);
  for (; p < panels; ++p) panel_kernel<RB, 1>(a, lda, w + p * ps, ps, depth, out + p * 16, ldo);
}
void packed_rows_times_weight(const float* a, int rows, const uint16_t* w, int cols, int depth, float* out, int ldo) {
  int r = 0;
  for (; r + 8 <= rows; r += 8) run_block<8, 3>(a + (int64_t)r * depth, depth, w, cols, depth, out + (int64_t)r * ldo, ldo);
  for (; r + 4 <= rows; r += 4) run_block<4, 4>(a + (int64_t)r * depth, depth, w, cols, depth, out + (int64_t)r * ldo, ldo);
  for (; r + 2 <= rows; r += 2) run_block<2, 6>(a + (int64_t)r * depth, depth, w, cols, depth, out + (int64_t)r * ldo, ldo);
  for (; r < rows; ++r) run_block<1, 8>(a + (int64_t)r * depth, depth, w, cols, depth, out + (int64_t)r * ldo, ldo);
}
// time: rows x [cols, depth] against `copies` weights in turn (cold when they exceed the L3)
double time_packed(const torch::Tensor& a, const std::vector<torch::Tensor>& ws, int64_t reps, torch::Tensor out) {
  const int rows = a.size(0), depth = a.size(1), cols = out.size(1);
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < reps; ++i)
    for (auto& w : ws) {
      const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
      at::parallel_for(0, cols / 16, 1, [&](int64_t b, int64_t e) {
        packed_rows_times_weight(a.data_ptr<float>(), rows, wp + b * 16 * depth, (int)(e - b) * 16, depth, out.data_ptr<float>() + b * 16, cols);
      });
    }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / (reps * ws.size());
}
"""


def pack(w: torch.Tensor) -> torch.Tensor:
    """[cols, depth] -> [cols/16, depth/2, 16, 2]: each 64 bytes are 16 columns at two depths."""
    cols, depth = w.shape
    return w.view(cols // 16, 16, depth // 2, 2).permute(0, 2, 1, 3).contiguous()


def main() -> None:
    from moetailor import kernels

    if "avx512f" not in open("/proc/cpuinfo").read():
        raise SystemExit("the probe's microkernel is AVX-512 only")
    torch.set_num_threads(2)
    probe = cpp_extension.load_inline("moetailor_packed_probe", cpp_sources=SOURCE, functions=["time_packed"],
                                      extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    linear = kernels.rows_linear()
    cols = depth = 2048
    for label, copies in (("hot", 1), ("cold", 16)):
        g = torch.Generator().manual_seed(0)
        weights = [(torch.randn(cols, depth, generator=g) * 0.02).bfloat16() for _ in range(copies)]
        packed = [pack(w) for w in weights]
        for rows in (1, 4, 8, 16, 32, 64):
            a, out = torch.randn(rows, depth, generator=g), torch.empty(rows, cols)
            probe.time_packed(a, packed[:1], 1, out)
            torch.testing.assert_close(out, a @ weights[0].float().T, rtol=1e-4, atol=1e-4)
            reps = max(1, 20 // copies)
            t_packed, t_op = [], []
            for _ in range(5):                         # in turn, so both see the same machine
                t_packed.append(probe.time_packed(a, packed, reps, out))
                t0 = time.perf_counter()
                for _ in range(reps):
                    for w in weights:
                        linear(a, w)
                t_op.append((time.perf_counter() - t0) / (reps * copies))
            flop = 2 * rows * cols * depth
            print(f"{label:4s} rows={rows:2d}: engine op {flop / min(t_op) / 1e9:6.1f} GFLOP/s, packed "
                  f"{flop / min(t_packed) / 1e9:6.1f} GFLOP/s ({min(t_op) / min(t_packed):.2f}x)", flush=True)


if __name__ == "__main__":
    main()
