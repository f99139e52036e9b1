// Decode-step MoE experts on the CPU: the routed tokens' SwiGLU experts in one call.
//
// Why: a decode step routes few tokens to each expert (1-16 rows), so a library GEMM per expert
// (torch's CPU _grouped_mm loops over the experts in C++) pays its per-call cost 2 x distinct
// experts times per layer, which dominates the step. Here each thread takes whole experts and runs
// a register-blocked kernel (4 rows x 4 output columns of 16-wide vectors) straight on the model's
// own expert layout, so there is no weight copy, no gather of the activations and one dispatch.
//
// Layout (transformers' fused experts): gate_up [E, 2I, H] (gate rows first, then up rows),
// down [E, H, I]; weights fp32 or bf16, activations fp32. Routes with an index outside [0, E) are
// dropped (the router's sentinel for pruned or skipped routes).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <tuple>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

inline v16 load(const float* p) { return load16(p); }
inline v16 load(const at::BFloat16* p) { return load16(p); }

// out[r][j0 + j] = dot(a[r], w[j0 + j]) for r < RB, j < 16 / RB (columns past `cols` are not stored).
#if defined(__AVX512F__)
// 16 accumulators (16 of the 32 zmm registers), summed by one transpose-add.
template <int RB, typename W>
inline void tile(const float* const* a, const W* w, int j0, int cols, int depth, float* out, int ldo) {
  constexpr int CB = 16 / RB;
  const W* wr[CB];
  for (int j = 0; j < CB; ++j) wr[j] = w + (int64_t)std::min(j0 + j, cols - 1) * depth;
  v16 acc[16] = {};
  for (int d = 0; d < depth; d += 16) {
    v16 av[RB], wv[CB];
    for (int r = 0; r < RB; ++r) av[r] = load(a[r] + d);
    for (int j = 0; j < CB; ++j) wv[j] = load(wr[j] + d);
    for (int r = 0; r < RB; ++r)
      for (int j = 0; j < CB; ++j) acc[r * CB + j] += av[r] * wv[j];
  }
  const v16 sums = sum16(acc);
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < CB && j0 + j < cols; ++j) out[(int64_t)r * ldo + j0 + j] = sums[r * CB + j];
}

// bf16 weights, 32 per load, widened by one instruction per 16: a 32-bit lane holds two bf16 values,
// element 2i in its low half and 2i + 1 in its high half, so `w << 16` is the even elements as fp32
// and `w & 0xffff0000` the odd ones. The activations come in the same order (`to_pair_order`: per 32
// values, the 16 even ones then the 16 odd ones), so the dot products need no shuffle. Half the
// widening work of load16's zero-extend + shift, which shares ports with the FMAs: without
// AVX512-BF16 a batch-32 / 64 layer of OLMoE-1B-7B's experts ran 1.25x / 1.32x faster with it
// and the prefetch below. The next 16 / RB weight rows (contiguous after these) are prefetched into L2
// as these stream: a bf16 row of 2048 is one 4 KB page, where the hardware prefetcher stops.
constexpr bool kPairedBf16 = true;

template <int RB>
inline void tile_pairs(const float* const* a, const at::BFloat16* w, int j0, int cols, int depth, float* out, int ldo) {
  constexpr int CB = 16 / RB;
  const at::BFloat16* wr[CB];
  for (int j = 0; j < CB; ++j) wr[j] = w + (int64_t)std::min(j0 + j, cols - 1) * depth;
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
  for (int d = 0; d < depth; d += 32) {
    for (int j = 0; j < CB; ++j) _mm_prefetch(reinterpret_cast<const char*>(wr[j] + CB * depth + d), _MM_HINT_T1);
    __m512 even[CB], odd[CB];
    for (int j = 0; j < CB; ++j) {
      const __m512i both = _mm512_loadu_si512(wr[j] + d);
      even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(both, 16));
      odd[j] = _mm512_castsi512_ps(_mm512_and_si512(both, high));
    }
    for (int r = 0; r < RB; ++r) {
      const __m512 ae = _mm512_loadu_ps(a[r] + d), ao = _mm512_loadu_ps(a[r] + d + 16);
      for (int j = 0; j < CB; ++j)
        acc[r * CB + j] = _mm512_fmadd_ps(ao, odd[j], _mm512_fmadd_ps(ae, even[j], acc[r * CB + j]));
    }
  }
  v16 acc16[16];
  std::memcpy(acc16, acc, sizeof(acc));
  const v16 sums = sum16(acc16);
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < CB && j0 + j < cols; ++j) out[(int64_t)r * ldo + j0 + j] = sums[r * CB + j];
}

