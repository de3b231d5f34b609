// The gated activation of the Llama MLP on CPU in one op: silu(gate) * up over the fused
// gate_up projection's output, where torch dispatches a split, the SiLU and a product into
// a fresh tensor. For bf16/half rows, computed in float and rounded where torch's two ops
// round (after the SiLU, after the product); with AVX-512 the sigmoid's exp is a polynomial
// within a float rounding of libm's and its reciprocal a Newton step within two, so a value
// can round one unit apart from torch's.

#include "vec16.h"

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
#if defined(RADIXSERVE_AVX512)
      // x * sigmoid(x) with the exp taken of -|x| only (never overflowing); below -87 it is
      // -0, where torch's x / (1 + exp(-x)) is under 1e-35 in magnitude (and -0 from -88.8).
      const __m512 one = _mm512_set1_ps(1.0f);
      for (; i < width; i += 16) {
        const __mmask16 mask = radixserve::first_lanes(width - i);
        const __m512 g = radixserve::load16(gate + i, mask);
        const __m512 minus_abs = _mm512_min_ps(g, _mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 e = _mm512_maskz_mov_ps(
            _mm512_cmp_ps_mask(g, _mm512_set1_ps(-87.0f), _CMP_GE_OQ),
            radixserve::exp16_nonpositive(minus_abs));
        const __m512 numerator =
            _mm512_mask_mul_ps(g, _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), g, e);
        // 1 / (1 + e) by the reciprocal estimate and one Newton step (within two float
        // units; a division takes several times as long)
        const __m512 denominator = _mm512_add_ps(one, e);
        const __m512 estimate = _mm512_rcp14_ps(denominator);
        const __m512 reciprocal = _mm512_mul_ps(
            estimate, _mm512_fnmadd_ps(denominator, estimate, _mm512_set1_ps(2.0f)));
        const __m512 activated = radixserve::round16<scalar_t>(_mm512_mul_ps(numerator, reciprocal));
        radixserve::store16(out_row + i,
                            _mm512_mul_ps(activated, radixserve::load16(up + i, mask)), mask);
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("silu_and_mul(Tensor input) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("silu_and_mul", &silu_and_mul);
}
