// Two steps of a decoder layer on CPU at decode sizes, where torch's cost is per-op dispatch
// and memory traffic rather than arithmetic.
//
// rms_norm: the residual add and RMSNorm of 16-bit activations in one op (torch dispatches
// about eight). It computes in float and rounds where transformers' modules round (the sum,
// the normalised row, the product with the weight), so that it differs from them only by the
// order of the float sum of squares.
//
// linear_few_rows: y = x W^T in bf16 for the few rows of a small decode batch, float sums by
// AVX512-BF16 dot products. Each task streams a band of the weight's rows, four at a time,
// with a software prefetch of the next four: at one to four rows the step is the weight's
// memory read, and the prefetch is what brings the read near the machine's bandwidth.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

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
      if (x != nullptr) {
        const scalar_t* x_row = x + r * width;
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) {
          res_row[i] = static_cast<scalar_t>(static_cast<float>(res_row[i]) +
                                             static_cast<float>(x_row[i]));
        }
      }
      float sum_squares = 0.0f;
#pragma omp simd reduction(+ : sum_squares)
      for (int64_t i = 0; i < width; ++i) {
        const float value = static_cast<float>(res_row[i]);
        sum_squares += value * value;
      }
      const float inv_rms = 1.0f / std::sqrt(sum_squares / static_cast<float>(width) + eps);
      scalar_t* out_row = out + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const scalar_t normed = static_cast<scalar_t>(static_cast<float>(res_row[i]) * inv_rms);
        out_row[i] = static_cast<scalar_t>(static_cast<float>(normed) *
                                           static_cast<float>(weight[i]));
      }
    }
  });
}

at::Tensor rms_norm(
    const at::Tensor& input,
    const std::optional<at::Tensor>& residual,
    const at::Tensor& weight,
    double eps) {
  TORCH_CHECK(input.dim() == 2 && input.is_contiguous(), "input is a contiguous [T, hidden]");
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 || input.scalar_type() == at::kHalf,
              "bf16 or half activations");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == input.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == input.scalar_type(),
              "one weight per hidden unit, in the input's dtype");
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == input.sizes() && residual->is_contiguous() &&
                    residual->scalar_type() == input.scalar_type(),
                "the residual is shaped and typed like the input");
  }
  at::Tensor out = at::empty_like(input);
  AT_DISPATCH_REDUCED_FLOATING_TYPES(input.scalar_type(), "radixserve_rms_norm", [&] {
    const scalar_t* x = residual.has_value() ? input.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* sums = residual.has_value() ? residual->data_ptr<scalar_t>()
                                          : const_cast<scalar_t*>(input.const_data_ptr<scalar_t>());
    rms_norm_rows<scalar_t>(x, sums, weight.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            input.size(0), input.size(1), static_cast<float>(eps));
  });
  return out;
}

#if defined(__AVX512BF16__)
using bf16 = at::BFloat16;

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
  at::parallel_for(0, n_size, 64, [&](int64_t begin, int64_t end) {
    int64_t n = begin;
    for (; n + 4 <= end; n += 4) {
      dot_rows<4>(x_ptr, m_size, w_ptr + n * k_size, k_size, out_ptr + n, n_size);
    }
    for (; n < end; ++n) dot_rows<1>(x_ptr, m_size, w_ptr + n * k_size, k_size, out_ptr + n, n_size);
  });
  return out;
#else
  return at::linear(input, weight);  // built for a CPU without bf16 dot products
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("rms_norm(Tensor input, Tensor(a!)? residual, Tensor weight, float eps) -> Tensor");
  m.def("linear_few_rows(Tensor input, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("linear_few_rows", &linear_few_rows);
}
