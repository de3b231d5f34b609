// The block layouts of the weights `quant_linear` multiplies as stored, one table for the
// kernels (engine/model/layers/quantization.py holds the same table for the loader;
// `quant_format_table` hands this one to tests/engine/kernels/cpu/test_registration.py,
// which compares them). A format is GGUF's block type id, or ours for int8 rows
// (`--quantization int8`, one float scale per row).
//
// Each weight row is `K / 32` blocks of 32 weights:
//   Q4_0  18 bytes: half d, 16 bytes of nibbles                     w = d * (q - 8)
//   Q4_1  20 bytes: half d, half m, 16 bytes of nibbles             w = d * q + m
//   Q5_0  22 bytes: half d, 4 bytes of fifth bits, 16 of nibbles    w = d * (q - 16)
//   Q5_1  24 bytes: half d, half m, 4 bytes of fifth bits, 16 of nibbles  w = d * q + m
//   Q8_0  34 bytes: half d, 32 int8                                 w = d * q
//   int8  32 int8 per block, the row's float scale s after its last block: w = s * q
// (in a nibble block, weight j is the low nibble of byte j and weight j + 16 its high one;
// a Q5 block's weight j takes bit j of its little-endian 32-bit word as its fifth bit, 16),
// or `K / 256` super-blocks of 256 weights in 8 or 16 sub-blocks (`widen_superblock`):
//   Q4_K  144 bytes: half d, half dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles
//   Q5_K  176 bytes: Q4_K's header, 32 bytes of fifth bits (sub-block j: bit j), 128 of nibbles
//   Q6_K  210 bytes: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, half d
// The Q5 formats are their Q4 twins plus one high bit a weight: the code reads them as such.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace radixserve::quant {

// GGML's type ids for the block formats, and one of ours for int8 rows.
enum Format : int64_t {
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kInt8Rows = 1000,
};

// Every format, in id order: the table `quant_format_table` hands to the tests.
constexpr int64_t kFormats[] = {kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ8_0, kQ4_K, kQ5_K, kQ6_K, kInt8Rows};

constexpr int64_t kBlock = 32;
constexpr int64_t kSuperBlock = 256;  // weights of a K-quant super-block

constexpr bool is_k_quant(int64_t format) {
  return format == kQ4_K || format == kQ5_K || format == kQ6_K;
}

// K-quants of 8 sub-blocks of 32 nibbles (plus a fifth bit each in Q5_K) with 6-bit factors:
// Q4_1 and Q5_1 blocks, as far as the kernels are concerned (`KSubBlock`).
constexpr bool is_k_nibble(int64_t format) { return format == kQ4_K || format == kQ5_K; }

// Blocks of 32 weights held as nibbles (plus a fifth bit each in Q5_0/Q5_1).
constexpr bool is_nibble_block(int64_t format) {
  return format == kQ4_0 || format == kQ4_1 || format == kQ5_0 || format == kQ5_1;
}

// Formats whose weights carry a fifth bit beside their nibble.
constexpr bool has_fifth_bit(int64_t format) {
  return format == kQ5_0 || format == kQ5_1 || format == kQ5_K;
}

// Nibble blocks that store their offset m (w = d * q + m) rather than a fixed zero point.
constexpr bool has_min(int64_t format) { return format == kQ4_1 || format == kQ5_1; }

// The zero point of Q4_0 and Q5_0 (w = d * (q - zero)): the middle of the integers' range.
constexpr float zero_point(int64_t format) { return format == kQ5_0 ? 16.0f : 8.0f; }

// Where a nibble block's 32-bit word of fifth bits starts, and its 16 bytes of nibbles.
constexpr int64_t fifth_bits_at(int64_t format) { return has_min(format) ? 4 : 2; }
constexpr int64_t nibbles_at(int64_t format) {
  return fifth_bits_at(format) + (has_fifth_bit(format) ? 4 : 0);
}

// Formats whose weights are unsigned integers plus a per-block offset (w = d * q + shift).
constexpr bool has_offset(int64_t format) {
  return is_nibble_block(format) || is_k_nibble(format);
}

constexpr int64_t block_weights(int64_t format) {
  return is_k_quant(format) ? kSuperBlock : kBlock;
}

