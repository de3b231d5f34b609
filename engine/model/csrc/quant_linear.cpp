// Matmuls over weights kept quantized, in the blocks a GGUF file stores (Q4_0, Q4_1, Q8_0,
// and the K-quants Q4_K, Q6_K), or as int8 rows with one float scale each
// (`--quantization int8`).
//
// Each weight row is `K / 32` blocks of 32 weights:
//   Q4_0  18 bytes: half d, 16 bytes of nibbles          w = d * (q - 8)
//   Q4_1  20 bytes: half d, half m, 16 bytes of nibbles  w = d * q + m
//   Q8_0  34 bytes: half d, 32 int8                      w = d * q
//   int8  32 int8 per block, the row's float scale s after its last block: w = s * q
// (in a nibble block, weight j is the low nibble of byte j and weight j + 16 its high one),
// or `K / 256` super-blocks of 256 weights in 8 or 16 sub-blocks (`widen_superblock`):
//   Q4_K  144 bytes: half d, half dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles
//   Q6_K  210 bytes: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, half d
//
// quant_linear, few rows (decode), by `activation_bits`: 32 widens each block to floats in
// registers (F16C for the scale, byte-to-int32-to-float conversions for the weights) and
// multiplies it into up to eight rows of x at once (`kTileRows`); 16 and 8 round x per block of 32 to
// integers and multiply integers (below). Either way a group of weight rows stays in L1
// across the tiles of x, so the packed weights are read once. More rows (prefill): bands of the weight are
// widened once into a float block and multiplied by the CPU's GEMM (oneDNN/MKL through
// at::mm), the band reused for every row of x. With `batch_invariant`
// (--enable-deterministic-inference) every row count takes the float register path: each
// output is then summed in one order that depends on K alone, the same bits for a row
// whatever rows share the call (the GEMM's order changes with the rows, and the integer
// path rounds x).

#include "parallel.h"
#include "simd.h"

#include <ATen/ATen.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

// GGML's type ids for the block formats, and one of ours for int8 rows.
enum Format : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14, kInt8Rows = 1000 };

constexpr int64_t kBlock = 32;
// Rows of x multiplied into each widened block. AVX-512's 32 registers hold two running sums
// for each of 8 rows beside the block. AVX2's 16 hold two for 4 rows, or one for 8: a tile of
// 5-8 rows keeps one sum per row, which widens each block half as often at 8 rows as tiles
// of 4 do. Under batch_invariant, AVX2 keeps tiles of 4, so that every row is summed in the
// same order whatever rows share the call.
constexpr int64_t kTileRows = 8;
#if defined(RADIXSERVE_AVX512)
constexpr int kWideTileChains = 2;  // running sums per row in a tile of 5-8 rows
constexpr int64_t kInvariantTileRows = 8;
#else
constexpr int kWideTileChains = 1;
constexpr int64_t kInvariantTileRows = 4;
#endif
constexpr int64_t kGemvRows = 16;  // up to this many rows of x, the register path
// Up to this many rows of x, integer activations where asked for; beyond, a block widened
// once to floats for four rows of x costs less than the integer products' per-block scaling
// (docs/benchmarks/quantization.md).
constexpr int64_t kIntegerRows = 2;

constexpr int64_t kSuperBlock = 256;  // weights of a K-quant super-block

constexpr bool is_k_quant(int64_t format) { return format == kQ4_K || format == kQ6_K; }

// Formats whose weights are unsigned integers plus a per-block offset (w = d * q + shift).
constexpr bool has_offset(int64_t format) {
  return format == kQ4_0 || format == kQ4_1 || format == kQ4_K;
}

// Formats the integer-activation paths multiply (Q6_K's scales cover 16 weights, half a
// block of x: its rows are widened to floats).
constexpr bool has_integer_path(int64_t format) { return format != kQ6_K; }

constexpr int64_t block_weights(int64_t format) {
  return is_k_quant(format) ? kSuperBlock : kBlock;
}

constexpr int64_t block_bytes(int64_t format) {
  return format == kQ4_0   ? 18
         : format == kQ4_1 ? 20
         : format == kQ8_0 ? 34
         : format == kQ4_K ? 144
         : format == kQ6_K ? 210
                           : kBlock;
}

