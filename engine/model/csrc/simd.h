// The float vector of the path the kernels are built for: 16 lanes with AVX-512, 8 with
// AVX2 + FMA + F16C, none otherwise (the kernels then take their plain loops). Kernels that
// are written once over `fvec` run on both vector paths; `cpu_isa.compile_flags` chooses the
// path at build time, so an AVX2 build holds no AVX-512 instruction. Rows of float, bf16 or
// half are read and written `count` elements at a time (`load_n`/`store_n`: the last,
// partial vector of a row too), rounded to their type where torch's ops round (`round_to`).
#pragma once

#include "vec16.h"

#if defined(RADIXSERVE_AVX512) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define RADIXSERVE_SIMD 1
#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace radixserve::simd {

#if defined(RADIXSERVE_AVX512)
using fvec = __m512;
constexpr int kLanes = 16;
constexpr int kRegisters = 32;

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
inline fvec min(fvec a, fvec b) { return _mm512_min_ps(a, b); }
// 1 / d by the reciprocal estimate and one Newton step: within two float units, several
// times faster than a division.
inline fvec reciprocal(fvec d) {
  const fvec estimate = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(estimate, _mm512_fnmadd_ps(d, estimate, _mm512_set1_ps(2.0f)));
}

// Lane i of the result is the sum of the lanes of v[i], for kLanes vectors: kLanes sums
// in 15 adds and 28 shuffles, where reducing each vector alone takes 4 shuffles and 4 adds.
inline fvec sum_lanes(const fvec* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit block: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit block: vectors 4i..4i+3, that block's share
    quads[i] = _mm512_add_ps(
        _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
        _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 low = _mm512_add_ps(  // blocks: quads[0] (b0+b2, b1+b3), quads[1] (same)
      _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(1, 0, 1, 0)),
      _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 high = _mm512_add_ps(
      _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(1, 0, 1, 0)),
      _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(3, 1, 3, 1)));
}

using fmask = __mmask16;
inline fmask less(fvec a, fvec b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
inline fvec select(fmask m, fvec if_true, fvec if_false) {
  return _mm512_mask_blend_ps(m, if_false, if_true);
}

// The first `count` elements of a float, bf16 or half row (all lanes from kLanes up; the
// others zero), never reading past them; stores and rounds to the row's type likewise.
template <typename scalar_t>
inline fvec load_n(const scalar_t* p, int64_t count) {
  return load16(p, first_lanes(count));
}
template <typename scalar_t>
inline void store_n(scalar_t* p, fvec v, int64_t count) {
  store16(p, v, first_lanes(count));
}
template <typename scalar_t>
inline fvec round_to(fvec v) {
  return round16<scalar_t>(v);
}

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
constexpr int kRegisters = 16;

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

inline fvec min(fvec a, fvec b) { return _mm256_min_ps(a, b); }
inline fvec reciprocal(fvec d) { return _mm256_div_ps(_mm256_set1_ps(1.0f), d); }

// Lane i of the result is the sum of the lanes of v[i], for kLanes vectors (7 horizontal
// adds, where reducing each vector alone takes 3 shuffles and 3 adds).
inline fvec sum_lanes(const fvec* v) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // h0: low half vectors 0-3 (their low 4 lanes), high half the same for their high lanes
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

using fmask = __m256;
inline fmask less(fvec a, fvec b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
inline fvec select(fmask m, fvec if_true, fvec if_false) {
  return _mm256_blendv_ps(if_false, if_true, m);
}

// bf16 rounding as c10::BFloat16 does it (vec16.h's to_bf16, eight lanes): nearest even,
// any NaN to the quiet 0x7FC0.
inline __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(
      _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1)),
      _mm256_set1_epi32(0x7FFF));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0),
                               _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
}

template <typename scalar_t>
inline fvec load_full(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (std::is_same_v<scalar_t, at::Half>) {
      return _mm256_cvtph_ps(bits);
    } else {  // bf16: the 16 bits are a float's high half
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
    }
  }
}

template <typename scalar_t>
inline void store_full(scalar_t* p, fvec v) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    _mm256_storeu_ps(p, v);
  } else if constexpr (std::is_same_v<scalar_t, at::Half>) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(v));
  }
}

// A partial vector goes through a zeroed copy of its lanes: AVX2 has no masked 16-bit loads.
template <typename scalar_t>
inline fvec load_n(const scalar_t* p, int64_t count) {
  if (count >= kLanes) return load_full(p);
  scalar_t lanes[kLanes] = {};
  std::memcpy(lanes, p, std::max<int64_t>(count, 0) * sizeof(scalar_t));
  return load_full(lanes);
}
template <typename scalar_t>
inline void store_n(scalar_t* p, fvec v, int64_t count) {
  if (count >= kLanes) return store_full(p, v);
  scalar_t lanes[kLanes];
  store_full(lanes, v);
  std::memcpy(p, lanes, std::max<int64_t>(count, 0) * sizeof(scalar_t));
}
template <typename scalar_t>
inline fvec round_to(fvec v) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return v;
  } else if constexpr (std::is_same_v<scalar_t, at::Half>) {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  } else {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16(v)), 16));
  }
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
