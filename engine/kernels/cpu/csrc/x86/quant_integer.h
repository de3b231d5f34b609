// Decode rows of `quant_linear` with integer activations on x86 (AVX2, and the VNNI sets
// where the build has them): x rounded per block of 32, weights unpacked in 256-bit
// registers, eight weight rows a tile.
#pragma once

#include "parallel.h"
#include "quant_formats.h"
#include "simd.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace radixserve::quant {

// Decode rows with integer activations, as llama.cpp's Q8_0/Q8_1 dot products: each block of
// 32 values of x is rounded to integers of `A` with its own scale (max |x| / 32767 for
// int16, / 127 for int8) and multiplied with the weights' integers, one float multiply-add
// per block for both scales. int16 keeps x to 15 bits of its block's largest value, far
// closer to float than bf16 is (vpmaddwd: 16 products per instruction); int8 rounds it as
// llama.cpp does (vpdpbusd with AVX-VNNI/AVX512-VNNI, else vpmaddubsw + vpmaddwd). The
// offsets of Q4_0 (-8 d), Q5_0 (-16 d) and Q4_1/Q5_1 (m) multiply the sum of the block's
// rounded x, so that the result is exactly the weights times the rounded x (with x's exact
// sum, the rounding error would be weighted by the integers, 0..31, instead of by the
// weights). Either takes about half the instructions of widening every weight to float, so
// the packed weights stream at about twice the rate (docs/benchmarks/quantization.md).
template <typename A>
struct IntegerRows {
  std::vector<A> values;  // [rows, K]; int16: each block's even values, then its odd ones
  std::vector<float> scales, sums;  // [rows, K / 32]: the scale, and it times the block's sum
};

// The largest integer a block of x rounds to for weights of format F: the type's, but for
// Q6_K at int16 one bit less, since its products take their 8-bit sub-block scales before a
// block's 32 are summed in int32 (32 x 32 x 128 x 16383 < 2^31).
template <int64_t F, typename A>
constexpr float largest_integer() {
  return F == kQ6_K && std::is_same_v<A, int16_t> ? 16383.0f : std::numeric_limits<A>::max();
}

template <typename A>
inline IntegerRows<A> round_rows(const float* x, int64_t m_size, int64_t k_size, float largest) {
  const int64_t blocks = m_size * k_size / kBlock;
  IntegerRows<A> q{std::vector<A>(m_size * k_size), std::vector<float>(blocks),
                   std::vector<float>(blocks)};
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kBlock;
    __m256 v[4], amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));  // max drops NaN
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float max_abs = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    // a NaN in the block makes its scale NaN, so that it reaches every output of the row
    const float scale = _mm256_movemask_ps(nan) != 0 ? std::numeric_limits<float>::quiet_NaN()
                                                     : max_abs / largest;
    const __m256 inverse = _mm256_set1_ps(max_abs > 0.0f ? largest / max_abs : 0.0f);
    __m256i ints[4];
    for (int i = 0; i < 4; ++i) ints[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(ints[0], ints[1]),
                                           _mm256_add_epi32(ints[2], ints[3]));
    __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, _MM_SHUFFLE(1, 0, 3, 2)));
    sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, _MM_SHUFFLE(2, 3, 0, 1)));
    // int32 -> A, then undo the lane interleaving of the packs
    auto* out = reinterpret_cast<__m256i*>(q.values.data() + b * kBlock);
    if constexpr (std::is_same_v<A, int16_t>) {  // [x0, x2, .., x30 | x1, x3, .., x31]
      const __m256i evens_first = _mm256_setr_epi8(
          0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
          0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
      __m256i halves[2];  // x0-15 and x16-31: [evens | odds] of each
      for (int h = 0; h < 2; ++h) {
        const __m256i words = _mm256_permute4x64_epi64(
            _mm256_packs_epi32(ints[2 * h], ints[2 * h + 1]), _MM_SHUFFLE(3, 1, 2, 0));
        halves[h] = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(words, evens_first),
                                             _MM_SHUFFLE(3, 1, 2, 0));
      }
      _mm256_storeu_si256(out, _mm256_permute2x128_si256(halves[0], halves[1], 0x20));
      _mm256_storeu_si256(out + 1, _mm256_permute2x128_si256(halves[0], halves[1], 0x31));
    } else {
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]),
                                                _mm256_packs_epi32(ints[2], ints[3]));
      _mm256_storeu_si256(out, _mm256_permutevar8x32_epi32(
                                   packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
    q.scales[b] = scale;
    q.sums[b] = scale * static_cast<float>(_mm_cvtsi128_si32(sum4));
  }
  return q;
}