int64_t row_bytes(int64_t format, int64_t k_size) {
  return k_size / block_weights(format) * block_bytes(format) + (format == kInt8Rows ? 4 : 0);
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float half_bits(const uint8_t* p) {
  return static_cast<float>(c10::Half(load_u16(p), c10::Half::from_bits()));
}

// The float scale of an int8 row (1 for the block formats, whose scales are per block).
inline float row_scale(int64_t format, const uint8_t* row, int64_t k_size) {
  if (format != kInt8Rows) return 1.0f;
  float s;
  std::memcpy(&s, row + k_size, sizeof(s));
  return s;
}

// The 32 weights of one block, as floats, one at a time: the reference the vector paths
// match, and the path of builds without them.
template <int64_t F>
void widen_block_scalar(const uint8_t* block, float scale, float* out) {
  if constexpr (F == kQ4_0 || F == kQ4_1) {
    const float d = half_bits(block);
    const float m = F == kQ4_1 ? half_bits(block + 2) : -8.0f * d;
    const uint8_t* qs = block + (F == kQ4_1 ? 4 : 2);
    for (int j = 0; j < 16; ++j) {
      out[j] = static_cast<float>(qs[j] & 0x0F) * d + m;
      out[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
    }
  } else {
    const float d = F == kQ8_0 ? half_bits(block) : scale;
    const int8_t* qs = reinterpret_cast<const int8_t*>(block + (F == kQ8_0 ? 2 : 0));
    for (int j = 0; j < kBlock; ++j) out[j] = static_cast<float>(qs[j]) * d;
  }
}

// Sub-block j of a Q4_K super-block, w = (d * scale) * q - dmin * min: its two 6-bit
// factors (12 bytes from `s`: scales 0-3 | mins 0-3 | low bits of 4-7, their high bits in
// the top of the first eight), and its 32 nibbles, the low (j even) or high (j odd) halves
// of 32 bytes.
struct Q4KSubBlock {
  float scale, min;
  const uint8_t* bytes;
  int shift;

  Q4KSubBlock(const uint8_t* block, int j)
      : bytes(block + 16 + j / 2 * 32), shift(j % 2 * 4) {
    const uint8_t* s = block + 4;
    const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    const int m = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    scale = half_bits(block) * static_cast<float>(sc);  // rounded as ggml rounds d * sc
    min = half_bits(block + 2) * static_cast<float>(m);
  }
};

// A K-quant super-block's 256 weights as floats, rounded as ggml's dequantization (and
// gguf-py's) rounds them: the sub-block's scale d * s first, then its product with q.
template <int64_t F>
void widen_superblock(const uint8_t* block, float* out) {
  if constexpr (F == kQ4_K) {
    for (int j = 0; j < 8; ++j) {
      const Q4KSubBlock sub(block, j);
      for (int l = 0; l < 32; ++l) {
        out[j * 32 + l] =
            sub.scale * static_cast<float>((sub.bytes[l] >> sub.shift) & 0x0F) - sub.min;
      }
    }
  } else {  // Q6_K: each half of 128 weights in 4 runs of 32, 16 weights per scale
    const float d = half_bits(block + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = block + half * 64;  // runs 0, 1: low nibbles; 2, 3: high nibbles
      const uint8_t* qh = block + 128 + half * 32;  // run r: bits 2r, 2r + 1
      for (int run = 0; run < 4; ++run) {
        for (int part = 0; part < 2; ++part) {
          const int first = half * 128 + run * 32 + part * 16;
          const float ds = d * static_cast<float>(scales[first / 16]);
          for (int l = part * 16; l < part * 16 + 16; ++l) {
            const int low = (ql[run % 2 * 32 + l] >> (run / 2 * 4)) & 0x0F;
            const int high = (qh[l] >> (run * 2)) & 0x03;
            out[half * 128 + run * 32 + l] = ds * static_cast<float>((low | high << 4) - 32);
          }
        }
      }
    }
  }
}

#if defined(RADIXSERVE_SIMD)
using radixserve::simd::fvec;
namespace simd = radixserve::simd;
constexpr int kVecs = kBlock / simd::kLanes;  // vectors per block: 2 (AVX-512) or 4 (AVX2)

// The same block widened in registers; equal to the scalar widening (one rounding each).
template <int64_t F>
inline void widen_block(const uint8_t* block, float scale, fvec* w) {
  if constexpr (F == kQ4_0 || F == kQ4_1) {
    const float d = simd::half_to_float(load_u16(block));
    const float m = F == kQ4_1 ? simd::half_to_float(load_u16(block + 2)) : -8.0f * d;
    const __m128i qs =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (F == kQ4_1 ? 4 : 2)));
    const __m128i nibble = _mm_set1_epi8(0x0F);
    simd::widen_u8(_mm_and_si128(qs, nibble), w);
    simd::widen_u8(_mm_and_si128(_mm_srli_epi16(qs, 4), nibble), w + simd::kPer16);
    const fvec dv = simd::set1(d), mv = simd::set1(m);
    for (int i = 0; i < kVecs; ++i) w[i] = simd::fmadd(w[i], dv, mv);
  } else {
    const float d = F == kQ8_0 ? simd::half_to_float(load_u16(block)) : scale;
    const uint8_t* qs = block + (F == kQ8_0 ? 2 : 0);
    simd::widen_i8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), w);
    simd::widen_i8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16)),
                   w + simd::kPer16);
    const fvec dv = simd::set1(d);
    for (int i = 0; i < kVecs; ++i) w[i] = simd::mul(w[i], dv);
  }
}
#endif

