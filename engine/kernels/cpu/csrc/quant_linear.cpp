// Matmuls over weights kept quantized (quant_formats.h has the layouts). Few rows (decode),
// by `activation_bits`: 32 widens each block to floats in registers (quant_gemv.h); 16 and 8
// round x per block of 32 to integers and multiply integers (x86/quant_integer.h). More rows
// (prefill): bands of the weight are widened once into a float block and multiplied by the
// CPU's GEMM (oneDNN/MKL through at::mm), the band reused for every row of x. With
// `batch_invariant` every row count takes the float register path (the GEMM's order changes
// with the rows, and the integer path rounds x).

#include "ops.h"
#include "parallel.h"
#include "quant_formats.h"
#include "quant_gemv.h"
#if defined(RADIXSERVE_SIMD)
#include "x86/quant_integer.h"
#endif

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

using namespace radixserve::quant;

// Up to this many rows of x, integer activations where asked for (the integer tiles take up
// to four rows of x per pass over eight weight rows); beyond, a block widened once to floats
// for four rows of x costs about as much as the integer products' per-block scaling, except
// for the K-quants, whose 6-bit factors make widening the dearer of the two at every row
// count of the register path (docs/benchmarks/gemma3.md).
constexpr int64_t integer_rows(int64_t format) { return is_k_quant(format) ? kGemvRows : 2; }

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

void check_weight(const at::Tensor& weight, int64_t format, int64_t k_size) {
  TORCH_CHECK(k_size % block_weights(format) == 0, "the input width is a multiple of ",
              block_weights(format), ", got ", k_size);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous() &&
                  weight.size(1) == row_bytes(format, k_size),
              "uint8 weight rows of ", row_bytes(format, k_size), " bytes");
}

// Weight rows widened per band: about this many bytes of floats, reused for every row of x.
constexpr int64_t kBandBytes = 2 << 20;

// Prefill rows: bands of the weight widened once into a float block of about kBandBytes and
// multiplied by the CPU's GEMM, each band reused for every row of x.
at::Tensor gemm_bands(const at::Tensor& x, const uint8_t* w_ptr, int64_t format, int64_t n_size) {
  const int64_t k_size = x.size(1);
  at::Tensor out = at::empty({x.size(0), n_size}, x.options());
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
  return out;
}

}  // namespace

namespace radixserve {

at::Tensor quant_dequantize(const at::Tensor& weight, int64_t format, int64_t k_size) {
  check_weight(weight, format, k_size);
  at::Tensor out = at::empty({weight.size(0), k_size}, weight.options().dtype(at::kFloat));
  with_format(format, [&](auto f) {
    widen_rows<decltype(f)::value>(weight.const_data_ptr<uint8_t>(), k_size, 0, weight.size(0),
                                   out.data_ptr<float>());
  });
  return out;
}

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
  if (m_size > kGemvRows && !batch_invariant) {
    at::Tensor out = gemm_bands(input.contiguous(), w_ptr, format, n_size);
    if (bias.has_value()) out.add_(*bias);
    return out;
  }
  const at::Tensor x = input.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({m_size, n_size}, x.options());
  const float* x_ptr = x.const_data_ptr<float>();
  float* y_ptr = out.data_ptr<float>();
  with_format(format, [&](auto f) {
    constexpr int64_t F = decltype(f)::value;
#if defined(RADIXSERVE_SIMD)
    if (m_size <= integer_rows(F) && activation_bits != 32) {
      const auto integer = activation_bits == 16 ? &gemv_integer<F, int16_t>
                                                 : &gemv_integer<F, int8_t>;
      integer(x_ptr, m_size, k_size, w_ptr, n_size, y_ptr);
      return;
    }
#endif
    gemv<F>(x_ptr, m_size, k_size, w_ptr, n_size, y_ptr, batch_invariant);
  });
  if (bias.has_value()) out.add_(*bias);
  return out.to(input.scalar_type());
}

// Each format as (id, weights per block, bytes per block, bytes after a row's blocks).
std::vector<int64_t> quant_format_table() {
  std::vector<int64_t> table;
  for (const int64_t format : kFormats) {
    const int64_t weights = block_weights(format);
    table.insert(table.end(), {format, weights, block_bytes(format),
                               row_bytes(format, weights) - block_bytes(format)});
  }
  return table;
}

}  // namespace radixserve