// The integer paths take eight weight rows at a time, and each block costs the rows no
// scalar work:
// - A block's weights are unpacked by shifts and masks alone (no shuffle port), into the
//   order round_rows stores x in. int16: the 16 even and 16 odd weights: a nibble block's 16
//   bytes go into both halves of a vector, each 32-bit lane shifted by 0 and 4 (evens) or
//   8 and 12 (odds); byte formats shift 16-bit lanes. int8: the 32 weights in order, a
//   nibble block's 64-bit lanes shifted by 0 (low nibbles) or 4 (high ones). The Q5
//   formats then OR in their fifth bits, 32 bytes of 0 or 0x10 in weight order
//   (`BlockIntegers::fifth`): as they are for int8, their even and odd bytes for int16.
//   Q6_K's 32 weights are assembled as signed bytes (`q6k_weights`), then taken as a byte
//   format; its two scales of 16 weights each multiply the lanes of their half
//   (`BlockOperand::lane_scales`), so that a block still sums to one int32 per row.
// - A row's block against a block of x gives 8 int32 lanes; the 8 rows' lanes are summed
//   into one vector, one int32 per row (exact: at most 32 x 32767 x 128), converted to float
//   once and scaled by the 8 rows' block scales as a vector, loaded from the 8 block headers
//   together.
constexpr int64_t kIntegerTileRows = 8;
constexpr int64_t kPrefetchTiles = 2;  // a tile's block steps prefetch the tile this far ahead

// Where block b of a weight row keeps its integers: its nibbles or int8 weights (Q4_K/Q5_K:
// 32 bytes whose nibbles at `shift` they are; Q6_K: its super-block, `shift` the sub-block),
// and the Q5 formats' fifth bits as bytes of 0 or 0x10 in weight order (zero for the others).
struct BlockIntegers {
  const uint8_t* qs;
  int shift = 0;
  __m256i fifth = _mm256_setzero_si256();
};

template <int64_t F>
inline BlockIntegers block_integers(const uint8_t* row, int64_t b) {
  if constexpr (is_k_nibble(F)) {
    const int j = static_cast<int>(b % 8);  // sub-block j of super-block b / 8
    const KSubBlock<F> sub(row + b / 8 * block_bytes(F), j);
    BlockIntegers block{sub.bytes, sub.shift};
    if constexpr (F == kQ5_K) {  // bit j of each of 32 bytes, moved to bit 4
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sub.fifth));
      block.fifth = _mm256_and_si256(
          _mm256_slli_epi16(_mm256_srl_epi16(bits, _mm_cvtsi32_si128(j)), 4),
          _mm256_set1_epi8(0x10));
    }
    return block;
  } else if constexpr (F == kQ6_K) {
    return {row + b / 8 * block_bytes(F), static_cast<int>(b % 8)};
  } else {
    const uint8_t* block = row + b * block_bytes(F);
    if constexpr (has_fifth_bit(F)) {
      return {block + nibbles_at(F), 0, simd::fifth_bit_bytes(fifth_bits<F>(block))};
    }
    return {block + (is_nibble_block(F) ? nibbles_at(F) : F == kInt8Rows ? 0 : 2)};
  }
}

// Sub-block j of a Q6_K super-block as 32 signed bytes q - 32: run j % 4 of half j / 4, whose
// low 4 bits are nibbles of 32 bytes at 0 (runs 0, 1) or 32 (runs 2, 3) of the half's 64 and
// high 2 bits are bits 2 (j % 4) of the half's 32 bytes after the 128 of nibbles.
inline __m256i q6k_weights(const uint8_t* super_block, int j) {
  const int half = j / 4, run = j % 4;
  const __m256i low_bytes = _mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(super_block + half * 64 + run % 2 * 32));
  const __m256i high_bytes =
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(super_block + 128 + half * 32));
  const __m256i low = _mm256_and_si256(
      _mm256_srl_epi16(low_bytes, _mm_cvtsi32_si128(run / 2 * 4)), _mm256_set1_epi8(0x0F));
  const __m256i high = _mm256_slli_epi16(
      _mm256_and_si256(_mm256_srl_epi16(high_bytes, _mm_cvtsi32_si128(2 * run)),
                       _mm256_set1_epi8(0x03)),
      4);
  return _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32));
}