// One weight row dequantized to `k_size` floats.
template <int64_t F>
void widen_blocks(const uint8_t* row, int64_t k_size, float* out) {
  const float scale = row_scale(F, row, k_size);
  for (int64_t b = 0; b < k_size / kBlock; ++b) {
    const uint8_t* block = row + b * block_bytes(F);
#if defined(RADIXSERVE_SIMD)
    fvec w[kVecs];
    widen_block<F>(block, scale, w);
    for (int i = 0; i < kVecs; ++i) simd::store(out + b * kBlock + i * simd::kLanes, w[i]);
#else
    widen_block_scalar<F>(block, scale, out + b * kBlock);
#endif
  }
}

// One weight row of `k_size` weights as floats.
template <int64_t F>
void widen_row(const uint8_t* row, int64_t k_size, float* out) {
  if constexpr (is_k_quant(F)) {
    for (int64_t b = 0; b < k_size / kSuperBlock; ++b) {
      widen_superblock<F>(row + b * block_bytes(F), out + b * kSuperBlock);
    }
  } else {
    widen_blocks<F>(row, k_size, out);
  }
}

// `R` rows of float x (stride k_size) times one weight row: y[r * n_size] for each r.
template <int64_t F, int R, int Chains = 2>
inline void dot_rows(const float* x, int64_t k_size, const uint8_t* row, float* y,
                     int64_t n_size) {
  const float scale = row_scale(F, row, k_size);
#if defined(RADIXSERVE_SIMD)
  fvec acc[R][Chains];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < Chains; ++c) acc[r][c] = simd::zero();
  }
  for (int64_t b = 0; b < k_size / kBlock; ++b) {
    fvec w[kVecs];
    widen_block<F>(row + b * block_bytes(F), scale, w);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * k_size + b * kBlock;
      for (int i = 0; i < kVecs; ++i) {
        acc[r][i % Chains] =
            simd::fmadd(w[i], simd::load(xb + i * simd::kLanes), acc[r][i % Chains]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    fvec total = acc[r][0];
    for (int c = 1; c < Chains; ++c) total = simd::add(total, acc[r][c]);
    y[r * n_size] = simd::sum(total);
  }
#else
  float acc[R] = {};
  float w[kBlock];
  for (int64_t b = 0; b < k_size / kBlock; ++b) {
    widen_block_scalar<F>(row + b * block_bytes(F), scale, w);
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < kBlock; ++j) acc[r] += w[j] * x[r * k_size + b * kBlock + j];
    }
  }
  for (int r = 0; r < R; ++r) y[r * n_size] = acc[r];
#endif
}

// Weight rows a task touches ahead of the one it multiplies: a row's dot product is one
// dependent chain, so without it each core waits on few cache misses at a time and streams
// the weights at a fraction of the bandwidth.
constexpr int64_t kPrefetchRows = 8;

// Weight rows multiplied into every row of x before the next ones: they stay in L1.
constexpr int64_t kRowsPerGroup = 16;

inline void prefetch_row(const uint8_t* row, int64_t bytes) {
  for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch(row + byte);
}

