// Rotary embedding of q and k on CPU in one op, in place, where torch dispatches four
// (a roll, two products, a sum). Each product and the sum are rounded to the activations'
// dtype, exactly as those ops round, so the result is theirs bit for bit (the library is
// built without contracting a product and a sum into one fused multiply-add).

#include "ops.h"
#include "simd.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

namespace {

// Tokens handed to one thread at a time: a decode batch's few rows are cheaper on one
// thread than the wake-up of another.
constexpr int64_t kRotaryTokenGrain = 64;

// x * cos + rotate_half(x) * sin for each head of each token's row of `qk`, where
// `cos_sin` holds, per token, cos then sin with its first half negated (so that rotating
// half is a plain swap of the two halves).
template <typename scalar_t>
void rotate_rows(scalar_t* qk, int64_t tokens, int64_t heads, int64_t head_dim,
                 int64_t token_stride, const scalar_t* cos_sin) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, tokens, kRotaryTokenGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* cos = cos_sin + t * 2 * head_dim;
      const scalar_t* sin = cos + head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* x = qk + t * token_stride + h * head_dim;
        int64_t i = 0;
#if defined(RADIXSERVE_SIMD)
        namespace simd = radixserve::simd;
        const auto product = [](simd::fvec a, simd::fvec b) {
          return simd::round_to<scalar_t>(simd::mul(a, b));
        };
        for (; i < half; i += simd::kLanes) {
          const int64_t n = half - i;
          const simd::fvec low = simd::load_n(x + i, n), high = simd::load_n(x + i + half, n);
          const simd::fvec new_low = simd::add(product(low, simd::load_n(cos + i, n)),
                                               product(high, simd::load_n(sin + i, n)));
          const simd::fvec new_high = simd::add(product(high, simd::load_n(cos + i + half, n)),
                                                product(low, simd::load_n(sin + i + half, n)));
          simd::store_n(x + i, new_low, n);
          simd::store_n(x + i + half, new_high, n);
        }
#endif
        const auto rounded = [](float v) { return static_cast<float>(static_cast<scalar_t>(v)); };
        for (; i < half; ++i) {
          const float low = static_cast<float>(x[i]), high = static_cast<float>(x[i + half]);
          const float new_low = rounded(low * static_cast<float>(cos[i])) +
                                rounded(high * static_cast<float>(sin[i]));
          const float new_high = rounded(high * static_cast<float>(cos[i + half])) +
                                 rounded(low * static_cast<float>(sin[i + half]));
          x[i] = static_cast<scalar_t>(new_low);
          x[i + half] = static_cast<scalar_t>(new_high);
        }
      }
    }
  });
}

template <typename scalar_t>
void rotate(at::Tensor& qk, const at::Tensor& cos_sin) {
  rotate_rows<scalar_t>(qk.data_ptr<scalar_t>(), qk.size(0), qk.size(1), qk.size(2),
                        qk.stride(0), cos_sin.const_data_ptr<scalar_t>());
}

}  // namespace

namespace radixserve {

// float32, bf16 or half (a product of two 16-bit values is exact in float).
void rotary(at::Tensor& qk, const at::Tensor& cos_sin) {
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2) &&
                  qk.size(2) % 2 == 0,
              "qk is [T, heads, head_dim] with whole heads side by side in each row");
  TORCH_CHECK(cos_sin.is_contiguous() && cos_sin.numel() == qk.size(0) * 2 * qk.size(2) &&
                  cos_sin.scalar_type() == qk.scalar_type(),
              "cos_sin is [T, 2, 1, head_dim] in qk's dtype");
  AT_DISPATCH_SWITCH(qk.scalar_type(), "radixserve_rotary",
                     AT_DISPATCH_CASE(at::kFloat, [&] { rotate<scalar_t>(qk, cos_sin); })
                     AT_DISPATCH_CASE(at::kBFloat16, [&] { rotate<scalar_t>(qk, cos_sin); })
                     AT_DISPATCH_CASE(at::kHalf, [&] { rotate<scalar_t>(qk, cos_sin); }));
}

}  // namespace radixserve