// The int8 scales of sub-block j's two halves as int32 lanes [s0 x 4 | s1 x 4]: a block's dot
// lanes 0-3 hold its first 16 products, lanes 4-7 the others.
inline __m256i q6k_lane_scales(const uint8_t* super_block, int j) {
  const __m128i pair = _mm_cvtsi32_si128(load_u16(super_block + 192 + 2 * j));
  return _mm256_cvtepi8_epi32(
      _mm_shuffle_epi8(pair, _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0)));
}

// One weight row's block, unpacked for blocks of x of type A; `dot` gives its products with
// one, as 8 int32 lanes to be summed (Q6_K's already times their scales).
template <int64_t F, typename A>
struct BlockOperand;

template <int64_t F>
struct BlockOperand<F, int16_t> {
  __m256i even, odd, lane_scales;

  explicit BlockOperand(const BlockIntegers& block) {
    const __m256i low4 = _mm256_set1_epi16(0x000F);
    if constexpr (F == kQ6_K) {
      const __m256i bytes = q6k_weights(block.qs, block.shift);
      even = _mm256_srai_epi16(_mm256_slli_epi16(bytes, 8), 8);
      odd = _mm256_srai_epi16(bytes, 8);
      lane_scales = q6k_lane_scales(block.qs, block.shift);
    } else if constexpr (is_nibble_block(F)) {
      const __m256i bytes = _mm256_broadcastsi128_si256(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(block.qs)));
      even = _mm256_and_si256(
          _mm256_srlv_epi32(bytes, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), low4);
      odd = _mm256_and_si256(
          _mm256_srlv_epi32(bytes, _mm256_setr_epi32(8, 8, 8, 8, 12, 12, 12, 12)), low4);
    } else {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block.qs));
      if constexpr (is_k_nibble(F)) {
        const int shift = block.shift;
        even = _mm256_and_si256(_mm256_srl_epi16(bytes, _mm_cvtsi32_si128(shift)), low4);
        odd = _mm256_and_si256(_mm256_srl_epi16(bytes, _mm_cvtsi32_si128(shift + 8)), low4);
      } else {
        even = _mm256_srai_epi16(_mm256_slli_epi16(bytes, 8), 8);
        odd = _mm256_srai_epi16(bytes, 8);
      }
    }
    if constexpr (has_fifth_bit(F)) {  // 16-bit lane i: weight 2i's byte (even), 2i + 1's
      even = _mm256_or_si256(even, _mm256_and_si256(block.fifth, _mm256_set1_epi16(0x00FF)));
      odd = _mm256_or_si256(odd, _mm256_srli_epi16(block.fifth, 8));
    }
  }

  __m256i dot(const int16_t* x) const {  // 2 x 32767 x 128 at most per product pair
    const __m256i* xs = reinterpret_cast<const __m256i*>(x);
    const __m256i lanes = _mm256_add_epi32(_mm256_madd_epi16(even, _mm256_loadu_si256(xs)),
                                           _mm256_madd_epi16(odd, _mm256_loadu_si256(xs + 1)));
    if constexpr (F == kQ6_K) return _mm256_mullo_epi32(lanes, lane_scales);
    return lanes;
  }
};

// vpmaddubsw / vpdpbusd multiply unsigned by signed bytes: nibbles (and fifth bits) as they
// are; signed weights as their magnitudes, x then taking their signs.
template <int64_t F>
struct BlockOperand<F, int8_t> {
  __m256i weights, magnitudes, lane_scales;

  explicit BlockOperand(const BlockIntegers& block) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    if constexpr (F == kQ6_K) {
      weights = q6k_weights(block.qs, block.shift);
      lane_scales = q6k_lane_scales(block.qs, block.shift);
    } else if constexpr (is_nibble_block(F)) {
      const __m256i bytes = _mm256_broadcastsi128_si256(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(block.qs)));
      weights = _mm256_and_si256(_mm256_srlv_epi64(bytes, _mm256_setr_epi64x(0, 0, 4, 4)), low4);
    } else if constexpr (is_k_nibble(F)) {
      weights = _mm256_and_si256(
          _mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block.qs)),
                           _mm_cvtsi32_si128(block.shift)),
          low4);
    } else {
      weights = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block.qs));
    }
    if constexpr (has_fifth_bit(F)) weights = _mm256_or_si256(weights, block.fifth);
    if constexpr (has_offset(F)) {
      magnitudes = weights;
    } else {
      magnitudes = _mm256_sign_epi8(weights, weights);
    }
  }

  __m256i dot(const int8_t* x) const {
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    if constexpr (!has_offset(F)) v = _mm256_sign_epi8(v, weights);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    const __m256i lanes = _mm256_dpbusd_epi32(_mm256_setzero_si256(), magnitudes, v);
#elif defined(__AVXVNNI__)
    const __m256i lanes = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), magnitudes, v);
