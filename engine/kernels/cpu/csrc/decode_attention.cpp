// Decode attention on CPU that reads each key and value in place in the KV pool.
//
// A task takes one request (or one KV head of it): its query heads score every key of the
// request's context (one pass over the keys, each read once for all the query heads that
// share it), take a softmax in the accumulation type (float for bf16/half/float, double for
// double), and sum the values weighted by it. The pool holds the queries' type, or 16 bits
// under float queries (`--kv-cache-dtype`: half the bytes to read). Nothing is gathered: `slots[r, j]` names the
// pool slot of request r's j-th token, and only the first `seq_lens[r]` of them are read;
// with a sliding `window` (> 0), only the last `window` of those.
//
// On the vector paths (simd.h: 16 float lanes with AVX-512, 8 with AVX2) and float
// accumulation, keys and values go in blocks of one vector's lanes of tokens, read from the
// pool in place: a query head's dot products with the block run as independent chains and
// share one reduction (with AVX512-BF16, bf16 keys as stored, 32 products per instruction;
// others widened to float in registers), the block's values are fetched into L2 meanwhile,
// and the weighted sums of up to 4 query heads (as many as half the registers hold) stay
// in registers across a block of values. The softmax's max and exp take a vector of scores
// at a time. Builds without a vector path, double and other head sizes take the plain
// loops, which also score the keys after the last full block: their dot products and
// weighted sums vectorize (omp simd).

#include "ops.h"
#include "parallel.h"
#include "simd.h"

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

// How far ahead a task prefetches its keys and values: slots are scattered over the pool,
// so the hardware prefetcher cannot guess the next row.
constexpr int64_t kPrefetchDistance = 4;

// The values of a block of keys are fetched into L2 while the keys are scored: the value
// pass then finds them there, and the two streams overlap their wait for memory.
template <typename scalar_t>
inline void prefetch_to_l2(const scalar_t* row, int64_t width) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t byte = 0; byte < width * static_cast<int64_t>(sizeof(scalar_t)); byte += 64) {
    __builtin_prefetch(bytes + byte, 0, 2);  // locality 2: into L2
  }
}

// One task's slice of token j's row of a KV buffer, in place. The slice of token
// j + kPrefetchDistance is prefetched on the way.
template <typename scalar_t>
const scalar_t* locate_token(
    const scalar_t* buffer,
    const int64_t* slots,
    int64_t j,
    int64_t len,
    int64_t token_stride,
    int64_t width) {
  if (j + kPrefetchDistance < len) {
    const char* ahead =
        reinterpret_cast<const char*>(buffer + slots[j + kPrefetchDistance] * token_stride);
    for (int64_t byte = 0; byte < width * static_cast<int64_t>(sizeof(scalar_t)); byte += 64) {
      __builtin_prefetch(ahead + byte);
    }
  }
  return buffer + slots[j] * token_stride;
}

// The same slice in the accumulation type: in place when the buffer already holds it, else
// converted into `converted`.
template <typename scalar_t, typename acc_t>
const acc_t* load_token(
    const scalar_t* buffer,
    const int64_t* slots,
    int64_t j,
    int64_t len,
    int64_t token_stride,
    int64_t width,
    acc_t* converted) {
  const scalar_t* token = locate_token(buffer, slots, j, len, token_stride, width);
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    return token;
  } else {
#pragma omp simd
    for (int64_t d = 0; d < width; ++d) converted[d] = static_cast<acc_t>(token[d]);
    return converted;
  }
}

#if defined(RADIXSERVE_SIMD)
namespace simd = radixserve::simd;
using simd::fvec;
constexpr int kBlockKeys = simd::kLanes;  // keys scored per block: one vector of scores

// Scores of one query head against kBlockKeys keys (`keys[t]`, head_dim floats each, a
// multiple of kLanes): one fused multiply-add per kLanes dims and key, and one shared
// reduction for the dot products.
template <typename scalar_t>
inline void score_block(
    const float* query, const scalar_t* const* keys, int64_t head_dim, float* scores) {
  fvec dots[kBlockKeys];  // independent chains: the keys' loads overlap
  for (int t = 0; t < kBlockKeys; ++t) dots[t] = simd::zero();
  for (int64_t d = 0; d < head_dim; d += simd::kLanes) {
    const fvec q = simd::load(query + d);
    for (int t = 0; t < kBlockKeys; ++t) {
      dots[t] = simd::fmadd(q, simd::load_n(keys[t] + d, simd::kLanes), dots[t]);
    }
  }
  simd::store(scores, simd::sum_lanes(dots));
}


// Adds `scores[g * score_stride + t] * values[t]` over the `count` value rows (head_dim =
// kLanes * CHUNKS floats each, at `offset` in each row) to `sums[g]` for G query heads: the
// G x CHUNKS running sums stay in registers across the rows.
template <int CHUNKS, int G, typename scalar_t>
void add_weighted_values(
    const scalar_t* const* values, int64_t count, int64_t offset, const float* scores,
    int64_t score_stride, float* sums) {
  constexpr int kWidth = CHUNKS * simd::kLanes;
  fvec acc[G][CHUNKS];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < CHUNKS; ++c) acc[g][c] = simd::load(sums + g * kWidth + c * simd::kLanes);
  }
  for (int64_t t = 0; t < count; ++t) {
    fvec p[G];
    for (int g = 0; g < G; ++g) p[g] = simd::set1(scores[g * score_stride + t]);
    for (int c = 0; c < CHUNKS; ++c) {
      const fvec v = simd::load_n(values[t] + offset + c * simd::kLanes, simd::kLanes);
      for (int g = 0; g < G; ++g) acc[g][c] = simd::fmadd(p[g], v, acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < CHUNKS; ++c) simd::store(sums + g * kWidth + c * simd::kLanes, acc[g][c]);
  }
}

template <int CHUNKS, typename scalar_t>
void add_weighted_values_heads(
    int64_t heads, const scalar_t* const* values, int64_t count, int64_t offset,
    const float* scores, int64_t score_stride, float* sums) {
  // Query heads per pass: their sums in at most half the vector registers.
  constexpr int kMaxHeads = std::clamp(simd::kRegisters / 2 / CHUNKS, 1, 4);
  for (int64_t g = 0; g < heads; g += kMaxHeads) {
    const float* head_scores = scores + g * score_stride;
    float* head_sums = sums + g * CHUNKS * simd::kLanes;
    switch (std::min<int64_t>(kMaxHeads, heads - g)) {
      case 1:
        add_weighted_values<CHUNKS, 1>(values, count, offset, head_scores, score_stride, head_sums);
        break;
      case 2:
        add_weighted_values<CHUNKS, 2>(values, count, offset, head_scores, score_stride, head_sums);
        break;
      case 3:
        add_weighted_values<CHUNKS, 3>(values, count, offset, head_scores, score_stride, head_sums);
        break;
      default:
        add_weighted_values<CHUNKS, 4>(values, count, offset, head_scores, score_stride, head_sums);
    }
  }
}
#endif

// `scalar_t` is the queries' and output's type, `kv_t` the pool's: the same, or 16-bit
// under float queries (the keys and values widened in registers).
template <typename scalar_t, typename kv_t>
void decode_attention_kernel(
    const at::Tensor& q,
    const at::Tensor& k_buffer,
    const at::Tensor& v_buffer,
    const at::Tensor& slots,
    const int64_t* slot_index,
    const at::Tensor& seq_lens,
    double scaling,
    int64_t window,
    at::Tensor& out) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t num_reqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_buffer.size(1);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_len = slots.size(1);
  // A task is one request's KV heads, all of them when there are enough requests to keep
  // every thread busy (each token's row of the pool is then read once, contiguously),
  // else one KV head each.
  const int64_t heads_per_task =
      num_reqs >= 2 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t tasks_per_req = num_kv_heads / heads_per_task;
  const int64_t task_heads = heads_per_task * group;  // query heads of one task
  const int64_t task_dim = heads_per_task * head_dim;  // K/V elements of one task per token
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const kv_t* k_ptr = k_buffer.data_ptr<kv_t>();
  const kv_t* v_ptr = v_buffer.data_ptr<kv_t>();
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  const int64_t* len_ptr = seq_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t token_stride = num_kv_heads * head_dim;

  radixserve::parallel_claim(num_reqs * tasks_per_req, 1, [&](auto& queue) {
    std::vector<acc_t> queries(task_heads * head_dim), sums(task_heads * head_dim);
    std::vector<acc_t> converted(task_dim), scores(task_heads * max_len);
    for (int64_t task, last; queue.claim(task, last);) {  // one task per chunk
      const int64_t r = task / tasks_per_req;
      const int64_t first_head = (task % tasks_per_req) * heads_per_task;
      const int64_t seq_len = std::clamp<int64_t>(len_ptr[r], 0, max_len);
      // Under a sliding window the row starts at the window's first key: the slots before
      // it (which may be freed, their entries stale) are never read.
      const int64_t first = window > 0 ? std::max<int64_t>(seq_len - window, 0) : 0;
      const int64_t len = seq_len - first;
      const int64_t* row =
          slot_ptr + (slot_index == nullptr ? r : slot_index[r]) * max_len + first;
      const int64_t offset = first_head * head_dim;  // of this task's heads in a token row
      const scalar_t* q_row = q_ptr + (r * num_heads + first_head * group) * head_dim;
      for (int64_t i = 0; i < task_heads * head_dim; ++i) {
        queries[i] = static_cast<acc_t>(q_row[i]) * static_cast<acc_t>(scaling);
      }
      int64_t scored = 0;  // keys scored so far
#if defined(RADIXSERVE_SIMD)
      if constexpr (std::is_same_v<acc_t, float>) {
        if (head_dim % simd::kLanes == 0) {  // blocks of keys, for every query head at once
          for (; scored + kBlockKeys <= len; scored += kBlockKeys) {
            const kv_t* keys[kBlockKeys];
            for (int t = 0; t < kBlockKeys; ++t) {
              keys[t] = locate_token(k_ptr + offset, row, scored + t, len, token_stride, task_dim);
              prefetch_to_l2(v_ptr + offset + row[scored + t] * token_stride, task_dim);
            }
            for (int64_t qh = 0; qh < task_heads; ++qh) {
              const kv_t* head_keys[kBlockKeys];
              for (int t = 0; t < kBlockKeys; ++t) head_keys[t] = keys[t] + (qh / group) * head_dim;
              float* head_scores = scores.data() + qh * max_len + scored;
#if defined(__AVX512BF16__)
              if constexpr (std::is_same_v<scalar_t, at::BFloat16> &&
                            std::is_same_v<kv_t, at::BFloat16>) {
                if (head_dim % 32 == 0) {
                  simd::score_block_bf16(q_row + qh * head_dim, head_keys, head_dim, scaling,
                                         head_scores);
                  continue;
                }
              }
#endif
              score_block(queries.data() + qh * head_dim, head_keys, head_dim, head_scores);
            }
          }
        }
      }
#endif
      for (int64_t j = scored; j < len; ++j) {
        const acc_t* keys =
            load_token(k_ptr + offset, row, j, len, token_stride, task_dim, converted.data());
        for (int64_t qh = 0; qh < task_heads; ++qh) {
          const acc_t* query = queries.data() + qh * head_dim;
          const acc_t* k = keys + (qh / group) * head_dim;
          acc_t dot = 0;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += query[d] * k[d];
          scores[qh * max_len + j] = dot;
        }
      }
      for (int64_t qh = 0; qh < task_heads; ++qh) {
        acc_t* score = scores.data() + qh * max_len;
        acc_t top = -std::numeric_limits<acc_t>::infinity();
        int64_t j = 0;
#if defined(RADIXSERVE_SIMD)
        if constexpr (std::is_same_v<acc_t, float>) j = simd::max_prefix(score, len, top);
#endif
        for (; j < len; ++j) top = std::max(top, score[j]);
        acc_t total = 0;
        j = 0;
#if defined(RADIXSERVE_SIMD)
        if constexpr (std::is_same_v<acc_t, float>) j = simd::exp_prefix(score, len, top, total);
#endif
        for (; j < len; ++j) {
          score[j] = std::exp(score[j] - top);
          total += score[j];
        }
        const acc_t inverse = len > 0 ? acc_t(1) / total : acc_t(0);
#pragma omp simd
        for (int64_t j = 0; j < len; ++j) score[j] *= inverse;
      }
      std::fill(sums.begin(), sums.end(), acc_t(0));
      int64_t summed = 0;  // values added so far
#if defined(RADIXSERVE_SIMD)
      if constexpr (std::is_same_v<acc_t, float>) {
        if (head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128) {
          // blocks of values, the sums in registers
          for (; summed < len; summed += kBlockKeys) {
            const int64_t count = std::min<int64_t>(kBlockKeys, len - summed);
            const kv_t* values[kBlockKeys];
            for (int64_t t = 0; t < count; ++t) {
              values[t] = locate_token(v_ptr + offset, row, summed + t, len, token_stride,
                                       task_dim);
            }
            for (int64_t h = 0; h < heads_per_task; ++h) {
              const float* head_scores = scores.data() + h * group * max_len + summed;
              float* head_sums = sums.data() + h * group * head_dim;
              constexpr int kLanes = simd::kLanes;
              const auto add = head_dim == 16   ? add_weighted_values_heads<16 / kLanes, kv_t>
                               : head_dim == 32 ? add_weighted_values_heads<32 / kLanes, kv_t>
                               : head_dim == 64 ? add_weighted_values_heads<64 / kLanes, kv_t>
                                                : add_weighted_values_heads<128 / kLanes, kv_t>;
              add(group, values, count, h * head_dim, head_scores, max_len, head_sums);
            }
          }
        }
      }
#endif
      for (int64_t j = summed; j < len; ++j) {
        const acc_t* values =
            load_token(v_ptr + offset, row, j, len, token_stride, task_dim, converted.data());
        for (int64_t qh = 0; qh < task_heads; ++qh) {
          const acc_t p = scores[qh * max_len + j];
          const acc_t* v = values + (qh / group) * head_dim;
          acc_t* sum = sums.data() + qh * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) sum[d] += p * v[d];
        }
      }
      scalar_t* out_row = out_ptr + (r * num_heads + first_head * group) * head_dim;
      for (int64_t i = 0; i < task_heads * head_dim; ++i) {
        out_row[i] = static_cast<scalar_t>(sums[i]);
      }
    }
  });
}

}  // namespace

namespace radixserve {

at::Tensor decode_attention(
    const at::Tensor& q,
    const at::Tensor& k_buffer,
    const at::Tensor& v_buffer,
    const at::Tensor& slots,
    const at::Tensor& seq_lens,
    double scaling,
    const std::optional<at::Tensor>& slot_index,
    int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_buffer.dim() == 3 && v_buffer.dim() == 3,
              "q is [n, heads, dim] and the buffers [slots, kv_heads, dim]");
  TORCH_CHECK(k_buffer.is_contiguous() && v_buffer.is_contiguous(), "contiguous KV buffers");
  const at::ScalarType kv_type = k_buffer.scalar_type();
  TORCH_CHECK(v_buffer.scalar_type() == kv_type, "the K and V buffers share a dtype");
  TORCH_CHECK(q.scalar_type() == kv_type ||
                  (q.scalar_type() == at::kFloat &&
                   (kv_type == at::kHalf || kv_type == at::kBFloat16)),
              "q and the KV buffers share a dtype, or float q reads a 16-bit pool");
  TORCH_CHECK(q.size(1) % k_buffer.size(1) == 0, "query heads are a multiple of KV heads");
  TORCH_CHECK(slots.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "int64 slots and seq_lens");
  TORCH_CHECK(seq_lens.size(0) == q.size(0), "one length per query");
  at::Tensor index;
  if (slot_index.has_value()) {
    TORCH_CHECK(slot_index->scalar_type() == at::kLong && slot_index->size(0) == q.size(0),
                "one int64 row of slots per query");
    index = slot_index->contiguous();
    TORCH_CHECK(q.size(0) == 0 || (index.min().item<int64_t>() >= 0 &&
                                   index.max().item<int64_t>() < slots.size(0)),
                "slot_index names rows of slots");
  } else {
    TORCH_CHECK(slots.size(0) == q.size(0), "one row of slots per query");
  }
  const int64_t* index_ptr = index.defined() ? index.const_data_ptr<int64_t>() : nullptr;
  const at::Tensor queries = q.contiguous();
  const at::Tensor slot_rows = slots.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  at::Tensor out = at::empty_like(queries);
  if (q.scalar_type() != kv_type) {
    AT_DISPATCH_REDUCED_FLOATING_TYPES(kv_type, "radixserve_decode_attention_16bit_pool", [&] {
      decode_attention_kernel<float, scalar_t>(
          queries, k_buffer, v_buffer, slot_rows, index_ptr, lens, scaling, window, out);
    });
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, q.scalar_type(), "radixserve_decode_attention", [&] {
        decode_attention_kernel<scalar_t, scalar_t>(
            queries, k_buffer, v_buffer, slot_rows, index_ptr, lens, scaling, window, out);
      });
  return out;
}

}  // namespace radixserve
