// The vector layer of the CPU kernels, and the one file (with `x86/`) that holds raw
// intrinsics. Two levels:
// - 16 float lanes with AVX-512 (`load16`, `store16`, `round16`, `first_lanes`): loads and
//   stores of float, bf16 and half rows, rounded to nearest even exactly as torch's
//   conversions round, for the kernels that are written for AVX-512 only;
// - `simd::fvec`, the float vector of the path the kernels are built for: 16 lanes with
//   AVX-512, 8 with AVX2 + FMA + F16C, none otherwise (the kernels then take their plain
//   loops). Kernels written once over `fvec` run on both vector paths; `isa.compile_flags`
//   chooses the path at build time, so an AVX2 build holds no AVX-512 instruction. Rows of
//   float, bf16 or half are read and written `count` elements at a time (`load_n`/`store_n`:
//   the last, partial vector of a row too), rounded to their type where torch's ops round
//   (`round_to`).
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

}  // namespace radixserve
#endif

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
// The nearest integer of each lane, and 2^n for integer lanes n (exponent bits built).
inline fvec round_nearest(fvec x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline fvec pow2(fvec n) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
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

inline fvec round_nearest(fvec x) {
  return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline fvec pow2(fvec n) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
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

// Bit j of `bits` as byte j of 32: 0x10 where it is set, 0 elsewhere (ggml's
// bytes_from_bits_32): a Q5 block's fifth bits, to be ORed into its nibbles.
inline __m256i fifth_bit_bytes(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(  // byte j: byte j / 8 of the bits
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202,
                         0x0303030303030303));
  const __m256i others = _mm256_set1_epi64x(0x7FBFDFEFF7FBFDFE);  // all but bit j % 8
  const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi8(-1));
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// A nibble block's 16 bytes as 32 floats: the low nibbles (weights 0-15), then the high ones,
// each ORed with its byte of `fifth` (a Q5 block's `fifth_bit_bytes`; zero for Q4 blocks,
// which the compiler then drops).
inline void widen_nibbles(const uint8_t* qs, fvec* w, __m256i fifth = _mm256_setzero_si256()) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i nibble = _mm_set1_epi8(0x0F);
  widen_u8(_mm_or_si128(_mm_and_si128(bytes, nibble), _mm256_castsi256_si128(fifth)), w);
  widen_u8(_mm_or_si128(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble),
                        _mm256_extracti128_si256(fifth, 1)),
           w + kPer16);
}

// 32 int8 as 32 floats.
inline void widen_int8(const uint8_t* qs, fvec* w) {
  widen_i8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), w);
  widen_i8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)), w + kPer16);
}

// exp(x) for x <= 0 (libm's is a call per element): x = n ln2 + f ln2 with n an integer and
// |f| <= 1/2, 2^f by its Taylor series to degree 7 (relative error below 1e-8, under float's
// rounding), 2^n by building the exponent bits. Below -87 (where exp leaves float's normal
// range) it returns exp(-87), about 1.6e-38: a weight no softmax sum can notice.
inline fvec exp_nonpositive(fvec x) {
  const fvec t = mul(max(x, set1(-87.0f)), set1(1.44269504088896341f));
  const fvec n = round_nearest(t);
  const fvec f = mul(sub(t, n), set1(0.69314718055994531f));
  fvec p = set1(1.98412698e-4f);  // 1/7!, then Horner down to 1/0!
  for (const float c : {1.38888889e-3f, 8.33333333e-3f, 4.16666667e-2f, 1.66666667e-1f, 0.5f,
                        1.0f, 1.0f}) {
    p = fmadd(p, f, set1(c));
  }
  return mul(p, pow2(n));
}

#if defined(RADIXSERVE_AVX512)
// Softmax steps over a row of `len` float scores, on whole vectors of it: `max_prefix` folds
// their largest into `top`, `exp_prefix` replaces each by exp(score - top) and adds it to
// `total`; each returns how many scores it took (a scalar loop takes the rest). Masked loads
// take every lane here: the last vector's lanes past `len` may lie on an unmapped page.
inline int64_t max_prefix(const float* score, int64_t len, float& top) {
  __m512 top16 = _mm512_set1_ps(top);
  int64_t j = 0;
  for (; j < len; j += 16) {
    const __mmask16 mask = first_lanes(len - j);
    top16 = _mm512_mask_max_ps(top16, mask, top16, _mm512_maskz_loadu_ps(mask, score + j));
  }
  top = _mm512_reduce_max_ps(top16);
  return len;
}
inline int64_t exp_prefix(float* score, int64_t len, float top, float& total) {
  const __m512 top16 = _mm512_set1_ps(top);
  __m512 total16 = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; j += 16) {
    const __mmask16 mask = first_lanes(len - j);
    const __m512 weight = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, score + j), top16));
    _mm512_mask_storeu_ps(score + j, mask, weight);
    total16 = _mm512_add_ps(total16, _mm512_maskz_mov_ps(mask, weight));
  }
  total = _mm512_reduce_add_ps(total16);
  return len;
}

#if defined(__AVX512BF16__)
// Scores of a bf16 query head against 16 bf16 keys (head_dim a multiple of 32), as stored:
// 32 products per instruction, no widening; the scaling applied to the 16 scores.
inline void score_block_bf16(const at::BFloat16* query, const at::BFloat16* const* keys,
                             int64_t head_dim, float scaling, float* scores) {
  __m512 dots[16];
  for (int t = 0; t < 16; ++t) dots[t] = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 32) {
    const __m512bh q = (__m512bh)_mm512_loadu_si512(query + d);
    for (int t = 0; t < 16; ++t) {
      dots[t] = _mm512_dpbf16_ps(dots[t], q, (__m512bh)_mm512_loadu_si512(keys[t] + d));
    }
  }
  _mm512_storeu_ps(scores, _mm512_mul_ps(sum_lanes(dots), _mm512_set1_ps(scaling)));
}
#endif
#else
// Softmax steps over a row of float scores, as the AVX-512 ones, on whole vectors only.
inline int64_t max_prefix(const float* score, int64_t len, float& top) {
  fvec top_lanes = set1(top);
  int64_t j = 0;
  for (; j + kLanes <= len; j += kLanes) top_lanes = max(top_lanes, load(score + j));
  top = max_lane(top_lanes);
  return j;
}
inline int64_t exp_prefix(float* score, int64_t len, float top, float& total) {
  const fvec top_lanes = set1(top);
  fvec total_lanes = zero();
  int64_t j = 0;
  for (; j + kLanes <= len; j += kLanes) {
    const fvec weight = exp_nonpositive(sub(load(score + j), top_lanes));
    store(score + j, weight);
    total_lanes = add(total_lanes, weight);
  }
  total = sum(total_lanes);
  return j;
}
#endif

// An IEEE half (a GGUF block's scale) as float, by F16C.
inline float half_to_float(uint16_t bits) { return _cvtsh_ss(bits); }

}  // namespace radixserve::simd
#endif