template <int64_t F>
void gemv_blocks(const float* x, int64_t m_size, int64_t k_size, const uint8_t* weight,
                 int64_t n_size, float* y, bool batch_invariant) {
  const int64_t stride = row_bytes(F, k_size);
  radixserve::for_each_weight_row_tile(
      m_size, n_size, kRowsPerGroup, batch_invariant ? kInvariantTileRows : kTileRows,
      [&](int64_t m, int64_t rows, int64_t n, int64_t claimed_end) {
        const uint8_t* row = weight + n * stride;
        if (m == 0 && n + kPrefetchRows < claimed_end) {
          prefetch_row(row + kPrefetchRows * stride, stride);
        }
        const float* xm = x + m * k_size;
        float* yn = y + m * n_size + n;
        switch (rows) {
          case 1: dot_rows<F, 1>(xm, k_size, row, yn, n_size); break;
          case 2: dot_rows<F, 2>(xm, k_size, row, yn, n_size); break;
          case 3: dot_rows<F, 3>(xm, k_size, row, yn, n_size); break;
          case 4: dot_rows<F, 4>(xm, k_size, row, yn, n_size); break;
          case 5: dot_rows<F, 5, kWideTileChains>(xm, k_size, row, yn, n_size); break;
          case 6: dot_rows<F, 6, kWideTileChains>(xm, k_size, row, yn, n_size); break;
          case 7: dot_rows<F, 7, kWideTileChains>(xm, k_size, row, yn, n_size); break;
          default: dot_rows<F, 8, kWideTileChains>(xm, k_size, row, yn, n_size); break;
        }
      });
}

// Super-blocks (K-quants): each weight row widened once into a float row, then multiplied
// with every row of x. Their sub-blocks are not decoded in registers yet: correct, not fast
// (docs/benchmarks/quantization.md).
template <int64_t F>
void gemv_widened(const float* x, int64_t m_size, int64_t k_size, const uint8_t* weight,
                  int64_t n_size, float* y) {
  const int64_t stride = row_bytes(F, k_size);
  radixserve::parallel_claim(n_size, radixserve::chunk_for(n_size), [&](auto& queue) {
    std::vector<float> row(k_size);
    for (int64_t begin, end; queue.claim(begin, end);) {
      for (int64_t n = begin; n < end; ++n) {
        widen_row<F>(weight + n * stride, k_size, row.data());
        for (int64_t m = 0; m < m_size; ++m) {
          const float* xm = x + m * k_size;
#if defined(RADIXSERVE_SIMD)
          fvec acc = simd::zero();
          for (int64_t k = 0; k < k_size; k += simd::kLanes) {
            acc = simd::fmadd(simd::load(row.data() + k), simd::load(xm + k), acc);
          }
          y[m * n_size + n] = simd::sum(acc);
#else
          float acc = 0.0f;
          for (int64_t k = 0; k < k_size; ++k) acc += row[k] * xm[k];
          y[m * n_size + n] = acc;
#endif
        }
      }
    }
  });
}

template <int64_t F>
void gemv(const float* x, int64_t m_size, int64_t k_size, const uint8_t* weight,
          int64_t n_size, float* y, bool batch_invariant) {
  if constexpr (is_k_quant(F)) {
    gemv_widened<F>(x, m_size, k_size, weight, n_size, y);
  } else {
    gemv_blocks<F>(x, m_size, k_size, weight, n_size, y, batch_invariant);
  }
}

#if defined(RADIXSERVE_SIMD)
// Decode rows with integer activations, as llama.cpp's Q8_0/Q8_1 dot products: each block of
// 32 values of x is rounded to integers of `A` with its own scale (max |x| / 32767 for
// int16, / 127 for int8) and multiplied with the weights' integers, one float multiply-add
// per block for both scales. int16 keeps x to 15 bits of its block's largest value, far
// closer to float than bf16 is (vpmaddwd: 16 products per instruction); int8 rounds it as
// llama.cpp does (vpdpbusd with AVX-VNNI/AVX512-VNNI, else vpmaddubsw + vpmaddwd). The
// offsets of Q4_0 (-8 d) and Q4_1 (m) multiply the sum of the block's rounded x, so that the
// result is exactly the weights times the rounded x (with x's exact sum, the rounding error
// would be weighted by the nibbles, 0..15, instead of by the weights). Either takes about
// half the instructions of widening every weight to float, so the packed weights stream
// at about twice the rate (docs/benchmarks/quantization.md).
template <typename A>
struct IntegerRows {
  std::vector<A> values;  // [rows, K]; int16: each block's even values, then its odd ones
  std::vector<float> scales, sums;  // [rows, K / 32]: the scale, and it times the block's sum
};

