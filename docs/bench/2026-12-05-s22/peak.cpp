// Peak vdpbf16ps and fp32 FMA rates of this processor, registers only (12 independent chains per thread).
//   g++ -O3 -funroll-loops -march=native -fopenmp docs/bench/2026-12-05-s22/peak.cpp -o /tmp/peak && OMP_NUM_THREADS=2 /tmp/peak
// (without -funroll-loops GCC keeps the 12 accumulators in memory and measures half the rate)
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <cstdio>
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main() {
  const long iters = 200000000;
  for (int round = 0; round < 3; ++round) {
    double t0 = now(); float sink = 0;
#pragma omp parallel reduction(+ : sink)
    {
      __m512 acc[12]; for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(0.f);
      __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3f80);
      for (long it = 0; it < iters / 12; ++it)
        for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
      for (int i = 0; i < 12; ++i) sink += _mm512_reduce_add_ps(acc[i]);
    }
    double dt = now() - t0, threads = omp_get_max_threads();
    printf("vdpbf16ps: %.0f GFLOP/s (%d threads; 64 FLOP an instruction)  [%g]\n", threads * (iters / 12 * 12) * 64.0 / dt / 1e9, (int)threads, sink);
    t0 = now(); sink = 0;
#pragma omp parallel reduction(+ : sink)
    {
      __m512 acc[12]; for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(0.f);
      __m512 a = _mm512_set1_ps(1e-9f), b = _mm512_set1_ps(1.f);
      for (long it = 0; it < iters / 12; ++it)
        for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(a, b, acc[i]);
      for (int i = 0; i < 12; ++i) sink += _mm512_reduce_add_ps(acc[i]);
    }
    dt = now() - t0;
    printf("fp32 vfmadd: %.0f GFLOP/s (32 FLOP an instruction)  [%g]\n", threads * (iters / 12 * 12) * 32.0 / dt / 1e9, sink);
  }
}
