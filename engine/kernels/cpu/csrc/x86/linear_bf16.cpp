// Matmuls of bf16 decode rows on CPU, where oneDNN's packed kernels pay a fixed cost per
// call and read small weights well below the machine's bandwidth (docs/benchmarks/model.md).
//
// linear_amx: y = x W^T on AMX tiles, for any number of rows, over a copy of the weight
// packed once (amx_pack, zero-padded to whole tiles) so that each task streams one
// contiguous band of it. A task owns 64 output columns: four 16 x 16 float accumulator
// tiles, each step multiplying a 16-row x 32-deep tile of x (rows and depth past the end
// are zero padding) by four 32 x 16 weight tiles; columns past N are never written. From
// 64 rows (prefill) two row tiles share each weight tile, half a band at a time.
// While the first row block streams the band, it touches every eighth cache line two steps
// ahead, which keeps the hardware prefetcher's streams running; later row blocks find the
// band in L2.
//
// linear_few_rows: x W^T over the plain weight for the one or two rows of the smallest
// decode batches (FEW_ROWS in ops.py), where it beats both the AMX kernel and
// oneDNN: 32 products per AVX512-BF16 instruction, four weight rows at a time with a
// software prefetch of the next four.

#include "ops.h"
#include "x86/amx.h"
#include "parallel.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

using bf16 = at::BFloat16;

using radixserve::kAmxDepth, radixserve::kAmxRows, radixserve::round_up;

constexpr int64_t kAmxCols = 64;   // output columns of one task step: four 16-column tiles
constexpr int64_t kPairedRows = 64;  // from this many rows, two row tiles per weight tile
constexpr int64_t kFewRowsBlock = 64;  // weight rows the few-rows kernel claims as one task

#if defined(RADIXSERVE_AMX)
using radixserve::amx_permitted, radixserve::configure_tiles, radixserve::zero_accumulators;

// Tile 4 holds rows of x (16 x 32 bf16), 5-7 weight tiles (16 pairs of depth x 16 columns x
// 2), next to the accumulators 0-3.

// `rows` rows of float sums (row stride `stride`) plus `bias` (float, or null), rounded to
// nearest even as torch does, into `y` (stride `n_size`): the first `cols` columns, the rest
// being the padding of a weight whose N is not a multiple of 64.
void store_sums(const float* sums, int64_t stride, int64_t rows, int64_t cols,
                const float* bias, bf16* y, int64_t n_size) {
  for (int64_t c = 0; c < cols; c += 32) {
    const int64_t valid = std::min<int64_t>(32, cols - c);
    const __mmask32 mask = valid == 32 ? ~__mmask32(0) : static_cast<__mmask32>((1u << valid) - 1);
    __m512 bias_low = _mm512_setzero_ps(), bias_high = _mm512_setzero_ps();
    if (bias != nullptr) {
      bias_low = _mm512_maskz_loadu_ps(static_cast<__mmask16>(mask), bias + c);
      bias_high = _mm512_maskz_loadu_ps(static_cast<__mmask16>(mask >> 16), bias + c + 16);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 low = _mm512_add_ps(_mm512_load_ps(sums + r * stride + c), bias_low);
      const __m512 high = _mm512_add_ps(_mm512_load_ps(sums + r * stride + c + 16), bias_high);
      _mm512_mask_storeu_epi16(y + r * n_size + c, mask, (__m512i)_mm512_cvtne2ps_pbh(high, low));
    }
  }
}

constexpr int64_t kTile = kAmxDepth * 16;  // bf16 elements of one weight tile

// Touches every eighth cache line of the weight tiles two steps ahead of `tiles`.
inline void prefetch_ahead(const bf16* tiles) {
  const char* ahead = reinterpret_cast<const char*>(tiles + 8 * kTile);
  for (int line = 0; line < 128; line += 8) _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
}