template <typename A>
IntegerRows<A> round_rows(const float* x, int64_t m_size, int64_t k_size) {
  constexpr float kLargest = std::numeric_limits<A>::max();
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
                                                     : max_abs / kLargest;
    const __m256 inverse = _mm256_set1_ps(max_abs > 0.0f ? kLargest / max_abs : 0.0f);
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
//   nibble block's 64-bit lanes shifted by 0 (low nibbles) or 4 (high ones).
// - A row's block against a block of x gives 8 int32 lanes; the 8 rows' lanes are summed
//   into one vector, one int32 per row (exact: at most 32 x 32767 x 128), converted to float
//   once and scaled by the 8 rows' block scales as a vector, loaded from the 8 block headers
//   together.
constexpr int64_t kIntegerTileRows = 8;
constexpr int64_t kPrefetchTiles = 2;  // a tile's block steps prefetch the tile this far ahead

// One weight row's block, unpacked for blocks of x of type A; `dot` gives its products with
// one, as 8 int32 lanes to be summed.
template <int64_t F, typename A>
struct BlockOperand;

template <int64_t F>
struct BlockOperand<F, int16_t> {
  __m256i even, odd;

  // The block's nibbles or int8 weights; Q4_K: 32 bytes whose nibbles at `shift` they are.
  BlockOperand(const uint8_t* qs, int shift) {
    const __m256i low4 = _mm256_set1_epi16(0x000F);
    if constexpr (F == kQ4_0 || F == kQ4_1) {
      const __m256i bytes =
          _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
      even = _mm256_and_si256(
          _mm256_srlv_epi32(bytes, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), low4);
      odd = _mm256_and_si256(
          _mm256_srlv_epi32(bytes, _mm256_setr_epi32(8, 8, 8, 8, 12, 12, 12, 12)), low4);
    } else {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
      if constexpr (F == kQ4_K) {
        even = _mm256_and_si256(_mm256_srl_epi16(bytes, _mm_cvtsi32_si128(shift)), low4);
        odd = _mm256_and_si256(_mm256_srl_epi16(bytes, _mm_cvtsi32_si128(shift + 8)), low4);
      } else {
        even = _mm256_srai_epi16(_mm256_slli_epi16(bytes, 8), 8);
        odd = _mm256_srai_epi16(bytes, 8);
      }
    }
  }

  __m256i dot(const int16_t* x) const {  // 2 x 32767 x 128 at most per product pair
    const __m256i* xs = reinterpret_cast<const __m256i*>(x);
    return _mm256_add_epi32(_mm256_madd_epi16(even, _mm256_loadu_si256(xs)),
                            _mm256_madd_epi16(odd, _mm256_loadu_si256(xs + 1)));
  }
};

// vpmaddubsw / vpdpbusd multiply unsigned by signed bytes: nibbles as they are; signed
// weights as their magnitudes, x then taking their signs.
template <int64_t F>
struct BlockOperand<F, int8_t> {
  __m256i weights, magnitudes;

  BlockOperand(const uint8_t* qs, int shift) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    if constexpr (F == kQ4_0 || F == kQ4_1) {
      const __m256i bytes =
          _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
      weights = magnitudes = _mm256_and_si256(
          _mm256_srlv_epi64(bytes, _mm256_setr_epi64x(0, 0, 4, 4)), low4);
    } else if constexpr (F == kQ4_K) {
      weights = magnitudes = _mm256_and_si256(
          _mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs)),
                           _mm_cvtsi32_si128(shift)),
          low4);
    } else {
      weights = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
      magnitudes = _mm256_sign_epi8(weights, weights);
    }
  }

  __m256i dot(const int8_t* x) const {
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    if constexpr (F == kQ8_0 || F == kInt8Rows) v = _mm256_sign_epi8(v, weights);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), magnitudes, v);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), magnitudes, v);
#else  // pairs first: 2 x 15 x 127 (nibbles) or 2 x 128 x 127 (int8) fit int16
    return _mm256_madd_epi16(_mm256_maddubs_epi16(magnitudes, v), _mm256_set1_epi16(1));