// n values (a multiple of 32) into the order tile_pairs reads; in place is fine (each 32 is read first)
inline void to_pair_order(const float* src, float* dst, int64_t n) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  for (int64_t d = 0; d < n; d += 32) {
    const __m512 lo = _mm512_loadu_ps(src + d), hi = _mm512_loadu_ps(src + d + 16);
    _mm512_storeu_ps(dst + d, _mm512_permutex2var_ps(lo, even, hi));
    _mm512_storeu_ps(dst + d + 16, _mm512_permutex2var_ps(lo, odd, hi));
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2: 8-wide ymm registers through intrinsics. The 16-wide vector-extension type is not a
// register here: GCC splits it and kept the accumulators in memory, so rows_linear ran at 3-12 GB/s
// (a quarter to a half of torch's GEMV) with AVX2 alone. Each pass holds 8 accumulators (RB rows x
// 8 / RB columns) and sums them with one horizontal-add tree (vec.h: load8, sum8).
template <int RB, typename W>
inline void tile(const float* const* a, const W* w, int j0, int cols, int depth, float* out, int ldo) {
  constexpr int CB = 16 / RB, PB = 8 / RB;
  for (int p = 0; p < CB; p += PB) {
    const W* wr[PB];
    for (int j = 0; j < PB; ++j) wr[j] = w + (int64_t)std::min(j0 + p + j, cols - 1) * depth;
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int d = 0; d < depth; d += 8) {
      if ((d & 15) == 0)   // the next pass's rows (contiguous after these): a prefetch never faults
        for (int j = 0; j < PB; ++j) _mm_prefetch(reinterpret_cast<const char*>(wr[j] + PB * depth + d), _MM_HINT_T0);
      __m256 av[RB];
      for (int r = 0; r < RB; ++r) av[r] = _mm256_loadu_ps(a[r] + d);
      for (int j = 0; j < PB; ++j) {
        const __m256 wv = load8(wr[j] + d);
        for (int r = 0; r < RB; ++r) acc[r * PB + j] = _mm256_fmadd_ps(av[r], wv, acc[r * PB + j]);
      }
    }
    alignas(32) float sums[8];
    _mm256_store_ps(sums, sum8(acc));
    for (int r = 0; r < RB; ++r)
      for (int j = 0; j < PB && j0 + p + j < cols; ++j) out[(int64_t)r * ldo + j0 + p + j] = sums[r * PB + j];
  }
}
#endif
#if !defined(__AVX512F__)
constexpr bool kPairedBf16 = false;
template <int RB>
inline void tile_pairs(const float* const*, const at::BFloat16*, int, int, int, float*, int) {}
inline void to_pair_order(const float*, float*, int64_t) {}
#endif
#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
// Neither AVX-512 nor AVX2 + FMA: the 16-wide vector-extension type, summed lane by lane.
template <int RB, typename W>
inline void tile(const float* const* a, const W* w, int j0, int cols, int depth, float* out, int ldo) {
  constexpr int CB = 16 / RB;
  for (int j = 0; j < CB && j0 + j < cols; ++j) {
    const W* wr = w + (int64_t)(j0 + j) * depth;
    for (int r = 0; r < RB; ++r) {
      v16 acc = {};
      for (int d = 0; d < depth; d += 16) acc += load(a[r] + d) * load(wr + d);
      float sum = 0.f;
      for (int lane = 0; lane < 16; ++lane) sum += acc[lane];
      out[(int64_t)r * ldo + j0 + j] = sum;
    }
  }
}
#endif

// Whether rows_times_weight reads activation rows of `depth` in pair order (to_pair_order) for
// weights of type W: bf16 on AVX-512, where the depth is a multiple of 32.
template <typename W>
bool pair_order(int64_t depth) {
  return kPairedBf16 && std::is_same_v<W, at::BFloat16> && depth % 32 == 0;
}

template <int RB, typename W>
inline void tile_for(bool pairs, const float* const* a, const W* w, int j0, int cols, int depth, float* out, int ldo) {
  if constexpr (std::is_same_v<W, at::BFloat16>)
    if (pairs) return tile_pairs<RB>(a, w, j0, cols, depth, out, ldo);
  tile<RB>(a, w, j0, cols, depth, out, ldo);
}

// out[r][j] = dot(a[r], w[j]) for r < rows, j < cols; a[r] and w[j] hold `depth` (a multiple of 16)
// values, a[r] in pair order where pair_order<W>(depth). Weights go by tiles of 16 rows, each read
// from memory once and reused from cache by every block of 4, 2 and 1 activation rows (a decode
// step's expert sees 1-16 rows).
template <typename W>
void rows_times_weight(const float* const* a, int rows, const W* w, int cols, int depth, float* out, int ldo) {
  const bool pairs = pair_order<W>(depth);
  for (int t0 = 0; t0 < cols; t0 += 16) {
    const int t1 = std::min(t0 + 16, cols);
    int r0 = 0;
    for (; r0 + 4 <= rows; r0 += 4)
      for (int j0 = t0; j0 < t1; j0 += 4) tile_for<4>(pairs, a + r0, w, j0, cols, depth, out + (int64_t)r0 * ldo, ldo);
    for (; r0 + 2 <= rows; r0 += 2)
      for (int j0 = t0; j0 < t1; j0 += 8) tile_for<2>(pairs, a + r0, w, j0, cols, depth, out + (int64_t)r0 * ldo, ldo);
    for (; r0 < rows; ++r0) tile_for<1>(pairs, a + r0, w, t0, cols, depth, out + (int64_t)r0 * ldo, ldo);
  }
}