// One task step: 16 rows of x (`x`, stride `k_size`) against one 64-column band (`band`:
// k_size / 32 steps of four 1 KiB weight tiles), plus the band's `bias`, into `y`: the
// first `rows` rows and `cols` columns kept.
void amx_band(const bf16* x, int64_t k_size, const bf16* band, const float* bias,
              bool prefetch, int64_t rows, int64_t cols, bf16* y, int64_t n_size) {
  zero_accumulators();
  for (int64_t step = 0; step < k_size / kAmxDepth; ++step) {
    const bf16* tiles = band + step * 4 * kTile;
    if (prefetch) prefetch_ahead(tiles);
    radixserve::multiply_four_tiles(x + step * kAmxDepth, k_size * sizeof(bf16), tiles,
                                    kTile * sizeof(bf16));
  }
  alignas(64) float sums[kAmxRows * kAmxCols];
  radixserve::store_accumulators(sums, kAmxCols);
  store_sums(sums, kAmxCols, rows, cols, bias, y, n_size);
}

// The same for 32 rows of x (two row tiles: `x` and `x_next`), a 32-column half of the band
// at a time: each
// weight tile then feeds two row tiles, four tile loads for four products instead of five
// (from kPairedRows rows: prefill, where the band is read from L2 again for every pair).
void amx_band_pair(const bf16* x, const bf16* x_next, int64_t k_size, const bf16* band,
                   const float* bias, bool prefetch, int64_t rows, int64_t cols, bf16* y,
                   int64_t n_size) {
  constexpr int64_t kHalf = kAmxCols / 2;
  for (int64_t half = 0; half * kHalf < cols; ++half) {
    zero_accumulators();
    for (int64_t step = 0; step < k_size / kAmxDepth; ++step) {
      const bf16* tiles = band + step * 4 * kTile;
      if (prefetch && half == 0) prefetch_ahead(tiles);
      tiles += half * 2 * kTile;
      _tile_loadd(4, x + step * kAmxDepth, k_size * sizeof(bf16));
      _tile_loadd(6, tiles, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(5, x_next + step * kAmxDepth, k_size * sizeof(bf16));
      _tile_dpbf16ps(2, 5, 6);
      _tile_loadd(7, tiles + kTile, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
    alignas(64) float sums[2 * kAmxRows * kHalf];
    _tile_stored(0, sums, kHalf * sizeof(float));
    _tile_stored(1, sums + 16, kHalf * sizeof(float));
    _tile_stored(2, sums + kAmxRows * kHalf, kHalf * sizeof(float));
    _tile_stored(3, sums + kAmxRows * kHalf + 16, kHalf * sizeof(float));
    store_sums(sums, kHalf, rows, std::min(kHalf, cols - half * kHalf),
               bias == nullptr ? nullptr : bias + half * kHalf, y + half * kHalf, n_size);
  }
}
#endif

#if defined(__AVX512BF16__)
// ROWS rows of x against NR consecutive weight rows: ROWS x NR float sums in registers, 32
// products per instruction, the K tail by masked loads. Prefetches the next NR weight rows
// at the same offsets.
template <int ROWS, int NR>
inline void dot_tile(const bf16* x, int64_t k_size, const bf16* w, bf16* y, int64_t n_size) {
  __m512 acc[ROWS][NR];
#pragma GCC unroll 4
  for (int m = 0; m < ROWS; ++m) {
#pragma GCC unroll 4
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < k_size; k += 32) {
    const __mmask32 mask =
        k + 32 <= k_size ? ~__mmask32(0) : static_cast<__mmask32>((1u << (k_size - k)) - 1);
    __m512i weights[NR];
#pragma GCC unroll 4
    for (int n = 0; n < NR; ++n) {
      weights[n] = _mm512_maskz_loadu_epi16(mask, w + n * k_size + k);
      _mm_prefetch(reinterpret_cast<const char*>(w + (n + NR) * k_size + k), _MM_HINT_T0);
    }
#pragma GCC unroll 4
    for (int m = 0; m < ROWS; ++m) {
      const __m512i row = _mm512_maskz_loadu_epi16(mask, x + m * k_size + k);
#pragma GCC unroll 4
      for (int n = 0; n < NR; ++n) {
        acc[m][n] = _mm512_dpbf16_ps(acc[m][n], (__m512bh)row, (__m512bh)weights[n]);
      }
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < ROWS; ++m) {
#pragma GCC unroll 4
    for (int n = 0; n < NR; ++n) y[m * n_size + n] = bf16(_mm512_reduce_add_ps(acc[m][n]));
  }
}

// Every row of x against weight rows [n, n + NR), four rows of x at a time: the weight rows
// stay in L1 across the row blocks.
template <int NR>
void dot_rows(const bf16* x, int64_t m_size, const bf16* w, int64_t k_size, bf16* y,
              int64_t n_size) {
  int64_t m = 0;
  for (; m + 4 <= m_size; m += 4) dot_tile<4, NR>(x + m * k_size, k_size, w, y + m * n_size, n_size);
  const bf16* x_rest = x + m * k_size;
  bf16* y_rest = y + m * n_size;
  switch (m_size - m) {
    case 3: dot_tile<3, NR>(x_rest, k_size, w, y_rest, n_size); break;
    case 2: dot_tile<2, NR>(x_rest, k_size, w, y_rest, n_size); break;
    case 1: dot_tile<1, NR>(x_rest, k_size, w, y_rest, n_size); break;
    default: break;
  }
}
#endif

}  // namespace

namespace radixserve {

bool amx_available() {
#if defined(RADIXSERVE_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

// [N, K] -> [N / 64][K / 32][4 tiles][16 pairs of depth][16 columns][2], N and K first
// padded with zeros to whole bands and tile steps: a task's band is contiguous, each weight
// tile in the layout tdpbf16ps reads.
at::Tensor amx_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "a bf16 [N, K] weight");
  const int64_t n_size = round_up(weight.size(0), kAmxCols);
  const int64_t k_size = round_up(weight.size(1), kAmxDepth);
  return at::constant_pad_nd(weight, {0, k_size - weight.size(1), 0, n_size - weight.size(0)})
      .reshape({n_size / kAmxCols, 4, 16, k_size / kAmxDepth, 16, 2})
      .permute({0, 3, 1, 4, 2, 5})
      .contiguous();
}

at::Tensor linear_amx(const at::Tensor& input, const at::Tensor& packed, int64_t n_size,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.dim() == 2 && input.scalar_type() == at::kBFloat16, "bf16 input [rows, K]");
  const int64_t m_size = input.size(0), k_size = round_up(input.size(1), kAmxDepth);
  TORCH_CHECK(packed.dim() == 6 && packed.size(1) * kAmxDepth == k_size &&
                  round_up(n_size, kAmxCols) == packed.size(0) * kAmxCols,
              "a weight from amx_pack of [out_features, the input's K]");
#if defined(RADIXSERVE_AMX)
  TORCH_CHECK(amx_permitted(), "the kernel may not use AMX here");
  // K padded with zeros to whole tile steps (a weight of odd width: LoRA's B), the rows past
  // the last whole tile copied into a zero-padded tile of their own.
  const at::Tensor x = k_size == input.size(1)
                           ? input.contiguous()
                           : at::constant_pad_nd(input, {0, k_size - input.size(1)});
  const int64_t whole_rows = m_size / kAmxRows * kAmxRows;
  const int64_t padded = round_up(m_size, kAmxRows);
  const bf16* x_ptr = x.const_data_ptr<bf16>();
  std::vector<bf16> tail(padded > m_size ? kAmxRows * k_size : 0);  // zeros
  std::copy_n(x_ptr + whole_rows * k_size, (m_size - whole_rows) * k_size, tail.data());
  const auto row_tile = [&](int64_t row) {
    return row < whole_rows ? x_ptr + row * k_size : tail.data();
  };
  at::Tensor out = at::empty({m_size, n_size}, input.options());
  const bf16* w_ptr = packed.const_data_ptr<bf16>();
  bf16* out_ptr = out.data_ptr<bf16>();
  std::vector<float> bias_float;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n_size && bias->scalar_type() == at::kBFloat16,
                "one bf16 bias per output feature");
    const at::Tensor b = bias->contiguous();
    bias_float.assign(b.const_data_ptr<bf16>(), b.const_data_ptr<bf16>() + n_size);
  }
  const float* bias_ptr = bias.has_value() ? bias_float.data() : nullptr;
  const int64_t band_size = k_size * kAmxCols;
  // Pairs of row tiles from 64 rows (prefill): a decode batch streams each band once from
  // memory, which the single row tile's step does best.
  const bool paired = padded >= kPairedRows;
  const int64_t bands = packed.size(0);
  const auto work = [&](auto& queue) {
    configure_tiles();
    for (int64_t begin, end; queue.claim(begin, end);) {
      for (int64_t band = begin; band < end; ++band) {
        const float* band_bias = bias_ptr == nullptr ? nullptr : bias_ptr + band * kAmxCols;
        const int64_t cols = std::min(kAmxCols, n_size - band * kAmxCols);
        int64_t row = 0;
        for (; paired && row + 2 * kAmxRows <= padded; row += 2 * kAmxRows) {
          amx_band_pair(row_tile(row), row_tile(row + kAmxRows), k_size, w_ptr + band * band_size,
                        band_bias, row == 0, std::min(2 * kAmxRows, m_size - row), cols,
                        out_ptr + row * n_size + band * kAmxCols, n_size);
        }
        for (; row < padded; row += kAmxRows) {
          amx_band(row_tile(row), k_size, w_ptr + band * band_size, band_bias, row == 0,
                   std::min(kAmxRows, m_size - row), cols,
                   out_ptr + row * n_size + band * kAmxCols, n_size);
        }
      }
    }
    _tile_release();
  };
  radixserve::parallel_claim(bands, radixserve::chunk_for(bands), work);
  return out;
#else
  TORCH_CHECK(false, "built without AMX");
#endif
}