#endif
  }
};

// The scales d and offsets (w = d * q + shift) of block b of 8 weight rows, as vectors
// (int8 rows: their scales are set once per tile by dot_rows8).
template <int64_t F>
inline void block_factors8(const uint8_t* const* rows, int64_t b, __m256& d, __m256& shift) {
  if constexpr (F == kQ4_0 || F == kQ4_1 || F == kQ8_0) {
    // the headers' first 4 bytes, [d | m] for Q4_1, then d0..d7 and m0..m7 as halves
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
    shift = F == kQ4_1   ? _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1))
            : F == kQ4_0 ? _mm256_mul_ps(d, _mm256_set1_ps(-8.0f))
                         : _mm256_setzero_ps();
  } else if constexpr (F == kInt8Rows) {
    shift = _mm256_setzero_ps();
  } else {  // Q4_K: the sub-blocks' factors of 6 bits
    alignas(32) float ds[8], shifts[8];
    for (int j = 0; j < 8; ++j) {  // sub-block b % 8 of super-block b / 8
      const Q4KSubBlock sub(rows[j] + b / 8 * block_bytes(F), static_cast<int>(b % 8));
      ds[j] = sub.scale;
      shifts[j] = -sub.min;
    }
    d = _mm256_load_ps(ds);
    shift = _mm256_load_ps(shifts);
  }
}

// The integers of block b of a weight row: its nibbles (Q4_K: their 32 bytes and shift) or
// int8 weights.
template <int64_t F>
inline const uint8_t* block_integers(const uint8_t* row, int64_t b, int& shift) {
  shift = 0;
  if constexpr (F == kQ4_K) {
    shift = static_cast<int>(b % 8 % 2 * 4);
    return row + b / 8 * block_bytes(F) + 16 + b % 8 / 2 * 32;
  } else {
    return row + b * block_bytes(F) + (F == kQ4_1 ? 4 : F == kInt8Rows ? 0 : 2);
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
        int shift_bits;
        const uint8_t* qs = block_integers<F>(rows[j + t], b, shift_bits);
        const BlockOperand<F, A> w(qs, shift_bits);
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
void gemv_integer(const float* x, int64_t m_size, int64_t k_size, const uint8_t* weight,
                  int64_t n_size, float* y) {
  const IntegerRows<A> xq = round_rows<A>(x, m_size, k_size);
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
        for (int64_t m = 0; m < m_size; m += 2) {  // the tile's rows stay in L1
          const uint8_t* first_ahead = m == 0 ? ahead : nullptr;
          if (m + 1 == m_size) {
            dot_rows8<F, A, 1>(xq, m, k_size, rows, first_ahead, y + n, n_size, count);
          } else {
            dot_rows8<F, A, 2>(xq, m, k_size, rows, first_ahead, y + n, n_size, count);
          }
        }
      }
    }
  });
}
#endif

template <int64_t F>
void widen_rows(const uint8_t* weight, int64_t k_size, int64_t n_begin, int64_t n_end,
                float* out) {
  const int64_t stride = row_bytes(F, k_size);
  const int64_t rows = n_end - n_begin;
  radixserve::parallel_claim(rows, radixserve::chunk_for(rows), [&](auto& queue) {
    for (int64_t begin, end; queue.claim(begin, end);) {
      for (int64_t n = begin; n < end; ++n) {
        widen_row<F>(weight + (n_begin + n) * stride, k_size, out + n * k_size);
      }
    }
  });
}

template <typename Fn>
void with_format(int64_t format, const Fn& fn) {
  switch (format) {
    case kQ4_0: fn(std::integral_constant<int64_t, kQ4_0>{}); break;
    case kQ4_1: fn(std::integral_constant<int64_t, kQ4_1>{}); break;
    case kQ8_0: fn(std::integral_constant<int64_t, kQ8_0>{}); break;
    case kQ4_K: fn(std::integral_constant<int64_t, kQ4_K>{}); break;
    case kQ6_K: fn(std::integral_constant<int64_t, kQ6_K>{}); break;
    case kInt8Rows: fn(std::integral_constant<int64_t, kInt8Rows>{}); break;
    default: TORCH_CHECK(false, "unknown quantized weight format ", format);
  }
}