// ---- packed experts ------------------------------------------------------------------------------
// A weight [cols, depth] held as [cols/16][depth/P][16][P], P = 1 (fp32) or 2 (bf16): 16-column panels,
// each 64-byte load 16 columns at P depths. The tile broadcasts one activation value per row and
// depth against whole panels, so each weight load feeds RB rows x CP panels of accumulators and
// nothing is summed across lanes at the end: the outer-product form torch's and llama.cpp's GEMMs
// repack their weights for. The row-major tile above re-reads its activation rows for every 16 / RB
// columns; this one for every 16 x CP. Without AVX512-BF16 a 2048 x 2048 bf16 linear at 1-64 rows ran
// 1.03-1.51x the pair tile. The engine packs its experts
// where this tile is compiled for AVX-512 (kernels.packed_weights_pay); the layout is in
// kernels.pack_weight.
#if defined(__AVX512F__)
// Each panel's stream is prefetched 16 lines ahead: a panel is contiguous across 4 KB pages, where
// the hardware prefetcher stops, so without it a core's loads stall at every page while its FMAs
// wait (the experts op at OLMoE-1B-7B's shapes, alternating builds: 1.05-1.17x at 1-64 tokens; 32
// lines into L2 instead was no better). A second prefetch 64 lines (4 KB) ahead into L2 on top ran
// fp32 experts 1.05-1.10x faster at 8-16 rows an expert and bf16 ones 1.0-1.06x with AVX512-BF16 (192
// lines ahead was slower in bf16): the loads of the next page are under way while the FMAs work on
// this one. MT_PREFETCH_NEAR / MT_PREFETCH_FAR set them for A/B builds.
#ifndef MT_PREFETCH_NEAR
#define MT_PREFETCH_NEAR 16
#endif
#ifndef MT_PREFETCH_FAR
#define MT_PREFETCH_FAR 64
#endif
constexpr int kPrefetchLines = MT_PREFETCH_NEAR, kPrefetchFarLines = MT_PREFETCH_FAR;

// prefetch line `d` of the CP panels' streams into L1 (T0) and line d + kPrefetchFarLines into L2 (T1)
template <int CP, typename W>
inline void prefetch_panels(const W* w, int64_t panel_stride, int64_t line_elems, int64_t near_line) {
  for (int p = 0; p < CP; ++p) {
    const W* stream = w + p * panel_stride;
    _mm_prefetch(reinterpret_cast<const char*>(stream + near_line * line_elems), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(stream + (near_line + kPrefetchFarLines - kPrefetchLines) * line_elems), _MM_HINT_T1);
  }
}
template <int RB, int CP, typename W, typename A>
inline void panel_tile(const A* const* a, const W* w, int64_t panel_stride, int depth, float* out, int ldo) {
  __m512 acc[RB][CP];
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < CP; ++p) acc[r][p] = _mm512_setzero_ps();
  if constexpr (std::is_same_v<A, uint32_t>) {
#if defined(__AVX512BF16__)
    // bf16 weights against bf16 activations (kDotBf16): a[r][i] holds row r's depths 2i and 2i + 1 as
    // a bf16 pair, the layout of a packed weight's 32-bit lane, so one vdpbf16ps adds both depths'
    // products for 16 columns: half the multiply-adds of the widened form and no widening.
    for (int d = 0; d < depth; d += 2) {
      __m512i wv[CP];
      prefetch_panels<CP>(w, panel_stride, 32, d / 2 + kPrefetchLines);   // a line: 16 columns x 2 depths
      for (int p = 0; p < CP; ++p) wv[p] = _mm512_loadu_si512(w + p * panel_stride + (int64_t)d * 16);
      for (int r = 0; r < RB; ++r) {
        const __m512bh b = (__m512bh)_mm512_set1_epi32((int)a[r][d / 2]);
        for (int p = 0; p < CP; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], b, (__m512bh)wv[p]);
      }
    }
#endif
  } else if constexpr (std::is_same_v<W, float>) {
    for (int d = 0; d < depth; ++d) {
      __m512 wv[CP];
      prefetch_panels<CP>(w, panel_stride, 16, d + kPrefetchLines);       // a line: 16 columns x 1 depth
      for (int p = 0; p < CP; ++p) wv[p] = _mm512_loadu_ps(w + p * panel_stride + (int64_t)d * 16);
      for (int r = 0; r < RB; ++r) {
        const __m512 b = _mm512_set1_ps(a[r][d]);
        for (int p = 0; p < CP; ++p) acc[r][p] = _mm512_fmadd_ps(b, wv[p], acc[r][p]);
      }
    }
  } else {   // a 32-bit lane holds one column's two depths: << 16 is depth d, & 0xffff0000 depth d + 1
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int d = 0; d < depth; d += 2) {
      __m512 even[CP], odd[CP];
      prefetch_panels<CP>(w, panel_stride, 32, d / 2 + kPrefetchLines);   // a line: 16 columns x 2 depths
      for (int p = 0; p < CP; ++p) {
        const __m512i both = _mm512_loadu_si512(w + p * panel_stride + (int64_t)d * 16);
        even[p] = _mm512_castsi512_ps(_mm512_slli_epi32(both, 16));
        odd[p] = _mm512_castsi512_ps(_mm512_and_si512(both, high));
      }
      for (int r = 0; r < RB; ++r) {
        const __m512 b0 = _mm512_set1_ps(a[r][d]), b1 = _mm512_set1_ps(a[r][d + 1]);
        for (int p = 0; p < CP; ++p) acc[r][p] = _mm512_fmadd_ps(b1, odd[p], _mm512_fmadd_ps(b0, even[p], acc[r][p]));
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < CP; ++p) _mm512_storeu_ps(out + (int64_t)r * ldo + p * 16, acc[r][p]);
}
#else
// Without AVX-512 the engine does not pack (kernels.packed_weights_pay); this plain loop keeps a
// packed tensor computable, and the same on every processor, for tests and tools.
template <int RB, int CP, typename W, typename A>
inline void panel_tile(const A* const* a, const W* w, int64_t panel_stride, int depth, float* out, int ldo) {
  constexpr int P = std::is_same_v<W, float> ? 1 : 2;
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < CP; ++p)
      for (int c = 0; c < 16; ++c) {
        float sum = 0.f;
        for (int d = 0; d < depth; ++d) sum += a[r][d] * (float)w[p * panel_stride + (int64_t)(d / P) * 16 * P + c * P + d % P];
        out[(int64_t)r * ldo + p * 16 + c] = sum;
      }
}
#endif

