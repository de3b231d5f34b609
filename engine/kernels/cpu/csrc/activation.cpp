// The gated activation of the Llama MLP on CPU in one op: silu(gate) * up over the fused
// gate_up projection's output, where torch dispatches a split, the SiLU and a product into
// a fresh tensor. For bf16/half rows, computed in float and rounded where torch's two ops
// round (after the SiLU, after the product); on the vector paths the sigmoid's exp is a
// polynomial within a float rounding of libm's (and with AVX-512 its reciprocal a Newton
// step within two), so a value can round one unit apart from torch's.

#include "ops.h"
#include "simd.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace {

// Rows handed to one thread at a time: a decode batch's few rows are cheaper on one thread
// than the wake-up of another.
constexpr int64_t kActivationRowGrain = 16;

template <typename scalar_t>
void silu_and_mul_rows(const scalar_t* x, scalar_t* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, kActivationRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* gate = x + r * 2 * width;
      const scalar_t* up = gate + width;
      scalar_t* out_row = out + r * width;
      int64_t i = 0;
#if defined(RADIXSERVE_SIMD)
      // x * sigmoid(x) with the exp taken of -|x| only (never overflowing); below -87 it is
      // -0, where torch's x / (1 + exp(-x)) is under 1e-35 in magnitude (and -0 from -88.8).
      namespace simd = radixserve::simd;
      const simd::fvec zero = simd::zero();
      for (; i < width; i += simd::kLanes) {
        const int64_t n = width - i;
        const simd::fvec g = simd::load_n(gate + i, n);
        const simd::fvec e =
            simd::select(simd::less(g, simd::set1(-87.0f)), zero,
                         simd::exp_nonpositive(simd::min(g, simd::sub(zero, g))));
        const simd::fvec numerator = simd::select(simd::less(g, zero), simd::mul(g, e), g);
        const simd::fvec activated = simd::round_to<scalar_t>(
            simd::mul(numerator, simd::reciprocal(simd::add(simd::set1(1.0f), e))));
        simd::store_n(out_row + i, simd::mul(activated, simd::load_n(up + i, n)), n);
      }
#endif
      for (; i < width; ++i) {
        const float g = static_cast<float>(gate[i]);
        const float activated = static_cast<float>(static_cast<scalar_t>(g / (1.0f + std::exp(-g))));
        out_row[i] = static_cast<scalar_t>(activated * static_cast<float>(up[i]));
      }
    }
  });
}

}  // namespace

namespace radixserve {

at::Tensor silu_and_mul(const at::Tensor& input) {
  TORCH_CHECK(input.dim() == 2 && input.size(1) % 2 == 0 && input.is_contiguous(),
              "input is a contiguous [T, 2 * d]: gate, then up");
  at::Tensor out = at::empty({input.size(0), input.size(1) / 2}, input.options());
  RADIXSERVE_DISPATCH_FLOAT_16(input.scalar_type(), "radixserve_silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(input.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                out.size(0), out.size(1));
  });
  return out;
}

}  // namespace radixserve