#else  // pairs first: 2 x 31 x 127 (nibbles, fifth bits) or 2 x 128 x 127 (int8) fit int16
    const __m256i lanes =
        _mm256_madd_epi16(_mm256_maddubs_epi16(magnitudes, v), _mm256_set1_epi16(1));
#endif
    if constexpr (F == kQ6_K) return _mm256_mullo_epi32(lanes, lane_scales);
    return lanes;
  }
};

// The scales d and offsets (w = d * q + shift) of block b of 8 weight rows, as vectors
// (int8 rows: their scales are set once per tile by dot_rows8).
template <int64_t F>
inline void block_factors8(const uint8_t* const* rows, int64_t b, __m256& d, __m256& shift) {
  if constexpr (is_nibble_block(F) || F == kQ8_0) {
    // the headers' first 4 bytes, [d | m] for Q4_1/Q5_1, then d0..d7 and m0..m7 as halves
    __m128i quads[2];
    for (int h = 0; h < 2; ++h) {
      const uint8_t* const* q = rows + 4 * h;
      const int64_t at = b * block_bytes(F);
      quads[h] = _mm_unpacklo_epi64(
          _mm_unpacklo_epi32(_mm_loadu_si32(q[0] + at), _mm_loadu_si32(q[1] + at)),
          _mm_unpacklo_epi32(_mm_loadu_si32(q[2] + at), _mm_loadu_si32(q[3] + at)));
    }
    const __m256i halves = _mm256_permute4x64_epi64(
        _mm256_shuffle_epi8(_mm256_set_m128i(quads[1], quads[0]),
                            _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14,
                                             15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11,
                                             14, 15)),
        _MM_SHUFFLE(3, 1, 2, 0));
    d = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
    shift = has_min(F)          ? _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1))
            : is_nibble_block(F) ? _mm256_mul_ps(d, _mm256_set1_ps(-zero_point(F)))
                                 : _mm256_setzero_ps();
  } else if constexpr (F == kInt8Rows) {
    shift = _mm256_setzero_ps();
  } else if constexpr (F == kQ6_K) {  // the super-blocks' d (the sub-blocks' scales: lanes)
    const int64_t at = b / 8 * block_bytes(F) + 208;
    const auto half = [&](int j) { return static_cast<int16_t>(load_u16(rows[j] + at)); };
    d = _mm256_cvtph_ps(
        _mm_setr_epi16(half(0), half(1), half(2), half(3), half(4), half(5), half(6), half(7)));
    shift = _mm256_setzero_ps();
  } else {  // Q4_K, Q5_K: the sub-blocks' factors of 6 bits
    alignas(32) float ds[8], shifts[8];
    for (int j = 0; j < 8; ++j) {  // sub-block b % 8 of super-block b / 8
      const KSubBlock<F> sub(rows[j] + b / 8 * block_bytes(F), static_cast<int>(b % 8));
      ds[j] = sub.scale();
      shifts[j] = -sub.min();
    }
    d = _mm256_load_ps(ds);
    shift = _mm256_load_ps(shifts);
  }
}

