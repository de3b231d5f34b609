// linear_rows: y = x W^T + b over a plain float, bf16 or half weight, for any number of
// rows, each output one dot product summed over K in a fixed order (two vector chains of
// float FMAs, their sum, the tail, then the bias), whichever rows share the call and
// however the threads split the columns. It is the matmul of unquantized layers under
// --enable-deterministic-inference (quant_linear's register path is the quantized one):
// a library GEMM picks its blocking, and so its order of summation, by the number of rows.
//
// Weight rows go in groups of 16 that stay in L1 while every row of x passes over them,
// four rows of x at a time, so a decode batch reads the weight once.

#include "ops.h"
#include "parallel.h"
#include "simd.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace {

constexpr int64_t kRowsPerGroup = 16;  // weight rows a task multiplies into every row of x
constexpr int64_t kTileRows = 4;  // rows of x per pass over a weight row

// Rows m..m+R of float x (stride k_size) times weight row `w`: y[r * n_size] for each r.
template <typename w_t, int R>
inline void dot_rows(const float* x, int64_t k_size, const w_t* w, float bias, float* y,
                     int64_t n_size) {
  int64_t k = 0;
  float sums[R];
#if defined(RADIXSERVE_SIMD)
  namespace simd = radixserve::simd;
  simd::fvec acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = simd::zero();
  for (int i = 0; k + simd::kLanes <= k_size; k += simd::kLanes, ++i) {
    const simd::fvec weights = simd::load_n(w + k, simd::kLanes);
    for (int r = 0; r < R; ++r) {
      acc[r][i & 1] = simd::fmadd(weights, simd::load(x + r * k_size + k), acc[r][i & 1]);
    }
  }
  for (int r = 0; r < R; ++r) sums[r] = simd::sum(simd::add(acc[r][0], acc[r][1]));
#else
  for (int r = 0; r < R; ++r) sums[r] = 0.0f;
#endif
  for (; k < k_size; ++k) {
    const float weight = static_cast<float>(w[k]);
    for (int r = 0; r < R; ++r) sums[r] += weight * x[r * k_size + k];
  }
  for (int r = 0; r < R; ++r) y[r * n_size] = sums[r] + bias;
}

template <typename w_t>
void linear_rows_kernel(const float* x, int64_t m_size, int64_t k_size, const w_t* w,
                        const float* bias, int64_t n_size, float* y) {
  radixserve::for_each_weight_row_tile(
      m_size, n_size, kRowsPerGroup, kTileRows, [&](int64_t m, int64_t rows, int64_t n, int64_t) {
        const float* xm = x + m * k_size;
        const w_t* row = w + n * k_size;
        const float b = bias == nullptr ? 0.0f : bias[n];
        float* yn = y + m * n_size + n;
        switch (rows) {
          case 1: dot_rows<w_t, 1>(xm, k_size, row, b, yn, n_size); break;
          case 2: dot_rows<w_t, 2>(xm, k_size, row, b, yn, n_size); break;
          case 3: dot_rows<w_t, 3>(xm, k_size, row, b, yn, n_size); break;
          default: dot_rows<w_t, 4>(xm, k_size, row, b, yn, n_size); break;
        }
      });
}

}  // namespace

namespace radixserve {

at::Tensor linear_rows(const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.dim() == 2 && weight.dim() == 2 && input.size(1) == weight.size(1),
              "input [rows, in] and weight [out, in]");
  const at::ScalarType w_type = weight.scalar_type();
  TORCH_CHECK(w_type == at::kFloat || w_type == at::kBFloat16 || w_type == at::kHalf,
              "a float, bf16 or half weight");
  const at::Tensor x = input.to(at::kFloat).contiguous();
  const at::Tensor w = weight.contiguous();
  const int64_t m_size = x.size(0), k_size = x.size(1), n_size = w.size(0);
  std::optional<at::Tensor> b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n_size, "bias [out]");
    b = bias->to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({m_size, n_size}, x.options());
  const float* b_ptr = b.has_value() ? b->const_data_ptr<float>() : nullptr;
  const auto run = [&](auto tag) {
    using w_t = decltype(tag);
    linear_rows_kernel<w_t>(x.const_data_ptr<float>(), m_size, k_size, w.const_data_ptr<w_t>(),
                            b_ptr, n_size, out.data_ptr<float>());
  };
  if (w_type == at::kFloat) {
    run(float{});
  } else if (w_type == at::kBFloat16) {
    run(at::BFloat16{});
  } else {
    run(at::Half{});
  }
  return out.to(input.scalar_type());
}

}  // namespace radixserve