// RB rows against panels [p0, p1): CP panels a tile, the rest one at a time.
template <int RB, int CP, typename W, typename A>
inline void panel_rows(const A* const* a, const W* w, int p0, int p1, int64_t panel_stride, int depth, float* out, int ldo) {
  int p = p0;
  for (; p + CP <= p1; p += CP) panel_tile<RB, CP>(a, w + p * panel_stride, panel_stride, depth, out + p * 16, ldo);
  for (; p < p1; ++p) panel_tile<RB, 1>(a, w + p * panel_stride, panel_stride, depth, out + p * 16, ldo);
}

// out[r][j] = dot(a[r], column j of the packed weight) for r < rows, j < cols (a multiple of 16).
// Rows go by blocks of up to 8 (24 accumulators at 8 rows x 3 panels); columns by groups of 12
// panels, so a group's weights stay in L2 while every row block uses them, or of 6 where 12 would not
// fit in 768 KB (fp32 at depth 2048: 128 KB a panel), with 3 panels a tile for every block. With a
// 1.25 MB L2 (alternating builds) the 6-panel groups ran fp32 experts at 64 tokens 1.05-1.08x faster,
// and bf16 ones (12 panels fit) 1.0-1.2x slower.
template <typename W, typename A>
void packed_blocks(const A* const* a, int rows, const W* w, int cols, int depth, float* out, int ldo) {
  const int64_t stride = (int64_t)depth * 16;
  const int panels = cols / 16;
  const bool narrow = 12 * stride * (int64_t)sizeof(W) > 786432;
  const int group = narrow ? 6 : 12;
  for (int g0 = 0; g0 < panels; g0 += group) {
    const int g1 = std::min(g0 + group, panels);
    for (int r0 = 0; r0 < rows; r0 += 8) {
      const A* const* ar = a + r0;
      float* o = out + (int64_t)r0 * ldo;
      switch (std::min(rows - r0, 8)) {
        case 8: panel_rows<8, 3>(ar, w, g0, g1, stride, depth, o, ldo); break;
        case 7: panel_rows<7, 3>(ar, w, g0, g1, stride, depth, o, ldo); break;
        case 6: panel_rows<6, 3>(ar, w, g0, g1, stride, depth, o, ldo); break;
        case 5: narrow ? panel_rows<5, 3>(ar, w, g0, g1, stride, depth, o, ldo) : panel_rows<5, 4>(ar, w, g0, g1, stride, depth, o, ldo); break;
        case 4: narrow ? panel_rows<4, 3>(ar, w, g0, g1, stride, depth, o, ldo) : panel_rows<4, 4>(ar, w, g0, g1, stride, depth, o, ldo); break;
        case 3: narrow ? panel_rows<3, 3>(ar, w, g0, g1, stride, depth, o, ldo) : panel_rows<3, 4>(ar, w, g0, g1, stride, depth, o, ldo); break;
        case 2: panel_rows<2, 6>(ar, w, g0, g1, stride, depth, o, ldo); break;
        default: panel_rows<1, 6>(ar, w, g0, g1, stride, depth, o, ldo); break;
      }
    }
  }
}

// Whether bf16 weights meet bf16 activations in the processor's bf16 dot product (AVX512-BF16:
// vdpbf16ps): each row is rounded to bf16 once (to nearest even) before its products, as llama.cpp's
// bf16 matmul and oneDNN's bf16 GEMM do. A bf16 model's activations are bf16 already, so for it only
// the SwiGLU output (fp32 inside the kernel, bf16 in transformers' bf16 experts) is rounded; fp32 rows
// against bf16 experts (`decode_expert_dtype`) lose their low mantissa bits. MT_NO_DPBF16 builds the
// widened fp32 form instead (for A/B runs). kernels.experts_round_to_bf16() says which one runs.
#if defined(__AVX512BF16__) && !defined(MT_NO_DPBF16)
constexpr bool kDotBf16 = true;
#else
constexpr bool kDotBf16 = false;
#endif

template <typename W>
void rows_times_packed(const float* const* a, int rows, const W* w, int cols, int depth, float* out, int ldo) {
#if defined(__AVX512BF16__)
  if constexpr (kDotBf16 && std::is_same_v<W, at::BFloat16>) {
    thread_local std::vector<uint32_t> pairs;                 // [rows][depth / 2] bf16 pairs
    thread_local std::vector<const uint32_t*> rows_of_pairs;
    const int half = depth / 2;
    pairs.resize((size_t)rows * half);
    rows_of_pairs.resize(rows);
    for (int r = 0; r < rows; ++r) {
      uint32_t* dst = pairs.data() + (size_t)r * half;
      for (int d = 0; d < depth; d += 16)                     // 16 fp32 -> 16 bf16, round to nearest even
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d / 2), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(a[r] + d)));
      rows_of_pairs[r] = dst;
    }
    packed_blocks(rows_of_pairs.data(), rows, w, cols, depth, out, ldo);
    return;
  }
#endif
  packed_blocks(a, rows, w, cols, depth, out, ldo);
}