// Rows m..m+R of integer x times the 8 weight rows `rows`: the first `count` outputs of
// each row of x go to y. With `ahead`, each block step prefetches its share of the 8 rows
// there.
template <int64_t F, typename A, int R>
inline void dot_rows8(const IntegerRows<A>& xq, int64_t m, int64_t k_size,
                      const uint8_t* const* rows, const uint8_t* ahead, float* y,
                      int64_t n_size, int64_t count) {
  const int64_t blocks = k_size / kBlock;
  const int64_t ahead_step = (kIntegerTileRows * row_bytes(F, k_size) + blocks - 1) / blocks;
  __m256 acc[R], offset[R];
  for (int r = 0; r < R; ++r) acc[r] = offset[r] = _mm256_setzero_ps();
  __m256 d, shift;
  if constexpr (F == kInt8Rows) {
    alignas(32) float scales[8];
    for (int j = 0; j < 8; ++j) scales[j] = row_scale(F, rows[j], k_size);
    d = _mm256_load_ps(scales);
  }
  for (int64_t b = 0; b < blocks; ++b) {
    if (ahead != nullptr) {
      for (int64_t byte = 0; byte < ahead_step; byte += 64) {
        __builtin_prefetch(ahead + b * ahead_step + byte);
      }
    }
    __m256i pairs[R][4];  // lane sums of rows 2i and 2i + 1, in hadd's order
    for (int j = 0; j < 8; j += 2) {
      __m256i dots[R][2];
      for (int t = 0; t < 2; ++t) {
        const BlockOperand<F, A> w(block_integers<F>(rows[j + t], b));
        for (int r = 0; r < R; ++r) {
          dots[r][t] = w.dot(xq.values.data() + ((m + r) * blocks + b) * kBlock);
        }
      }
      for (int r = 0; r < R; ++r) pairs[r][j / 2] = _mm256_hadd_epi32(dots[r][0], dots[r][1]);
    }
    block_factors8<F>(rows, b, d, shift);
    for (int r = 0; r < R; ++r) {
      // [rows 0-3 | 0-3] of lanes 0-3, and of lanes 4-7: one int32 per row once added
      const __m256i low = _mm256_hadd_epi32(pairs[r][0], pairs[r][1]);
      const __m256i high = _mm256_hadd_epi32(pairs[r][2], pairs[r][3]);
      const __m256i totals = _mm256_add_epi32(_mm256_permute2x128_si256(low, high, 0x20),
                                              _mm256_permute2x128_si256(low, high, 0x31));
      const int64_t xb = (m + r) * blocks + b;
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(totals),
                               _mm256_mul_ps(d, _mm256_set1_ps(xq.scales[xb])), acc[r]);
      if constexpr (has_offset(F)) {
        offset[r] = _mm256_fmadd_ps(shift, _mm256_set1_ps(xq.sums[xb]), offset[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[8];
    _mm256_store_ps(out, _mm256_add_ps(acc[r], offset[r]));
    std::copy_n(out, count, y + (m + r) * n_size);
  }
}

template <int64_t F, typename A>
inline void gemv_integer(const float* x, int64_t m_size, int64_t k_size, const uint8_t* weight,
                  int64_t n_size, float* y) {
  const IntegerRows<A> xq = round_rows<A>(x, m_size, k_size, largest_integer<F, A>());
  const int64_t stride = row_bytes(F, k_size);
  const int64_t tiles = (n_size + kIntegerTileRows - 1) / kIntegerTileRows;
  radixserve::parallel_claim(tiles, radixserve::chunk_for(tiles), [&](auto& queue) {
    for (int64_t begin, end; queue.claim(begin, end);) {
      const int64_t n_end = std::min(n_size, end * kIntegerTileRows);
      for (int64_t n = begin * kIntegerTileRows; n < n_end; n += kIntegerTileRows) {
        const int64_t count = std::min(kIntegerTileRows, n_size - n);
        const int64_t ahead_row = n + kPrefetchTiles * kIntegerTileRows;
        const uint8_t* ahead =
            ahead_row + kIntegerTileRows <= n_end ? weight + ahead_row * stride : nullptr;
        const uint8_t* rows[kIntegerTileRows];  // the last tile repeats its last row
        for (int64_t j = 0; j < kIntegerTileRows; ++j) {
          rows[j] = weight + (n + std::min(j, count - 1)) * stride;
        }
        // The pointers stay in memory, each loaded where it is used: GCC otherwise holds
        // them in one vector register, and extracts each one again at every block.
        asm volatile("" : : "r"(rows) : "memory");
        // the tile's rows stay in L1 while the rows of x pass, up to four at a time
        for (int64_t m = 0; m < m_size;) {
          const uint8_t* first_ahead = m == 0 ? ahead : nullptr;
          const int64_t step = m_size - m >= 4 ? 4 : m_size - m >= 2 ? 2 : 1;
          if (step == 4) {
            dot_rows8<F, A, 4>(xq, m, k_size, rows, first_ahead, y + n, n_size, count);
          } else if (step == 2) {
            dot_rows8<F, A, 2>(xq, m, k_size, rows, first_ahead, y + n, n_size, count);
          } else {
            dot_rows8<F, A, 1>(xq, m, k_size, rows, first_ahead, y + n, n_size, count);
          }
          m += step;
        }
      }
    }
  });
}

}  // namespace radixserve::quant