at::Tensor linear_few_rows(const at::Tensor& input, const at::Tensor& weight) {
  TORCH_CHECK(input.dim() == 2 && weight.dim() == 2 && input.size(1) == weight.size(1),
              "input [rows, in] and weight [out, in]");
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "bf16 input and weight");
#if defined(__AVX512BF16__)
  const at::Tensor x = input.contiguous();
  const at::Tensor w = weight.contiguous();
  const int64_t m_size = x.size(0), k_size = x.size(1), n_size = w.size(0);
  at::Tensor out = at::empty({m_size, n_size}, x.options());
  const bf16* x_ptr = x.const_data_ptr<bf16>();
  const bf16* w_ptr = w.const_data_ptr<bf16>();
  bf16* out_ptr = out.data_ptr<bf16>();
  const int64_t blocks = (n_size + kFewRowsBlock - 1) / kFewRowsBlock;  // of weight rows
  radixserve::parallel_claim(blocks, radixserve::chunk_for(blocks), [&](auto& queue) {
    for (int64_t first, last; queue.claim(first, last);) {
      const int64_t end = std::min(n_size, last * kFewRowsBlock);
      int64_t n = first * kFewRowsBlock;
      for (; n + 4 <= end; n += 4) {
        dot_rows<4>(x_ptr, m_size, w_ptr + n * k_size, k_size, out_ptr + n, n_size);
      }
      for (; n < end; ++n) {
        dot_rows<1>(x_ptr, m_size, w_ptr + n * k_size, k_size, out_ptr + n, n_size);
      }
    }
  });
  return out;
#else
  return at::linear(input, weight);  // built for a CPU without bf16 dot products
#endif
}

}  // namespace radixserve
