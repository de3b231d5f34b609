// The float vector of the path the kernels are built for: 16 lanes with AVX-512, 8 with
// AVX2 + FMA + F16C, none otherwise (the kernels then take their plain loops). Kernels that
// are written once over `fvec` run on both vector paths; `cpu_isa.compile_flags` chooses the
// path at build time, so an AVX2 build holds no AVX-512 instruction.
#pragma once

#include "vec16.h"

#if defined(RADIXSERVE_AVX512) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define RADIXSERVE_SIMD 1
#include <immintrin.h>

#include <cstdint>

namespace radixserve::simd {

#if defined(RADIXSERVE_AVX512)
using fvec = __m512;
constexpr int kLanes = 16;

inline fvec zero() { return _mm512_setzero_ps(); }
inline fvec set1(float v) { return _mm512_set1_ps(v); }
inline fvec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, fvec v) { _mm512_storeu_ps(p, v); }
inline fvec fmadd(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
inline fvec add(fvec a, fvec b) { return _mm512_add_ps(a, b); }
inline fvec mul(fvec a, fvec b) { return _mm512_mul_ps(a, b); }
inline fvec sub(fvec a, fvec b) { return _mm512_sub_ps(a, b); }
inline fvec max(fvec a, fvec b) { return _mm512_max_ps(a, b); }
inline float sum(fvec v) { return _mm512_reduce_add_ps(v); }
inline float max_lane(fvec v) { return _mm512_reduce_max_ps(v); }
inline fvec exp_nonpositive(fvec x) { return exp16_nonpositive(x); }

// Sixteen bytes widened to floats: unsigned (`u8`) or two's complement (`i8`).
inline void widen_u8(__m128i bytes, fvec* out) {
  out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
}
inline void widen_i8(__m128i bytes, fvec* out) {
  out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}
#else
using fvec = __m256;
constexpr int kLanes = 8;

inline fvec zero() { return _mm256_setzero_ps(); }
inline fvec set1(float v) { return _mm256_set1_ps(v); }
inline fvec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, fvec v) { _mm256_storeu_ps(p, v); }
inline fvec fmadd(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
inline fvec add(fvec a, fvec b) { return _mm256_add_ps(a, b); }
inline fvec mul(fvec a, fvec b) { return _mm256_mul_ps(a, b); }
inline fvec sub(fvec a, fvec b) { return _mm256_sub_ps(a, b); }
inline fvec max(fvec a, fvec b) { return _mm256_max_ps(a, b); }
inline float sum(fvec v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
}
inline float max_lane(fvec v) {
  const __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_max_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_max_ss(pairs, _mm_movehdup_ps(pairs)));
}

// exp(x) for x <= 0 as vec16.h's exp16_nonpositive computes it, eight lanes at a time.
inline fvec exp_nonpositive(fvec x) {
  const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)),
                                 _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.69314718055994531f));
  __m256 p = _mm256_set1_ps(1.98412698e-4f);
  for (const float c : {1.38888889e-3f, 8.33333333e-3f, 4.16666667e-2f, 1.66666667e-1f, 0.5f,
                        1.0f, 1.0f}) {
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c));
  }
  const __m256i exponent =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

inline void widen_u8(__m128i bytes, fvec* out) {
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
}
inline void widen_i8(__m128i bytes, fvec* out) {
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
}
#endif

constexpr int kPer16 = 16 / kLanes;  // vectors per 16 widened bytes

// An IEEE half (a GGUF block's scale) as float, by F16C.
inline float half_to_float(uint16_t bits) { return _cvtsh_ss(bits); }

}  // namespace radixserve::simd
#endif
