// One Llama decoder layer of a decode batch on CPU as a single op: the layer's kernels (the
// other files here) called from C++ in the order the Python modules call them
// (engine/model/models/llama.py), so that a decode step pays one Python dispatch per layer
// instead of about fifteen; on two cores those dispatches were about a seventh of the step.
// Same kernels in the same order on the same tensors: the output equals the modules'.
//
// The layer: residual add + RMSNorm, the qkv projection, rotary on q and k in place, the new
// K/V written to the pool at `out_cache_loc`, decode attention over each request's slots,
// the o projection, residual add + RMSNorm, gate_up, SiLU-and-mul, down. Every projection is
// bias-free: over quantized rows the quantized matmul (`formats`, one per projection, -1
// for bf16 weights), else the few-rows matmul for up to `few_rows` rows, else the AMX one.
// Hidden states are bf16, or float32 where every projection is quantized; the KV pool holds
// their dtype, or 16 bits under float32; `activation_bits` and `batch_invariant` as
// `quant_linear` takes them. Under --enable-deterministic-inference a prefill's tokens run
// it too, as one-token rows of their requests (`slot_index`, as decode_attention takes it),
// so that prefill and decode go through one path. `window` is the layer's sliding window
// (0: none), as decode_attention takes it.

#include "ops.h"
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>

namespace {

using Tensor = at::Tensor;

template <typename Signature>
c10::TypedOperatorHandle<Signature> kernel(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// The layer's weights, in the order `decode_layer` takes them.
enum Weight { kInputNorm, kQkv, kQkvPacked, kO, kOPacked, kPostNorm, kGateUp, kGateUpPacked,
              kDown, kDownPacked, kWeights };

class Kernels {
 public:
  Kernels()
      : rms_norm_(kernel<Tensor(const Tensor&, const std::optional<Tensor>&, const Tensor&,
                                double)>("radixserve_cpu::rms_norm")),
        linear_amx_(kernel<Tensor(const Tensor&, const Tensor&, int64_t,
                                  const std::optional<Tensor>&)>("radixserve_cpu::linear_amx")),
        linear_few_rows_(
            kernel<Tensor(const Tensor&, const Tensor&)>("radixserve_cpu::linear_few_rows")),
        quant_linear_(kernel<Tensor(const Tensor&, const Tensor&, int64_t,
                                    const std::optional<Tensor>&, int64_t, bool)>(
            "radixserve_cpu::quant_linear")),
        rotary_(kernel<void(Tensor&, const Tensor&)>("radixserve_cpu::rotary")),
        silu_and_mul_(kernel<Tensor(const Tensor&)>("radixserve_cpu::silu_and_mul")),
        decode_attention_(kernel<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                        const Tensor&, double, const std::optional<Tensor>&,
                                        int64_t)>("radixserve_cpu::decode_attention")) {}

  Tensor rms_norm(const Tensor& x, const std::optional<Tensor>& residual, const Tensor& weight,
                  double eps) const {
    return rms_norm_.call(x, residual, weight, eps);
  }

  // x W^T as engine/model/layers/linear.py's `linear` chooses for bias-free rows: over
  // quantized rows (`format` >= 0) the quantized matmul, else bf16 ones.
  Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& packed, int64_t format,
                int64_t activation_bits, int64_t few_rows, bool batch_invariant) const {
    if (format >= 0) {
      return quant_linear_.call(x, weight, format, std::nullopt, activation_bits, batch_invariant);
    }
    TORCH_CHECK(!batch_invariant, "batch-invariant layers hold quantized projections");
    if (x.size(0) <= few_rows) return linear_few_rows_.call(x, weight);
    return linear_amx_.call(x, packed, weight.size(0), std::nullopt);
  }

  void rotary(Tensor& qk, const Tensor& cos_sin) const { rotary_.call(qk, cos_sin); }

  Tensor silu_and_mul(const Tensor& x) const { return silu_and_mul_.call(x); }

  Tensor decode_attention(const Tensor& q, const Tensor& k_buffer, const Tensor& v_buffer,
                          const Tensor& slots, const Tensor& seq_lens, double scaling,
                          const std::optional<Tensor>& slot_index, int64_t window) const {
    return decode_attention_.call(q, k_buffer, v_buffer, slots, seq_lens, scaling, slot_index,
                                  window);
  }

