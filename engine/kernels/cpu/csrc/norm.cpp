// The residual add and RMSNorm of 16-bit activations on CPU in one op, where torch
// dispatches about eight. It computes in float and rounds where transformers' modules round
// (the sum, the normalised row, the product with the weight), so that it differs from them
// only by the order of the float sum of squares.

#include "ops.h"
#include "simd.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>

namespace {

// Rows of rms_norm handed to one thread at a time: a decode batch's few rows are cheaper on
// one thread than the wake-up of another.
constexpr int64_t kNormRowGrain = 16;

template <typename scalar_t>
void rms_norm_rows(
    const scalar_t* x,  // nullptr: no residual add, `residual` is the input
    scalar_t* residual,
    const scalar_t* weight,
    scalar_t* out,
    int64_t rows,
    int64_t width,
    float eps) {
  at::parallel_for(0, rows, kNormRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* res_row = residual + r * width;
      const scalar_t* x_row = x == nullptr ? nullptr : x + r * width;
      scalar_t* out_row = out + r * width;
      float sum_squares = 0.0f;
      int64_t i = 0;
#if defined(RADIXSERVE_SIMD)
      namespace simd = radixserve::simd;
      simd::fvec squares = simd::zero();
      for (; i < width; i += simd::kLanes) {
        simd::fvec value = simd::load_n(res_row + i, width - i);
        if (x_row != nullptr) {
          value = simd::round_to<scalar_t>(simd::add(value, simd::load_n(x_row + i, width - i)));
          simd::store_n(res_row + i, value, width - i);
        }
        squares = simd::fmadd(value, value, squares);
      }
      sum_squares = simd::sum(squares);
#endif
      for (; i < width; ++i) {
        if (x_row != nullptr) {
          res_row[i] = static_cast<scalar_t>(static_cast<float>(res_row[i]) +
                                             static_cast<float>(x_row[i]));
        }
        const float value = static_cast<float>(res_row[i]);
        sum_squares += value * value;
      }
      const float inv_rms = 1.0f / std::sqrt(sum_squares / static_cast<float>(width) + eps);
      i = 0;
#if defined(RADIXSERVE_SIMD)
      const simd::fvec scale = simd::set1(inv_rms);
      for (; i < width; i += simd::kLanes) {
        const simd::fvec normed =
            simd::round_to<scalar_t>(simd::mul(simd::load_n(res_row + i, width - i), scale));
        simd::store_n(out_row + i, simd::mul(normed, simd::load_n(weight + i, width - i)),
                      width - i);
      }
#endif
      for (; i < width; ++i) {
        const scalar_t normed = static_cast<scalar_t>(static_cast<float>(res_row[i]) * inv_rms);
        out_row[i] = static_cast<scalar_t>(static_cast<float>(normed) *
                                           static_cast<float>(weight[i]));
      }
    }
  });
}

}  // namespace

namespace radixserve {

at::Tensor rms_norm(
    const at::Tensor& input,
    const std::optional<at::Tensor>& residual,
    const at::Tensor& weight,
    double eps) {
  TORCH_CHECK(input.dim() == 2 && input.is_contiguous(), "input is a contiguous [T, hidden]");
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 || input.scalar_type() == at::kHalf ||
                  input.scalar_type() == at::kFloat,
              "bf16, half or float activations");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == input.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == input.scalar_type(),
              "one weight per hidden unit, in the input's dtype");
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == input.sizes() && residual->is_contiguous() &&
                    residual->scalar_type() == input.scalar_type(),
                "the residual is shaped and typed like the input");
  }
  at::Tensor out = at::empty_like(input);
  RADIXSERVE_DISPATCH_FLOAT_16(input.scalar_type(), "radixserve_rms_norm", [&] {
    const scalar_t* x = residual.has_value() ? input.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* sums = residual.has_value() ? residual->data_ptr<scalar_t>()
                                          : const_cast<scalar_t*>(input.const_data_ptr<scalar_t>());
    rms_norm_rows<scalar_t>(x, sums, weight.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            input.size(0), input.size(1), static_cast<float>(eps));
  });
  return out;
}

}  // namespace radixserve