void check_weight(const at::Tensor& weight, int64_t format, int64_t k_size) {
  TORCH_CHECK(k_size % block_weights(format) == 0, "the input width is a multiple of ",
              block_weights(format), ", got ", k_size);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                  weight.size(1) == row_bytes(format, k_size),
              "uint8 weight rows of ", row_bytes(format, k_size), " bytes");
}

at::Tensor quant_dequantize(const at::Tensor& weight, int64_t format, int64_t k_size) {
  check_weight(weight, format, k_size);
  at::Tensor out = at::empty({weight.size(0), k_size}, weight.options().dtype(at::kFloat));
  with_format(format, [&](auto f) {
    widen_rows<decltype(f)::value>(weight.const_data_ptr<uint8_t>(), k_size, 0, weight.size(0),
                                   out.data_ptr<float>());
  });
  return out;
}

// Weight rows widened per band: about this many bytes of floats, reused for every row of x.
constexpr int64_t kBandBytes = 2 << 20;

at::Tensor quant_linear(const at::Tensor& input, const at::Tensor& weight, int64_t format,
                        const std::optional<at::Tensor>& bias, int64_t activation_bits,
                        bool batch_invariant) {
  TORCH_CHECK(input.dim() == 2, "input [rows, K]");
  TORCH_CHECK(activation_bits == 32 || activation_bits == 16 || activation_bits == 8,
              "decode activations of 32 (float), 16 or 8 bits, got ", activation_bits);
  const int64_t m_size = input.size(0), k_size = input.size(1), n_size = weight.size(0);
  TORCH_CHECK(!batch_invariant || activation_bits == 32,
              "batch-invariant rows keep float activations");
  check_weight(weight, format, k_size);
  const uint8_t* w_ptr = weight.const_data_ptr<uint8_t>();
  at::Tensor out;
  if (m_size <= kGemvRows || batch_invariant) {
    const at::Tensor x = input.to(at::kFloat).contiguous();
    out = at::empty({m_size, n_size}, x.options());
    with_format(format, [&](auto f) {
#if defined(RADIXSERVE_SIMD)
      constexpr int64_t F = decltype(f)::value;
      if constexpr (has_integer_path(F)) {  // else floats (gemv_widened)
        if (m_size <= kIntegerRows && activation_bits == 16) {
          gemv_integer<F, int16_t>(x.const_data_ptr<float>(), m_size, k_size, w_ptr, n_size,
                                   out.data_ptr<float>());
          return;
        }
        if (m_size <= kIntegerRows && activation_bits == 8) {
          gemv_integer<F, int8_t>(x.const_data_ptr<float>(), m_size, k_size, w_ptr, n_size,
                                  out.data_ptr<float>());
          return;
        }
      }
#endif
      gemv<decltype(f)::value>(x.const_data_ptr<float>(), m_size, k_size, w_ptr, n_size,
                               out.data_ptr<float>(), batch_invariant);
    });
    if (bias.has_value()) out.add_(*bias);
    return out.to(input.scalar_type());
  }
  const at::Tensor x = input.contiguous();
  out = at::empty({m_size, n_size}, x.options());
  const int64_t band = std::clamp<int64_t>(kBandBytes / (k_size * 4) / 16 * 16, 16, n_size);
  at::Tensor widened = at::empty({band, k_size}, x.options().dtype(at::kFloat));
  for (int64_t n = 0; n < n_size; n += band) {
    const int64_t rows = std::min(band, n_size - n);
    with_format(format, [&](auto f) {
      widen_rows<decltype(f)::value>(w_ptr, k_size, n, n + rows, widened.data_ptr<float>());
    });
    const at::Tensor w = widened.narrow(0, 0, rows).to(x.scalar_type());
    out.narrow(1, n, rows).copy_(at::mm(x, w.t()));
  }
  if (bias.has_value()) out.add_(*bias);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def(
      "quant_linear(Tensor input, Tensor weight, int format, Tensor? bias, "
      "int activation_bits, bool batch_invariant=False) -> Tensor");
  m.def("quant_dequantize(Tensor weight, int format, int k_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_dequantize", &quant_dequantize);
}
