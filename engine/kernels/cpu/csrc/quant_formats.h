// The block layouts of the weights `quant_linear` multiplies as stored, one table for the
// kernels (engine/model/layers/quantization.py holds the same table for the loader;
// `quant_format_table` hands this one to tests/engine/kernels/test_quant_formats.py, which
// compares them). A format is GGUF's block type id, or ours for int8 rows
// (`--quantization int8`, one float scale per row).
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
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace radixserve::quant {

// GGML's type ids for the block formats, and one of ours for int8 rows.
enum Format : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14, kInt8Rows = 1000 };

constexpr int64_t kBlock = 32;
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

inline int64_t row_bytes(int64_t format, int64_t k_size) {
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
inline void widen_block_scalar(const uint8_t* block, float scale, float* out) {
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
inline void widen_superblock(const uint8_t* block, float* out) {
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


template <typename Fn>
inline void with_format(int64_t format, const Fn& fn) {
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

}  // namespace radixserve::quant
