// Sixteen floats at a time with AVX-512: loads and stores of float, bf16 and half rows
// (rounded to nearest even exactly as torch's conversions round), and exp for x <= 0.
// Shared by the kernels that compute in float over 16-bit activations.
#pragma once

// Every AVX-512 CPU but the Xeon Phi has these four; the kernels' AVX-512 paths need them.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define RADIXSERVE_AVX512 1
#endif

// Dispatch over float, bf16 and half (the dtypes load16/store16 take; never double).
#define RADIXSERVE_DISPATCH_FLOAT_16(TYPE, NAME, ...)                 \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)        \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

#if defined(RADIXSERVE_AVX512)
#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace radixserve {

// The first `count` of 16 lanes (all of them from 16 up, none from 0 down).
inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? __mmask16(0xFFFF)
                     : static_cast<__mmask16>((1u << std::max<int64_t>(count, 0)) - 1);
}

template <typename scalar_t>
inline __m512 load16(const scalar_t* p, __mmask16 mask = 0xFFFF) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return _mm512_maskz_loadu_ps(mask, p);
  } else {
    const __m256i bits = _mm256_maskz_loadu_epi16(mask, p);
    if constexpr (std::is_same_v<scalar_t, at::Half>) {
      return _mm512_cvtph_ps(bits);
    } else {  // bf16: the 16 bits are a float's high half
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    }
  }
}

// bf16 rounding as c10::BFloat16 does it: nearest even, any NaN to the quiet 0x7FC0. The
// AVX512-BF16 instruction rounds the same way but flushes denormals and keeps a NaN's sign
// and payload: it takes every vector without either (the fpclass test), the integer
// arithmetic the rest.
inline __m256i to_bf16(__m512 v) {
#if defined(__AVX512BF16__)
  constexpr int kNaNOrDenormal = 0x01 | 0x20 | 0x80;  // quiet NaN, denormal, signalling NaN
  if (_mm512_fpclass_ps_mask(v, kNaNOrDenormal) == 0) return (__m256i)_mm512_cvtneps_pbh(v);
#endif
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(
      _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)),
      _mm512_set1_epi32(0x7FFF));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                  _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}

template <typename scalar_t>
inline void store16(scalar_t* p, __m512 v, __mmask16 mask = 0xFFFF) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    _mm512_mask_storeu_ps(p, mask, v);
  } else if constexpr (std::is_same_v<scalar_t, at::Half>) {
    _mm256_mask_storeu_epi16(p, mask, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  } else {
    _mm256_mask_storeu_epi16(p, mask, to_bf16(v));
  }
}

// `v` rounded to scalar_t and widened back: where a torch op on scalar_t tensors rounds.
template <typename scalar_t>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return v;
  } else if constexpr (std::is_same_v<scalar_t, at::Half>) {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
  }
}

// exp(x) for x <= 0 (libm's is a call per element): x = n ln2 + f ln2 with n an integer and
// |f| <= 1/2, 2^f by its Taylor series to degree 7 (relative error below 1e-8, under float's
// rounding), 2^n by building the exponent bits. Below -87 (where exp leaves float's normal
// range) it returns exp(-87), about 1.6e-38: a weight no softmax sum can notice.
inline __m512 exp16_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)),
                                 _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));
  __m512 p = _mm512_set1_ps(1.98412698e-4f);  // 1/7!, then Horner down to 1/0!
  for (const float c : {1.38888889e-3f, 8.33333333e-3f, 4.16666667e-2f, 1.66666667e-1f, 0.5f,
                        1.0f, 1.0f}) {
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  }
  const __m512i exponent =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(exponent));
}

}  // namespace radixserve
#endif