// Scratch rows on 64-byte boundaries: a 64-byte load across two cache lines costs two (glibc's
// malloc aligns to 16).
template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const Aligned64<U>&) const { return true; }
};
using Floats = std::vector<float, Aligned64<float>>;

// Routes whose expert outputs feed calibration statistics (swiglu_experts_observed): index [T, K]
// (outside [0, E): not observed) with their gate weights [T, K], and the layer's sums [E, H + 4]
// float64 they are added to: per expert sum y, sum ||y||^2, max |y_i|, sum ||y||, sum g ||y||.
struct Observe {
  const int64_t* index;
  const float* gate;
  int64_t k;
  double* sums;
};
constexpr int kOutSq = 0, kOutMax = 1, kEan = 2, kWeightedEan = 3;   // columns after the H of out_sum

// One observed expert output y [hidden] (a multiple of 16) of expert e, gate g: its squared norm,
// peak, norm and gated norm added to the layer's sums (row e: only the thread that runs expert e
// writes it), y itself to `ysum`, the expert's fp32 partial sum that `flush_observed` adds to the
// row's sum y every kFlushRows rows and at the expert's end (one float64 pass per 16 rows instead of
// one per row: a decode step at 32 tokens x 8 routes of 256 values spent more in the float64 sums
// than in the rest of the side output). The squares and the peak go 16 lanes at a time (a scalar
// double reduction is one dependent add per value); the fp32 lanes are summed in double.
constexpr int64_t kFlushRows = 16;
inline void add_observed(double* row, float* ysum, int64_t hidden, const float* y, float g) {
  v16 sq16 = {}, peak16 = {};
  for (int64_t c = 0; c < hidden; c += 16) {
    const v16 v = load16(y + c);
    const v16 a = v < 0.f ? -v : v;
    store16(ysum + c, load16(ysum + c) + v);
    sq16 += v * v;
    peak16 = a > peak16 ? a : peak16;
  }
  double sq = 0.0, peak = row[hidden + kOutMax];
  for (int lane = 0; lane < 16; ++lane) {
    sq += (double)sq16[lane];
    peak = std::max(peak, (double)peak16[lane]);
  }
  const float norm = (float)std::sqrt(sq);
  row[hidden + kOutSq] += sq;
  row[hidden + kOutMax] = peak;
  row[hidden + kEan] += norm;
  row[hidden + kWeightedEan] += g * norm;
}

inline void flush_observed(double* row, float* ysum, int64_t hidden) {
  for (int64_t c = 0; c < hidden; ++c) row[c] += (double)ysum[c];
  std::fill(ysum, ysum + hidden, 0.f);
}