 private:
  c10::TypedOperatorHandle<Tensor(const Tensor&, const std::optional<Tensor>&, const Tensor&,
                                  double)>
      rms_norm_;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t,
                                  const std::optional<Tensor>&)>
      linear_amx_;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&)> linear_few_rows_;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, int64_t,
                                  const std::optional<Tensor>&, int64_t, bool)>
      quant_linear_;
  c10::TypedOperatorHandle<void(Tensor&, const Tensor&)> rotary_;
  c10::TypedOperatorHandle<Tensor(const Tensor&)> silu_and_mul_;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  const Tensor&, double, const std::optional<Tensor>&, int64_t)>
      decode_attention_;
};

}  // namespace

namespace radixserve {

// Returns the layer's MLP output. The residual stream (`residual`, or for the first layer,
// which has none, `hidden` itself) gets the attention output added in place, as
// LlamaDecoderLayer's norms add it.
Tensor decode_layer(
    const Tensor& hidden, const std::optional<Tensor>& residual, at::TensorList weights,
    const Tensor& cos_sin, const Tensor& k_buffer, const Tensor& v_buffer,
    const Tensor& out_cache_loc, const Tensor& slots, const Tensor& seq_lens,
    const std::optional<Tensor>& slot_index, int64_t num_heads, int64_t num_kv_heads,
    double scaling, double eps, at::IntArrayRef formats, int64_t activation_bits,
    int64_t few_rows, bool batch_invariant, int64_t window) {
  TORCH_CHECK(weights.size() == kWeights, "the layer's ", static_cast<int>(kWeights), " weights");
  TORCH_CHECK(formats.size() == 4, "a format for each of the four projections");
  TORCH_CHECK(hidden.dim() == 2 && (hidden.scalar_type() == at::kBFloat16 ||
                                    hidden.scalar_type() == at::kFloat),
              "bf16 or float hidden states [n, hidden]");
  TORCH_CHECK(k_buffer.scalar_type() == v_buffer.scalar_type() &&
                  (k_buffer.scalar_type() == hidden.scalar_type() ||
                   hidden.scalar_type() == at::kFloat),
              "a KV pool of the hidden states' dtype, or any under float32");
  for (const int64_t format : formats) {
    TORCH_CHECK(format >= 0 || hidden.scalar_type() == at::kBFloat16,
                "bf16 projections take bf16 hidden states");
  }
  static const Kernels kernels;
  const int64_t tokens = hidden.size(0), head_dim = k_buffer.size(2);
  Tensor stream = residual.has_value() ? *residual : hidden;
  Tensor h = kernels.rms_norm(hidden.contiguous(), residual, weights[kInputNorm], eps);

  Tensor qkv = kernels.linear(h, weights[kQkv], weights[kQkvPacked], formats[0],
                              activation_bits, few_rows, batch_invariant)
                   .view({tokens, num_heads + 2 * num_kv_heads, head_dim});
  Tensor qk = qkv.narrow(1, 0, num_heads + num_kv_heads);
  kernels.rotary(qk, cos_sin);
  const Tensor q = qkv.narrow(1, 0, num_heads);
  const at::ScalarType kv_type = k_buffer.scalar_type();
  k_buffer.index_copy_(0, out_cache_loc, qkv.narrow(1, num_heads, num_kv_heads).to(kv_type));
  v_buffer.index_copy_(0, out_cache_loc,
                       qkv.narrow(1, num_heads + num_kv_heads, num_kv_heads).to(kv_type));
  const Tensor attn =
      kernels.decode_attention(q, k_buffer, v_buffer, slots, seq_lens, scaling, slot_index,
                               window)
          .view({tokens, num_heads * head_dim});

  const Tensor o = kernels.linear(attn, weights[kO], weights[kOPacked], formats[1],
                                  activation_bits, few_rows, batch_invariant);
  h = kernels.rms_norm(o, stream, weights[kPostNorm], eps);
  const Tensor gate_up = kernels.linear(h, weights[kGateUp], weights[kGateUpPacked], formats[2],
                                        activation_bits, few_rows, batch_invariant);
  return kernels.linear(kernels.silu_and_mul(gate_up), weights[kDown], weights[kDownPacked],
                        formats[3], activation_bits, few_rows, batch_invariant);
}

}  // namespace radixserve