constexpr int64_t block_bytes(int64_t format) {
  return format == kQ4_0   ? 18
         : format == kQ4_1 ? 20
         : format == kQ5_0 ? 22
         : format == kQ5_1 ? 24
         : format == kQ8_0 ? 34
         : format == kQ4_K ? 144
         : format == kQ5_K ? 176
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

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// A Q5_0/Q5_1 block's fifth bits, bit j for weight j (0 for Q4_0/Q4_1; Q5_K keeps its own in
// bytes, `KSubBlock`).
template <int64_t F>
inline uint32_t fifth_bits(const uint8_t* block) {
  static_assert(is_nibble_block(F));
  if constexpr (has_fifth_bit(F)) return load_u32(block + fifth_bits_at(F));
  return 0;
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
  if constexpr (is_nibble_block(F)) {
    const float d = half_bits(block);
    const float m = has_min(F) ? half_bits(block + 2) : -zero_point(F) * d;
    const uint8_t* qs = block + nibbles_at(F);
    const uint32_t fifth = fifth_bits<F>(block);
    for (int j = 0; j < 16; ++j) {
      const uint32_t low = (qs[j] & 0x0F) | ((fifth >> j) & 1) << 4;
      const uint32_t high = (qs[j] >> 4) | ((fifth >> (j + 16)) & 1) << 4;
      out[j] = static_cast<float>(low) * d + m;
      out[j + 16] = static_cast<float>(high) * d + m;
    }
  } else {
    const float d = F == kQ8_0 ? half_bits(block) : scale;
    const int8_t* qs = reinterpret_cast<const int8_t*>(block + (F == kQ8_0 ? 2 : 0));
    for (int j = 0; j < kBlock; ++j) out[j] = static_cast<float>(qs[j]) * d;
  }
}

// Sub-block j of a Q4_K or Q5_K super-block, w = (d * scale) * q - dmin * min: its 32
// nibbles, the low (j even) or high (j odd) halves of 32 bytes; Q5_K's weight l takes bit j
// of byte l of the 32 after the factors as its fifth bit (`fifth`, nullptr for Q4_K). Its
// two 6-bit factors are decoded on demand (the integer paths load 8 rows' at once).
template <int64_t F>
struct KSubBlock {
  static_assert(is_k_nibble(F));
  static constexpr int64_t kNibblesAt = F == kQ5_K ? 48 : 16;

  const uint8_t* block;
  int j;
  const uint8_t* bytes;
  const uint8_t* fifth;
  int shift;

  KSubBlock(const uint8_t* super_block, int sub_block)
      : block(super_block),
        j(sub_block),
        bytes(super_block + kNibblesAt + sub_block / 2 * 32),
        fifth(F == kQ5_K ? super_block + 16 : nullptr),
        shift(sub_block % 2 * 4) {}

  // d * scale and dmin * min, each rounded as ggml rounds them. The factors are 12 bytes
  // from `s`: scales 0-3 | mins 0-3 | low bits of 4-7, their high bits in the top of the
  // first eight.
  float scale() const {
    const uint8_t* s = block + 4;
    const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    return half_bits(block) * static_cast<float>(sc);
  }
  float min() const {
    const uint8_t* s = block + 4;
    const int m = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    return half_bits(block + 2) * static_cast<float>(m);
  }

  // The integer of weight l, 0..15 (Q4_K) or 0..31 (Q5_K).
  int weight(int l) const {
    const int q = (bytes[l] >> shift) & 0x0F;
    return F == kQ5_K ? q | ((fifth[l] >> j) & 1) << 4 : q;
  }
};

// A K-quant super-block's 256 weights as floats, rounded as ggml's dequantization (and
// gguf-py's) rounds them: the sub-block's scale d * s first, then its product with q.
template <int64_t F>
inline void widen_superblock(const uint8_t* block, float* out) {
  if constexpr (is_k_nibble(F)) {
    for (int j = 0; j < 8; ++j) {
      const KSubBlock<F> sub(block, j);
      const float scale = sub.scale(), min = sub.min();
      for (int l = 0; l < 32; ++l) {
        out[j * 32 + l] = scale * static_cast<float>(sub.weight(l)) - min;
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
    case kQ5_0: fn(std::integral_constant<int64_t, kQ5_0>{}); break;
    case kQ5_1: fn(std::integral_constant<int64_t, kQ5_1>{}); break;
    case kQ8_0: fn(std::integral_constant<int64_t, kQ8_0>{}); break;
    case kQ4_K: fn(std::integral_constant<int64_t, kQ4_K>{}); break;
    case kQ5_K: fn(std::integral_constant<int64_t, kQ5_K>{}); break;
    case kQ6_K: fn(std::integral_constant<int64_t, kQ6_K>{}); break;
    case kInt8Rows: fn(std::integral_constant<int64_t, kInt8Rows>{}); break;
    default: TORCH_CHECK(false, "unknown quantized weight format ", format);
  }
}

}  // namespace radixserve::quant