// The weights row-major ([E, 2I, H] / [E, H, I]) or packed (rows_times_packed's panels, `packed`).
// `obs` (or null): routes to observe; each runs its expert once, with a served route of the same
// token and expert where there is one, else as an extra row that adds to no output.
template <typename W>
void run_experts(const float* x, const W* gate_up, const W* down, bool packed, const int64_t* index,
                 const float* weight, int64_t tokens, int64_t k, int64_t num_experts, int64_t hidden,
                 int64_t inter, float* routed, float* out, int64_t* distinct, const Observe* obs = nullptr) {
  // a row id below `routes` is a served route slot; routes + o is observed route o with no served twin
  const int64_t routes = tokens * k;
  std::vector<int64_t> count(num_experts + 1, 0);
  for (int64_t s = 0; s < routes; ++s) {
    int64_t e = index[s];
    if (e >= 0 && e < num_experts) ++count[e + 1];
  }
  std::vector<int64_t> observed_of;                          // served slot -> observed route (-1: none)
  std::vector<int64_t> extra;                                 // observed routes without a served twin
  if (obs != nullptr) {
    observed_of.assign(routes, -1);
    for (int64_t o = 0; o < tokens * obs->k; ++o) {
      const int64_t e = obs->index[o], t = o / obs->k;
      if (e < 0 || e >= num_experts) continue;
      int64_t twin = -1;
      for (int64_t j = 0; j < k && twin < 0; ++j)
        if (index[t * k + j] == e) twin = t * k + j;
      if (twin >= 0) {
        observed_of[twin] = o;
      } else {
        extra.push_back(o);
        ++count[e + 1];
      }
    }
  }
  std::vector<int64_t> active;                               // experts with rows, in order
  for (int64_t e = 0; e < num_experts; ++e) {
    if (count[e + 1]) active.push_back(e);
    count[e + 1] += count[e];                                 // prefix sums: expert e's rows start at count[e]
  }
  std::vector<int64_t> order(count[num_experts]);             // row ids sorted by expert
  std::vector<int64_t> fill(count.begin(), count.end() - 1);
  for (int64_t s = 0; s < routes; ++s) {
    int64_t e = index[s];
    if (e >= 0 && e < num_experts) order[fill[e]++] = s;
  }
  for (int64_t o : extra) order[fill[obs->index[o]]++] = routes + o;
  *distinct = (int64_t)active.size();
  auto token_of = [&](int64_t id) { return id < routes ? id / k : (id - routes) / obs->k; };

  const auto times_weight = packed ? rows_times_packed<W> : rows_times_weight<W>;
  Floats x_pairs;                                             // x in the order the gate_up tile reads
  if (!packed && pair_order<W>(hidden)) {
    x_pairs.resize(tokens * hidden);
    to_pair_order(x, x_pairs.data(), tokens * hidden);
    x = x_pairs.data();
  }
  // threads claim experts one at a time, the most rows first, so uneven rows per expert still balance
  std::stable_sort(active.begin(), active.end(),
                   [&](int64_t a, int64_t b) { return count[a + 1] - count[a] > count[b + 1] - count[b]; });
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), (int64_t)active.size());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Floats h, act, y, ysum(obs == nullptr ? 0 : hidden, 0.f);
    std::vector<const float*> rows;
    for (int64_t i = next++; i < (int64_t)active.size(); i = next++) {
      const int64_t e = active[i], first = count[e], n = count[e + 1] - first;
      h.resize(n * 2 * inter);
      act.resize(n * inter);
      y.resize(n * hidden);
      rows.resize(n);
      for (int64_t r = 0; r < n; ++r) rows[r] = x + token_of(order[first + r]) * hidden;
      times_weight(rows.data(), n, gate_up + e * 2 * inter * hidden, 2 * inter, hidden, h.data(), 2 * inter);
      for (int64_t r = 0; r < n; ++r) {                       // SwiGLU: silu(gate) * up
        const float* g = h.data() + r * 2 * inter;
        for (int64_t c = 0; c < inter; c += 16) {
          const v16 gate = load16(g + c);
          store16(act.data() + r * inter + c, gate / (1.f + exp16(-gate)) * load16(g + inter + c));
        }
      }
      if (!packed && pair_order<W>(inter)) to_pair_order(act.data(), act.data(), n * inter);
      for (int64_t r = 0; r < n; ++r) rows[r] = act.data() + r * inter;
      times_weight(rows.data(), n, down + e * hidden * inter, hidden, inter, y.data(), hidden);
      // each route's expert output goes to its own row of `routed`, so threads never write the same row
      int64_t pending = 0;                                      // observed rows in ysum
      for (int64_t r = 0; r < n; ++r) {
        const int64_t s = order[first + r];
        const float* yr = y.data() + r * hidden;
        if (s < routes) {
          const float w = weight[s];
          float* dst = routed + s * hidden;
          for (int64_t c = 0; c < hidden; ++c) dst[c] = w * yr[c];
        }
        const int64_t o = obs == nullptr ? -1 : s < routes ? observed_of[s] : s - routes;
        if (o < 0) continue;
        add_observed(obs->sums + e * (hidden + 4), ysum.data(), hidden, yr, obs->gate[o]);
        if (++pending == kFlushRows) {
          flush_observed(obs->sums + e * (hidden + 4), ysum.data(), hidden);
          pending = 0;
        }
      }
      if (pending) flush_observed(obs->sums + e * (hidden + 4), ysum.data(), hidden);
    }
  });
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {   // out[t] = sum of its live routes
    for (int64_t t = begin; t < end; ++t) {
      float* o = out + t * hidden;
      std::fill(o, o + hidden, 0.f);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = index[t * k + j];
        if (e < 0 || e >= num_experts) continue;
        const float* src = routed + (t * k + j) * hidden;
        for (int64_t c = 0; c < hidden; ++c) o[c] += src[c];
      }
    }
  });
}

}  // namespace

namespace {

// (experts, cols, depth) of an expert weight: row-major [E, cols, depth], or packed
// [E, cols/16, depth/P, 16, P] (P = 1 fp32, 2 bf16; kernels.pack_weight)
std::tuple<int64_t, int64_t, int64_t> expert_dims(const torch::Tensor& w) {
  if (w.dim() == 3) return {w.size(0), w.size(1), w.size(2)};
  const int64_t P = w.scalar_type() == torch::kBFloat16 ? 2 : 1;
  TORCH_CHECK(w.dim() == 5 && w.size(3) == 16 && w.size(4) == P,
              "expert weights: [E, cols, depth], or packed [E, cols/16, depth/P, 16, P] (kernels.pack_weight)");
  return {w.size(0), w.size(1) * 16, w.size(2) * P};
}

}  // namespace

bool experts_round_to_bf16() { return kDotBf16; }

namespace {

// out [T, H] of the routed experts (swiglu_experts' contract), and the number of distinct experts read
std::tuple<torch::Tensor, int64_t> experts_call(const torch::Tensor& x, const torch::Tensor& gate_up,
                                                const torch::Tensor& down, const torch::Tensor& index,
                                                const torch::Tensor& weight, const Observe* obs) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous fp32 [T, H]");
  TORCH_CHECK(gate_up.dim() == down.dim() && gate_up.is_contiguous() && down.is_contiguous(),
              "gate_up [E, 2I, H] and down [E, H, I] must be contiguous, both row-major or both packed");
  TORCH_CHECK(gate_up.scalar_type() == down.scalar_type(), "gate_up and down must share a dtype");
  TORCH_CHECK(index.scalar_type() == torch::kInt64 && index.is_contiguous(), "index: contiguous int64 [T, K]");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous(), "weight: contiguous fp32 [T, K]");
  const int64_t tokens = x.size(0), hidden = x.size(1), k = index.size(1);
  const auto [num_experts, two_inter, gate_up_depth] = expert_dims(gate_up);
  const auto [down_experts, down_cols, inter] = expert_dims(down);
  TORCH_CHECK(two_inter == 2 * inter && gate_up_depth == hidden && down_cols == hidden && down_experts == num_experts,
              "expert shapes do not match x");
  TORCH_CHECK(hidden % 16 == 0 && inter % 16 == 0, "hidden and expert sizes must be multiples of 16");
  const bool packed = gate_up.dim() == 5;
  auto out = torch::empty_like(x);
  auto routed = torch::empty({tokens * k, hidden}, x.options());
  int64_t distinct = 0;
  if (gate_up.scalar_type() == torch::kFloat32) {
    run_experts(x.data_ptr<float>(), gate_up.data_ptr<float>(), down.data_ptr<float>(), packed, index.data_ptr<int64_t>(),
                weight.data_ptr<float>(), tokens, k, num_experts, hidden, inter, routed.data_ptr<float>(),
                out.data_ptr<float>(), &distinct, obs);
  } else {
    TORCH_CHECK(gate_up.scalar_type() == torch::kBFloat16, "expert weights must be fp32 or bf16");
    run_experts(x.data_ptr<float>(), gate_up.data_ptr<at::BFloat16>(), down.data_ptr<at::BFloat16>(), packed,
                index.data_ptr<int64_t>(), weight.data_ptr<float>(), tokens, k, num_experts, hidden, inter,
                routed.data_ptr<float>(), out.data_ptr<float>(), &distinct, obs);
  }
  return {out, distinct};
}

}  // namespace

