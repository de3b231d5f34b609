// The gated activations of the MLPs on CPU in one op: act(gate) * up over the fused gate_up
// projection's output, where torch dispatches a split, the activation and a product into a
// fresh tensor. act is SiLU (Llama, Qwen) or GELU with the tanh approximation (Gemma). For
// bf16/half rows, computed in float and rounded where torch's two ops round (after the
// activation, after the product); on the vector paths the exp is a polynomial within a
// float rounding of libm's (and with AVX-512 the reciprocal a Newton step within two), so a
// value can round one unit apart from torch's.

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

struct Silu {
  static float scalar(float g) { return g / (1.0f + std::exp(-g)); }
#if defined(RADIXSERVE_SIMD)
  // x * sigmoid(x) with the exp taken of -|x| only (never overflowing); below -87 it is
  // -0, where torch's x / (1 + exp(-x)) is under 1e-35 in magnitude (and -0 from -88.8).
  static radixserve::simd::fvec vector(radixserve::simd::fvec g) {
    namespace simd = radixserve::simd;
    const simd::fvec zero = simd::zero();
    const simd::fvec e = simd::select(simd::less(g, simd::set1(-87.0f)), zero,
                                      simd::exp_nonpositive(simd::min(g, simd::sub(zero, g))));
    const simd::fvec numerator = simd::select(simd::less(g, zero), simd::mul(g, e), g);
    return simd::mul(numerator, simd::reciprocal(simd::add(simd::set1(1.0f), e)));
  }
#endif
};

// torch's `gelu(x, approximate="tanh")`, x/2 * (1 + tanh(y)) with y = sqrt(2/pi) (x + 0.044715
// x^3), computed as its equal x * sigmoid(2y): where tanh(y) nears -1 the sum 1 + tanh(y)
// cancels (torch's float32 result loses digits there; this form does not), and the exp is
// taken of -2|y| only (never overflowing).
constexpr float kGeluBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluKappa = 0.044715f;

struct GeluTanh {
  static float scalar(float g) {
    const float y = kGeluBeta * (g + kGeluKappa * g * g * g);
    const float e = std::exp(-2.0f * std::fabs(y));
    return g * (y < 0.0f ? e : 1.0f) / (1.0f + e);
  }
#if defined(RADIXSERVE_SIMD)
  static radixserve::simd::fvec vector(radixserve::simd::fvec g) {
    namespace simd = radixserve::simd;
    const simd::fvec zero = simd::zero();
    const simd::fvec one = simd::set1(1.0f);
    const simd::fvec cube = simd::mul(simd::mul(g, g), g);
    const simd::fvec y = simd::mul(simd::set1(kGeluBeta), simd::fmadd(simd::set1(kGeluKappa), cube, g));
    const simd::fvec minus_abs = simd::min(y, simd::sub(zero, y));
    const simd::fvec twice = simd::add(minus_abs, minus_abs);
    const simd::fvec e =
        simd::select(simd::less(twice, simd::set1(-87.0f)), zero, simd::exp_nonpositive(twice));
    const simd::fvec numerator = simd::select(simd::less(y, zero), simd::mul(g, e), g);
    return simd::mul(numerator, simd::reciprocal(simd::add(one, e)));
  }
#endif
};

template <typename Act, typename scalar_t>
void gated_rows(const scalar_t* x, scalar_t* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, kActivationRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* gate = x + r * 2 * width;
      const scalar_t* up = gate + width;
      scalar_t* out_row = out + r * width;
      int64_t i = 0;
#if defined(RADIXSERVE_SIMD)
      namespace simd = radixserve::simd;
      for (; i < width; i += simd::kLanes) {
        const int64_t n = width - i;
        const simd::fvec activated = simd::round_to<scalar_t>(Act::vector(simd::load_n(gate + i, n)));
        simd::store_n(out_row + i, simd::mul(activated, simd::load_n(up + i, n)), n);
      }
#endif
      for (; i < width; ++i) {
        const float activated =
            static_cast<float>(static_cast<scalar_t>(Act::scalar(static_cast<float>(gate[i]))));
        out_row[i] = static_cast<scalar_t>(activated * static_cast<float>(up[i]));
      }
    }
  });
}

template <typename Act>
at::Tensor gated(const at::Tensor& input) {
  TORCH_CHECK(input.dim() == 2 && input.size(1) % 2 == 0 && input.is_contiguous(),
              "input is a contiguous [T, 2 * d]: gate, then up");
  at::Tensor out = at::empty({input.size(0), input.size(1) / 2}, input.options());
  RADIXSERVE_DISPATCH_FLOAT_16(input.scalar_type(), "radixserve_gated_activation", [&] {
    gated_rows<Act, scalar_t>(input.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                              out.size(0), out.size(1));
  });
  return out;
}

}  // namespace

namespace radixserve {

at::Tensor silu_and_mul(const at::Tensor& input) {
  return gated<Silu>(input);
}

at::Tensor gelu_tanh_and_mul(const at::Tensor& input) {
  return gated<GeluTanh>(input);
}

}  // namespace radixserve
