// The float register path of `quant_linear`'s decode rows: each block widened to floats in
// registers (F16C for the scale, byte-to-int32-to-float conversions for the weights) and
// multiplied into up to eight rows of x at once (`kTileRows`), a group of weight rows kept
// in L1 across the tiles of x so that the packed weights are read once. With
// `batch_invariant` (--enable-deterministic-inference) every row count takes this path: each
// output is then summed in one order that depends on K alone, the same bits for a row
// whatever rows share the call. Written once over `simd::fvec` for both vector paths.
#pragma once

#include "parallel.h"
#include "quant_formats.h"
#include "simd.h"

#include <cstdint>
#include <vector>

namespace radixserve::quant {

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

#if defined(RADIXSERVE_SIMD)
using radixserve::simd::fvec;
namespace simd = radixserve::simd;
constexpr int kVecs = kBlock / simd::kLanes;  // vectors per block: 2 (AVX-512) or 4 (AVX2)

// The same block widened in registers; equal to the scalar widening (one rounding each).
template <int64_t F>
inline void widen_block(const uint8_t* block, float scale, fvec* w) {
  if constexpr (is_nibble_block(F)) {
    const float d = simd::half_to_float(load_u16(block));
    const float m = has_min(F) ? simd::half_to_float(load_u16(block + 2)) : -zero_point(F) * d;
    if constexpr (has_fifth_bit(F)) {
      simd::widen_nibbles(block + nibbles_at(F), w, simd::fifth_bit_bytes(fifth_bits<F>(block)));
    } else {
      simd::widen_nibbles(block + nibbles_at(F), w);
    }
    const fvec dv = simd::set1(d), mv = simd::set1(m);
    for (int i = 0; i < kVecs; ++i) w[i] = simd::fmadd(w[i], dv, mv);
  } else {
    const float d = F == kQ8_0 ? simd::half_to_float(load_u16(block)) : scale;
    const uint8_t* qs = block + (F == kQ8_0 ? 2 : 0);
    simd::widen_int8(qs, w);
    const fvec dv = simd::set1(d);
    for (int i = 0; i < kVecs; ++i) w[i] = simd::mul(w[i], dv);
  }
}
#endif

// One weight row dequantized to `k_size` floats.
template <int64_t F>
inline void widen_blocks(const uint8_t* row, int64_t k_size, float* out) {
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
inline void widen_row(const uint8_t* row, int64_t k_size, float* out) {
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
inline void gemv_blocks(const float* x, int64_t m_size, int64_t k_size, const uint8_t* weight,
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
inline void gemv_widened(const float* x, int64_t m_size, int64_t k_size, const uint8_t* weight,
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
inline void gemv(const float* x, int64_t m_size, int64_t k_size, const uint8_t* weight,
          int64_t n_size, float* y, bool batch_invariant) {
  if constexpr (is_k_quant(F)) {
    gemv_widened<F>(x, m_size, k_size, weight, n_size, y);
  } else {
    gemv_blocks<F>(x, m_size, k_size, weight, n_size, y, batch_invariant);
  }
}

}  // namespace radixserve::quant
