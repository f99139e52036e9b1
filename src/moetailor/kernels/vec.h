// 16-wide fp32 vectors (GCC/Clang vector extensions: one AVX-512 register, or two AVX2 ones) shared
// by the kernels.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

typedef float v16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline v16 load16(const c10::BFloat16* p) {   // bf16 -> fp32 is a 16-bit left shift
  typedef uint16_t h16 __attribute__((vector_size(32)));
  typedef uint32_t u16x __attribute__((vector_size(64)));
  h16 h;
  std::memcpy(&h, p, sizeof(h));
  const u16x w = __builtin_convertvector(h, u16x) << 16;
  v16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

// The 16 horizontal sums of a[0..15] as one vector (lane i = sum of a[i]'s lanes): a transpose-add
// tree, 15 shuffle pairs instead of 16 separate reductions.
inline v16 sum16(const v16* a) {
  v16 z[8], y[4], x[2];
  for (int i = 0; i < 8; ++i)
    z[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    y[i] = __builtin_shufflevector(z[2 * i], z[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(z[2 * i], z[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    x[i] = __builtin_shufflevector(y[2 * i], y[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(y[2 * i], y[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(x[0], x[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(x[0], x[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

typedef int32_t i16v __attribute__((vector_size(64)));

// exp(x) for 16 lanes: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes' expf polynomial (relative
// error ~1e-7), times 2^n built in the exponent bits. Inputs are clamped to [-87.3, 88.7].
inline v16 exp16(v16 x) {
  const v16 lo = v16{} - 87.3f, hi = v16{} + 88.7f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const i16v n = __builtin_convertvector(x * 1.44269504f + 128.5f, i16v) - 128;   // floor(x / ln2 + 1/2)
  const v16 nf = __builtin_convertvector(n, v16);
  const v16 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  v16 p = v16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const v16 e = p * r * r + r + 1.f;
  const i16v bits = (n + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return e * scale;
}

#if defined(__AVX2__) && defined(__FMA__)
// 8-wide ymm helpers for processors without AVX-512, where a v16 is not a register: GCC splits each
// v16 operation and keeps arrays of them in memory, so the kernels' hot loops use these instead.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {   // bf16 -> fp32 is a 16-bit left shift
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// lane i = the sum of a[i]'s 8 lanes: one horizontal-add tree for 8 accumulators
inline __m256 sum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif
