// Prefill (extend) attention of bf16 requests on CPU, on AMX tiles: where torch's SDPA takes
// the products at float FMA speed, one per request and with the keys gathered first.
//
// Two phases. First each (request, KV head) packs its keys and values, read through its
// slots in the pool, into the layouts tdpbf16ps reads: keys as the B operand of S = Q K^T,
// values as the B operand of O = P V, zero-padded to whole tiles. Then a task takes 16 new
// tokens of one query head: their scores against every key up to the last one the block may
// see (four 16-key tiles per step), a causal softmax per row in float whose weights are
// rounded to bf16 (as SDPA's bf16 path rounds them), and their product with the values.
// New token i of a request sees its prefix and new tokens 0..i.
//
// Under a sliding window a query at position p sees only the keys at (p - window, p]: keys
// before the first new token's window are never read (not packed), a block's bands of 64
// keys before its first row's window are not scored, and each row's softmax masks the keys
// before its own window.

#include "ops.h"
#include "x86/amx.h"
#include "parallel.h"
#include "simd.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using bf16 = at::BFloat16;
using radixserve::kAmxDepth, radixserve::kAmxRows, radixserve::round_up;

constexpr int64_t kKeyBand = 64;  // keys scored per step: four 16-key tiles
constexpr int64_t kTileElements = kAmxRows * kAmxDepth;  // bf16 in one operand tile

#if defined(RADIXSERVE_AMX)
// Keys [len, head_dim] of one KV head -> [key tile][depth step][16 pairs][16 keys][2]: tile
// (t, s) holds dims 32s..32s+31 of keys 16t..16t+15, pairs of dims side by side. Keys past
// `len` (up to `padded_len`) are zero. A tile row (one pair of dims of 16 keys) is two
// gathers of the keys' words, the keys' rows being wherever their slots put them.
void pack_keys(const bf16* buffer, const int64_t* slots, int64_t len, int64_t padded_len,
               int64_t token_stride, int64_t head_dim, bf16* packed) {
  const int64_t steps = head_dim / kAmxDepth;
  const char* bytes = reinterpret_cast<const char*>(buffer);
  auto* target = reinterpret_cast<uint32_t*>(packed);  // a pair of bf16 as one word
  for (int64_t first = 0; first < padded_len; first += kAmxRows) {
    const int64_t count = std::clamp<int64_t>(len - first, 0, kAmxRows);
    alignas(64) int64_t offsets[kAmxRows] = {};  // of each key's row, in bytes
    for (int64_t k = 0; k < count; ++k) {
      offsets[k] = slots[first + k] * token_stride * static_cast<int64_t>(sizeof(bf16));
    }
    const __m512i low = _mm512_load_si512(offsets), high = _mm512_load_si512(offsets + 8);
    const auto low_keys = static_cast<__mmask8>(radixserve::first_lanes(count));
    const auto high_keys = static_cast<__mmask8>(radixserve::first_lanes(count - 8));
    uint32_t* tiles = target + first / kAmxRows * steps * kTileElements / 2;
    for (int64_t pair = 0; pair < head_dim / 2; ++pair) {
      const char* words = bytes + pair * sizeof(uint32_t);
      const __m256i a = _mm512_mask_i64gather_epi32(_mm256_setzero_si256(), low_keys, low, words, 1);
      const __m256i b =
          _mm512_mask_i64gather_epi32(_mm256_setzero_si256(), high_keys, high, words, 1);
      _mm512_storeu_si512(
          tiles + (pair / kAmxRows) * kTileElements / 2 + (pair % kAmxRows) * kAmxRows,
          _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
    }
  }
}

// Word indices for _mm512_permutex2var_epi16 over two rows a and b (32 dims each):
// a[i], b[i] side by side for dims 0-15, then for dims 16-31.
struct Interleave {
  alignas(64) uint16_t words[2][32];
  constexpr Interleave() : words{} {
    for (int half = 0; half < 2; ++half) {
      for (int i = 0; i < 16; ++i) {
        words[half][2 * i] = static_cast<uint16_t>(16 * half + i);
        words[half][2 * i + 1] = static_cast<uint16_t>(32 + 16 * half + i);
      }
    }
  }
};
constexpr Interleave kInterleaveTable;
constexpr const uint16_t (&kInterleave)[2][32] = kInterleaveTable.words;

// Values [len, head_dim] of one KV head -> [key step][dim tile][16 pairs][16 dims][2]: tile
// (s, d) holds dims 16d..16d+15 of keys 32s..32s+31, pairs of keys side by side. Keys past
// `len` are zero (their weight is zero, and zero times a stale value must not be NaN). Two
// keys' 32 dims become two tile rows by one interleaving permute each.
void pack_values(const bf16* buffer, const int64_t* slots, int64_t len, int64_t padded_len,
                 int64_t token_stride, int64_t head_dim, bf16* packed) {
  const int64_t dim_tiles = head_dim / kAmxRows;
  const __m512i first_dims = _mm512_load_si512(kInterleave[0]);
  const __m512i last_dims = _mm512_load_si512(kInterleave[1]);
  const auto row = [&](int64_t key, int64_t dim) {
    return key < len ? _mm512_loadu_si512(buffer + slots[key] * token_stride + dim)
                     : _mm512_setzero_si512();
  };
  for (int64_t key = 0; key < padded_len; key += 2) {
    bf16* step = packed + (key / kAmxDepth) * dim_tiles * kTileElements +
                 (key % kAmxDepth) / 2 * kAmxDepth;  // the pair's row in each dim tile
    for (int64_t dim = 0; dim < head_dim; dim += 2 * kAmxRows) {
      const __m512i a = row(key, dim), b = row(key + 1, dim);
      bf16* tile = step + (dim / kAmxRows) * kTileElements;
      _mm512_storeu_si512(tile, _mm512_permutex2var_epi16(a, first_dims, b));
      _mm512_storeu_si512(tile + kTileElements, _mm512_permutex2var_epi16(a, last_dims, b));
    }
  }
}

// Scores of 16 query rows (`q`, `q_stride` elements apart) against keys [0, keys): float,
// into `scores` (row stride `score_stride`), four key tiles per step.
void score_block(const bf16* q, int64_t q_stride, const bf16* packed_keys, int64_t keys,
                 int64_t head_dim, float* scores, int64_t score_stride) {
  const int64_t steps = head_dim / kAmxDepth;
  const int64_t key_tile = steps * kTileElements;
  for (int64_t band = 0; band < keys; band += kKeyBand) {
    const bf16* tiles = packed_keys + (band / kAmxRows) * key_tile;
    radixserve::zero_accumulators();
    for (int64_t s = 0; s < steps; ++s) {
      radixserve::multiply_four_tiles(q + s * kAmxDepth, q_stride * sizeof(bf16),
                                      tiles + s * kTileElements, key_tile * sizeof(bf16));
    }
    radixserve::store_accumulators(scores + band, score_stride);
  }
}

// Row r of the block: the exps of its scores `begin[r]` to `end[r]` times `scaling`, less
// their max, rounded to bf16 into `weights` (zero elsewhere up to `depth`, a whole number of
// tile steps; rows from `rows` on all zero), and the reciprocal of their float sum into
// `inverse_sums[r]`: as SDPA's bf16 path, the weights are normalised after their product
// with the values.
void softmax_rows(const float* scores, int64_t score_stride, const int64_t* begin,
                  const int64_t* end, int64_t rows, float scaling, bf16* weights, int64_t depth,
                  float* inverse_sums) {
  using radixserve::first_lanes;
  const __m512 scale = _mm512_set1_ps(scaling);
  for (int64_t r = 0; r < kAmxRows; ++r) {
    bf16* out = weights + r * depth;
    const int64_t first = r < rows ? begin[r] : 0, len = r < rows ? end[r] : 0;
    const float* row = scores + r * score_stride;
    // The lanes of keys first..len-1 among the 16 from j.
    const auto seen = [&](int64_t j) -> __mmask16 {
      return first_lanes(len - j) & static_cast<__mmask16>(~first_lanes(first - j));
    };
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = first / 16 * 16; j < len; j += 16) {
      top = _mm512_mask_max_ps(top, seen(j), top, _mm512_maskz_loadu_ps(seen(j), row + j));
    }
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top) * scaling);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < depth; j += 16) {
      const __mmask16 mask = seen(j);  // none outside the visible keys
      const __m512 e = _mm512_maskz_mov_ps(
          mask, radixserve::simd::exp_nonpositive(
                    _mm512_fmsub_ps(_mm512_maskz_loadu_ps(mask, row + j), scale, shift)));
      total = _mm512_add_ps(total, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    inverse_sums[r] = len > 0 ? 1.0f / _mm512_reduce_add_ps(total) : 0.0f;
  }
}

// O = P V for the block: 16 rows of weights [16, depth] against the packed values, 64 dims
// (four dim tiles) at a time, each row times its `inverse_sums`, rounded into the first
// `rows` rows of `out`.
void weigh_values(const bf16* weights, int64_t depth, const bf16* packed_values,
                  int64_t head_dim, const float* inverse_sums, int64_t rows, bf16* out,
                  int64_t out_stride) {
  const int64_t dim_tiles = head_dim / kAmxRows;
  alignas(64) float sums[kAmxRows * 64];
  for (int64_t band = 0; band < head_dim; band += 64) {
    radixserve::zero_accumulators();
    for (int64_t s = 0; s < depth / kAmxDepth; ++s) {
      radixserve::multiply_four_tiles(
          weights + s * kAmxDepth, depth * sizeof(bf16),
          packed_values + (s * dim_tiles + band / kAmxRows) * kTileElements,
          kTileElements * sizeof(bf16));
    }
    radixserve::store_accumulators(sums, 64);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 inverse = _mm512_set1_ps(inverse_sums[r]);
      for (int64_t c = 0; c < 64; c += 16) {
        radixserve::store16(out + r * out_stride + band + c,
                            _mm512_mul_ps(_mm512_load_ps(sums + r * 64 + c), inverse));
      }
    }
  }
}
#endif

}  // namespace

namespace radixserve {

bool extend_attention_supported() {
#if defined(RADIXSERVE_AMX)
  return radixserve::amx_permitted();
#else
  return false;
#endif
}

// q [T, heads, head_dim] (rows may be strided), the pool's buffers [slots, kv_heads,
// head_dim], and per request: its slots [n, max_len] (prefix, then new tokens), prefix and
// new-token counts, and the row of q where its new tokens start; `window` > 0: a sliding
// window.
at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k_buffer,
                            const at::Tensor& v_buffer, const at::Tensor& slots,
                            const at::Tensor& prefix_lens, const at::Tensor& extend_lens,
                            const at::Tensor& q_starts, double scaling, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q is [T, heads, head_dim] with whole heads side by side in each row");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_buffer.scalar_type() == at::kBFloat16 &&
                  v_buffer.scalar_type() == at::kBFloat16,
              "bf16 queries and KV buffers");
  TORCH_CHECK(k_buffer.is_contiguous() && v_buffer.is_contiguous(), "contiguous KV buffers");
  const int64_t heads = q.size(1), head_dim = q.size(2), kv_heads = k_buffer.size(1);
  TORCH_CHECK(head_dim % 64 == 0 && heads % kv_heads == 0 && k_buffer.size(2) == head_dim,
              "head_dim a multiple of 64, query heads a multiple of KV heads");
  for (const auto* t : {&slots, &prefix_lens, &extend_lens, &q_starts}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "int64 metadata");
  }
  TORCH_CHECK(extend_attention_supported(), "this CPU (or build) has no AMX");
  at::Tensor out = at::zeros({q.size(0), heads, head_dim}, q.options());
#if defined(RADIXSERVE_AMX)
  const int64_t num_reqs = slots.size(0), max_len = slots.size(1);
  const int64_t* slot_ptr = slots.const_data_ptr<int64_t>();
  const int64_t* prefix_ptr = prefix_lens.const_data_ptr<int64_t>();
  const int64_t* extend_ptr = extend_lens.const_data_ptr<int64_t>();
  const int64_t* start_ptr = q_starts.const_data_ptr<int64_t>();
  // Each request's packed keys and values, per KV head, one after the other: from `firsts[r]`,
  // the first key its first new token sees, `lens[r]` of them.
  std::vector<int64_t> firsts(num_reqs), lens(num_reqs), padded(num_reqs);
  std::vector<int64_t> offsets(num_reqs + 1, 0);
  for (int64_t r = 0; r < num_reqs; ++r) {
    firsts[r] = window > 0 ? std::max<int64_t>(prefix_ptr[r] + 1 - window, 0) : 0;
    lens[r] = prefix_ptr[r] + extend_ptr[r] - firsts[r];
    TORCH_CHECK(prefix_ptr[r] >= 0 && extend_ptr[r] >= 0 && firsts[r] + lens[r] <= max_len &&
                    start_ptr[r] >= 0 && start_ptr[r] + extend_ptr[r] <= q.size(0),
                "lengths within the slots and the queries");
    padded[r] = round_up(std::max<int64_t>(lens[r], 1), kKeyBand);
    offsets[r + 1] = offsets[r] + kv_heads * padded[r] * head_dim;
  }
  // Reused across calls (a fresh allocation of this size costs page faults every time);
  // pack_keys and pack_values write every element they read back.
  static thread_local std::vector<bf16> key_buffer, value_buffer;
  key_buffer.resize(std::max<size_t>(key_buffer.size(), offsets[num_reqs]));
  value_buffer.resize(std::max<size_t>(value_buffer.size(), offsets[num_reqs]));
  bf16* keys = key_buffer.data();  // the calling thread's, for every worker
  bf16* values = value_buffer.data();
  const int64_t token_stride = kv_heads * head_dim;
  radixserve::parallel_claim(num_reqs * kv_heads, 1, [&](auto& queue) {
    for (int64_t task, last; queue.claim(task, last);) {  // one task per chunk
      const int64_t r = task / kv_heads, h = task % kv_heads;
      const int64_t at = offsets[r] + h * padded[r] * head_dim;
      const int64_t* row = slot_ptr + r * max_len + firsts[r];
      pack_keys(k_buffer.const_data_ptr<bf16>() + h * head_dim, row, lens[r], padded[r],
                token_stride, head_dim, keys + at);
      pack_values(v_buffer.const_data_ptr<bf16>() + h * head_dim, row, lens[r], padded[r],
                  token_stride, head_dim, values + at);
    }
  });
  // Tasks: (request, query head, block of 16 new tokens).
  std::vector<int64_t> first_task(num_reqs + 1, 0);
  for (int64_t r = 0; r < num_reqs; ++r) {
    first_task[r + 1] = first_task[r] + heads * ((extend_ptr[r] + kAmxRows - 1) / kAmxRows);
  }
  const int64_t longest = *std::max_element(padded.begin(), padded.end());
  const int64_t group = heads / kv_heads, q_stride = q.stride(0);
  const bf16* q_ptr = q.const_data_ptr<bf16>();
  bf16* out_ptr = out.data_ptr<bf16>();
  radixserve::parallel_claim(first_task[num_reqs], 1, [&](auto& queue) {
    std::vector<float> scores(kAmxRows * longest);
    std::vector<bf16> weights(kAmxRows * longest), q_block(kAmxRows * head_dim);
    radixserve::configure_tiles();
    for (int64_t task, last; queue.claim(task, last);) {  // one task per chunk
      const int64_t r = std::upper_bound(first_task.begin(), first_task.end(), task) -
                        first_task.begin() - 1;
      const int64_t blocks = (extend_ptr[r] + kAmxRows - 1) / kAmxRows;
      const int64_t head = (task - first_task[r]) / blocks;
      const int64_t first = (task - first_task[r]) % blocks * kAmxRows;  // new token
      const int64_t rows = std::min(kAmxRows, extend_ptr[r] - first);
      const int64_t at = offsets[r] + (head / group) * padded[r] * head_dim;
      const bf16* q_rows = q_ptr + (start_ptr[r] + first) * q_stride + head * head_dim;
      int64_t stride = q_stride;
      if (rows < kAmxRows) {  // a tile reads 16 rows: the last block's are copied, zero-padded
        std::fill(q_block.begin(), q_block.end(), bf16(0));
        for (int64_t i = 0; i < rows; ++i) {
          std::copy_n(q_rows + i * q_stride, head_dim, q_block.data() + i * head_dim);
        }
        q_rows = q_block.data();
        stride = head_dim;
      }
      // Row i sees the packed keys begin[i]..end[i]-1; the block scores the bands of 64 from
      // the one holding its first row's first key (`skipped` keys before them).
      int64_t begin[kAmxRows], end[kAmxRows];
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t position = prefix_ptr[r] + first + i;
        end[i] = position + 1 - firsts[r];
        begin[i] = window > 0 ? std::max<int64_t>(position + 1 - window, 0) - firsts[r] : 0;
      }
      const int64_t skipped = begin[0] / kKeyBand * kKeyBand;
      for (int64_t i = 0; i < rows; ++i) {
        begin[i] -= skipped;
        end[i] -= skipped;
      }
      const int64_t keys_seen = end[rows - 1];
      score_block(q_rows, stride, keys + at + skipped / kAmxRows * (head_dim / kAmxDepth) *
                                                 kTileElements,
                  keys_seen, head_dim, scores.data(), longest);
      const int64_t depth = round_up(keys_seen, kAmxDepth);
      float inverse_sums[kAmxRows];
      softmax_rows(scores.data(), longest, begin, end, rows, static_cast<float>(scaling),
                   weights.data(), depth, inverse_sums);
      weigh_values(weights.data(), depth,
                   values + at + skipped / kAmxDepth * (head_dim / kAmxRows) * kTileElements,
                   head_dim, inverse_sums, rows,
                   out_ptr + ((start_ptr[r] + first) * heads + head) * head_dim, heads * head_dim);
    }
    _tile_release();
  });
#endif
  return out;
}

}  // namespace radixserve