// x [T, H] fp32, gate_up [E, 2I, H], down [E, H, I] (fp32 or bf16; both row-major or both packed),
// index [T, K] int64, weight [T, K] fp32 -> out [T, H] fp32; the number of distinct experts read goes
// to experts_read[layer] (int64 [L], the step's output; skipped when layer is outside it)
torch::Tensor swiglu_experts(const torch::Tensor& x, const torch::Tensor& gate_up, const torch::Tensor& down,
                             const torch::Tensor& index, const torch::Tensor& weight, torch::Tensor& experts_read,
                             int64_t layer) {
  TORCH_CHECK(experts_read.scalar_type() == torch::kInt64 && experts_read.dim() == 1, "experts_read: int64 [L]");
  auto [out, distinct] = experts_call(x, gate_up, down, index, weight, nullptr);
  if (layer >= 0 && layer < experts_read.size(0)) experts_read[layer].fill_(distinct);
  return out;
}

// swiglu_experts, and the expert outputs of the routes `observe` [T, Ko] int64 (outside [0, E): none)
// added to a layer's calibration sums [E, H + 4] float64 (columns: sum y [H], sum ||y||^2, max |y_i|,
// sum ||y||, sum gate * ||y||; gate [T, Ko] fp32). Why: EAN and REAP need each routed expert's output
// before its weight, which the experts compute anyway; an observed route the step serves costs no
// extra expert work, one it does not serve (a plan or budget dropped it) one extra row.
torch::Tensor swiglu_experts_observed(const torch::Tensor& x, const torch::Tensor& gate_up, const torch::Tensor& down,
                                      const torch::Tensor& index, const torch::Tensor& weight,
                                      const torch::Tensor& observe, const torch::Tensor& gate, torch::Tensor& sums) {
  const int64_t tokens = x.size(0), hidden = x.size(1);
  TORCH_CHECK(observe.dim() == 2 && observe.size(0) == tokens && observe.scalar_type() == torch::kInt64 &&
                  observe.is_contiguous(), "observe: contiguous int64 [T, Ko]");
  TORCH_CHECK(gate.sizes() == observe.sizes() && gate.scalar_type() == torch::kFloat32 && gate.is_contiguous(),
              "gate: contiguous fp32 [T, Ko]");
  TORCH_CHECK(sums.dim() == 2 && sums.size(0) == std::get<0>(expert_dims(gate_up)) && sums.size(1) == hidden + 4 &&
                  sums.scalar_type() == torch::kFloat64 && sums.is_contiguous(), "sums: contiguous float64 [E, H + 4]");
  const Observe obs{observe.data_ptr<int64_t>(), gate.data_ptr<float>(), observe.size(1), sums.data_ptr<double>()};
  return std::get<0>(experts_call(x, gate_up, down, index, weight, &obs));
}

// x [T, H] fp32 (T small: a decode step's rows; any T on packed weights), weight [N, H] fp32 or bf16
// or packed [N/16, H/P, 16, P], bias [N] fp32 or none -> x @ weight^T + bias [T, N] fp32; bf16 x (and
// bias) -> bf16 out, the fp32 result rounded once.
// Why: at batch 1 the LM head ([1, H] x [H, V]) is the largest single read of a decode step, and the
// library GEMM pays for packing at one row; here threads take column ranges and stream each weight
// row once through the same register-blocked dot products the experts use.
torch::Tensor rows_linear(const torch::Tensor& x, const torch::Tensor& weight, const c10::optional<torch::Tensor>& bias) {
  if (x.scalar_type() == torch::kBFloat16) {   // a bf16 layer's rows: the fp32 sums (+ bias) rounded to bf16 once
    c10::optional<torch::Tensor> b32;
    if (bias.has_value()) b32 = bias->to(torch::kFloat32);
    return rows_linear(x.to(torch::kFloat32), weight, b32).to(torch::kBFloat16);
  }
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous fp32 or bf16 [T, H]");
  const bool packed = weight.dim() == 4;     // [N/16, H/P, 16, P] (kernels.pack_weight)
  const int64_t lanes = weight.scalar_type() == torch::kBFloat16 ? 2 : 1;
  TORCH_CHECK(weight.is_contiguous() && (packed ? weight.size(2) == 16 && weight.size(3) == lanes && weight.size(1) * lanes == x.size(1)
                                                : weight.dim() == 2 && weight.size(1) == x.size(1)),
              "weight: contiguous [N, H] with x's H, or packed [N/16, H/P, 16, P] (kernels.pack_weight)");
  const int64_t rows = x.size(0), depth = x.size(1), cols = packed ? weight.size(0) * 16 : weight.size(0);
  TORCH_CHECK(depth % 16 == 0, "the hidden size must be a multiple of 16");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == cols && bias->scalar_type() == torch::kFloat32 &&
                    bias->is_contiguous(), "bias: contiguous fp32 [N]");
    b = bias->data_ptr<float>();
  }
  auto out = torch::empty({rows, cols}, x.options());
  const float* xs = x.data_ptr<float>();
  Floats x_pairs;                                             // x in the order a bf16 weight's pair tile reads
  if (!packed && weight.scalar_type() == torch::kBFloat16 && pair_order<at::BFloat16>(depth)) {
    x_pairs.resize(rows * depth);
    to_pair_order(xs, x_pairs.data(), rows * depth);
    xs = x_pairs.data();
  }
  std::vector<const float*> a(rows);
  for (int64_t r = 0; r < rows; ++r) a[r] = xs + r * depth;
  float* o = out.data_ptr<float>();
  // threads take ranges of 16-column tiles (packed: panels); either way columns j0.. start at w + j0 * depth
  at::parallel_for(0, (cols + 15) / 16, 8, [&](int64_t begin, int64_t end) {
    const int j0 = (int)(begin * 16), j1 = (int)std::min<int64_t>(end * 16, cols);
    if (weight.scalar_type() == torch::kFloat32) {
      const float* w = weight.data_ptr<float>() + (int64_t)j0 * depth;
      (packed ? rows_times_packed<float> : rows_times_weight<float>)(a.data(), (int)rows, w, j1 - j0, (int)depth, o + j0, (int)cols);
    } else {
      const at::BFloat16* w = weight.data_ptr<at::BFloat16>() + (int64_t)j0 * depth;
      (packed ? rows_times_packed<at::BFloat16> : rows_times_weight<at::BFloat16>)(a.data(), (int)rows, w, j1 - j0, (int)depth,
                                                                                   o + j0, (int)cols);
    }
    if (b != nullptr)   // the bias after the sum, as torch's linear adds it: one rounding each
      for (int64_t r = 0; r < rows; ++r)
        for (int j = j0; j < j1; ++j) o[r * cols + j] += b[j];
  });
  return out;
}

namespace {

// softmax -> top-k (sorted, the lower expert first on a tie) -> optional renormalisation, per row of
// logits [rows, E]; experts outside `allowed` (a [E] bool mask, or none) get probability 0, as
// torch's masked_fill(-inf) then softmax gives them.
void softmax_topk_rows(const float* logits, int64_t rows, int64_t experts, int64_t k, bool normalise,
                       const bool* allowed, float* weights, int64_t* index) {
  std::vector<float> probs(experts);
  std::vector<int64_t> order(experts);
  for (int64_t r = 0; r < rows; ++r) {
    const float* l = logits + r * experts;
    float top = -INFINITY, total = 0.f;
    for (int64_t e = 0; e < experts; ++e)
      if (allowed == nullptr || allowed[e]) top = std::max(top, l[e]);
    for (int64_t e = 0; e < experts; ++e)
      total += (probs[e] = allowed == nullptr || allowed[e] ? std::exp(l[e] - top) : 0.f);
    for (int64_t e = 0; e < experts; ++e) probs[e] /= total;
    for (int64_t e = 0; e < experts; ++e) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t i, int64_t j) {
      return probs[i] > probs[j] || (probs[i] == probs[j] && i < j);
    });
    float* w = weights + r * k;
    int64_t* ix = index + r * k;
    float kept = 0.f;
    for (int64_t j = 0; j < k; ++j) kept += (w[j] = probs[ix[j] = order[j]]);
    if (normalise)
      for (int64_t j = 0; j < k; ++j) w[j] /= kept;
  }
}

}  // namespace

// A softmax router's routes from its logits [T, E] fp32 in one call, optionally over the `allowed`
// experts [E] bool only (a masked pool) -> (weights [T, k] fp32, index [T, k] int64). Why: through
// torch that is four to six ops per layer (mask, softmax, topk, sum, div), each costing more than
// its arithmetic in a decode step.
std::tuple<torch::Tensor, torch::Tensor> softmax_topk(const torch::Tensor& logits, int64_t k, bool normalise,
                                                      const c10::optional<torch::Tensor>& allowed) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous(),
              "logits: contiguous fp32 [T, E]");
  const int64_t rows = logits.size(0), experts = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= experts, "k must be in [1, number of experts]");
  const bool* mask = nullptr;
  if (allowed.has_value()) {
    TORCH_CHECK(allowed->dim() == 1 && allowed->size(0) == experts && allowed->scalar_type() == torch::kBool &&
                    allowed->is_contiguous(), "allowed: contiguous bool [E]");
    mask = allowed->data_ptr<bool>();
  }
  auto weights = torch::empty({rows, k}, logits.options());
  auto index = torch::empty({rows, k}, logits.options().dtype(torch::kInt64));
  softmax_topk_rows(logits.data_ptr<float>(), rows, experts, k, normalise, mask, weights.data_ptr<float>(),
                    index.data_ptr<int64_t>());
  return {weights, index};
}
