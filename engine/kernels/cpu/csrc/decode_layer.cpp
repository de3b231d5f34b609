// One decoder layer of a decode batch on CPU as a single op: the layer's kernels (the other
// files here) called from C++ in the order the Python modules call them
// (engine/model/models/llama.py, gemma3.py), so that a decode step pays one Python dispatch
// per layer instead of about fifteen; on two cores those dispatches were about a seventh of
// the step. Same kernels in the same order on the same tensors: the output equals the
// modules'.
//
// The layer: residual add + RMSNorm, the qkv projection, RMSNorm of each q and k head where
// the layer has q/k norms (Qwen3, Gemma 3), rotary on q and k in place, the new K/V written
// to the pool at `out_cache_loc`, decode attention over each request's slots, the o
// projection, RMSNorm of its output where the layer has an attention-output norm (Gemma 3),
// residual add + RMSNorm, gate_up, the gated activation (`activation`: "silu" or
// "gelu_tanh"), down, and RMSNorm of the MLP's output where the layer has one (Gemma 3).
// `norms` holds the six norms' weights in that order, None for those the layer lacks.
//
// Every projection is bias-free and comes as one or more parts of its output rows (`parts`:
// how many for each of qkv, o, gate_up, down), side by side in its output: a fused
// projection whose parts the checkpoint stores in different block formats keeps each
// part's blocks. Each part is its weight and the packed copy of it (the weight again where
// quantized) in `projections`, and its format in `formats` (-1 for a bf16 weight): over
// quantized rows the quantized matmul, else the few-rows matmul for up to `few_rows` rows,
// else the AMX one. Hidden states are bf16, or float32 where every projection is
// quantized; the KV pool holds their dtype, or 16 bits under float32; `activation_bits` and
// `batch_invariant` as `quant_linear` takes them. Under --enable-deterministic-inference a
// prefill's tokens run it too, as one-token rows of their requests (`slot_index`, as
// decode_attention takes it), so that prefill and decode go through one path. `window` is
// the layer's sliding window (0: none), as decode_attention takes it.

#include "ops.h"
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <string_view>
#include <vector>

namespace {

using Tensor = at::Tensor;
using Norms = c10::List<std::optional<Tensor>>;

template <typename Signature>
c10::TypedOperatorHandle<Signature> kernel(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// The layer's norms, in the order `decode_layer` takes them.
enum Norm { kInputNorm, kQNorm, kKNorm, kAttentionOutNorm, kMlpInputNorm, kMlpOutNorm, kNorms };

// The layer's projections, in the order `decode_layer` takes their parts.
enum ProjectionId { kQkv, kO, kGateUp, kDown, kProjections };

// One projection's parts: a (weight, packed) pair and a format for each.
struct Projection {
  at::TensorList tensors;
  at::IntArrayRef formats;
};

// How the layer's matmuls run: as `quant_linear` and the bf16 matmuls take it.
struct MatmulOptions {
  int64_t activation_bits;
  int64_t few_rows;
  bool batch_invariant;
};

std::array<Projection, kProjections> split_projections(at::TensorList tensors,
                                                       at::IntArrayRef formats,
                                                       at::IntArrayRef parts) {
  TORCH_CHECK(parts.size() == kProjections, "a part count for each of the four projections");
  TORCH_CHECK(tensors.size() == 2 * formats.size(), "a weight and its packed copy per part");
  std::array<Projection, kProjections> projections;
  size_t first = 0;
  for (size_t i = 0; i < kProjections; ++i) {
    TORCH_CHECK(parts[i] >= 1, "each projection has a part");
    const auto count = static_cast<size_t>(parts[i]);
    TORCH_CHECK(first + count <= formats.size(), "a format for each part");
    projections[i] = {tensors.slice(2 * first, 2 * count), formats.slice(first, count)};
    first += count;
  }
  TORCH_CHECK(first == formats.size(), "as many formats as parts");
  return projections;
}

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
        gelu_tanh_and_mul_(kernel<Tensor(const Tensor&)>("radixserve_cpu::gelu_tanh_and_mul")),
        decode_attention_(kernel<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                        const Tensor&, double, const std::optional<Tensor>&,
                                        int64_t)>("radixserve_cpu::decode_attention")) {}

  Tensor rms_norm(const Tensor& x, const std::optional<Tensor>& residual, const Tensor& weight,
                  double eps) const {
    return rms_norm_.call(x, residual, weight, eps);
  }

  // x times each part of `projection`, side by side, as the module's fused layer does.
  Tensor linear(const Tensor& x, const Projection& projection,
                const MatmulOptions& options) const {
    std::vector<Tensor> outputs;
    for (size_t i = 0; i < projection.formats.size(); ++i) {
      outputs.push_back(linear_part(x, projection.tensors[2 * i], projection.tensors[2 * i + 1],
                                    projection.formats[i], options));
    }
    return outputs.size() == 1 ? outputs[0] : at::cat(outputs, 1);
  }

  void rotary(Tensor& qk, const Tensor& cos_sin) const { rotary_.call(qk, cos_sin); }

  Tensor gated(std::string_view activation, const Tensor& x) const {
    if (activation == "silu") return silu_and_mul_.call(x);
    TORCH_CHECK(activation == "gelu_tanh", "the gated activation is silu or gelu_tanh");
    return gelu_tanh_and_mul_.call(x);
  }

  Tensor decode_attention(const Tensor& q, const Tensor& k_buffer, const Tensor& v_buffer,
                          const Tensor& slots, const Tensor& seq_lens, double scaling,
                          const std::optional<Tensor>& slot_index, int64_t window) const {
    return decode_attention_.call(q, k_buffer, v_buffer, slots, seq_lens, scaling, slot_index,
                                  window);
  }

 private:
  // x W^T as engine/model/layers/linear.py's `linear` chooses for bias-free rows: over
  // quantized rows (`format` >= 0) the quantized matmul, else bf16 ones.
  Tensor linear_part(const Tensor& x, const Tensor& weight, const Tensor& packed, int64_t format,
                     const MatmulOptions& options) const {
    if (format >= 0) {
      return quant_linear_.call(x, weight, format, std::nullopt, options.activation_bits,
                                options.batch_invariant);
    }
    TORCH_CHECK(!options.batch_invariant, "batch-invariant layers hold quantized projections");
    if (x.size(0) <= options.few_rows) return linear_few_rows_.call(x, weight);
    return linear_amx_.call(x, packed, weight.size(0), std::nullopt);
  }

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
  c10::TypedOperatorHandle<Tensor(const Tensor&)> gelu_tanh_and_mul_;
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  const Tensor&, double, const std::optional<Tensor>&, int64_t)>
      decode_attention_;
};

// RMSNorm of each head's row of `heads` ([tokens, n, head_dim], a view), as RMSNorm runs a
// q or k norm: over the rows made contiguous.
Tensor norm_heads(const Kernels& kernels, const Tensor& heads, const Tensor& weight, double eps) {
  const Tensor rows = heads.reshape({-1, heads.size(2)}).contiguous();
  return kernels.rms_norm(rows, std::nullopt, weight, eps).view(heads.sizes());
}

// `x`, then RMSNorm of it where the layer has that optional norm.
Tensor maybe_norm(const Kernels& kernels, const Tensor& x, const std::optional<Tensor>& weight,
                  double eps) {
  return weight.has_value() ? kernels.rms_norm(x, std::nullopt, *weight, eps) : x;
}

// What the layer's attention reads and writes: the pool, the slots and the heads.
struct AttentionInputs {
  const Tensor& k_buffer;
  const Tensor& v_buffer;
  const Tensor& out_cache_loc;
  const Tensor& slots;
  const Tensor& seq_lens;
  const std::optional<Tensor>& slot_index;
  int64_t num_heads;
  int64_t num_kv_heads;
  double scaling;
  int64_t window;
};

// From the input norm's output to the attention's output [tokens, heads * head_dim]: the
// qkv projection, q/k norms, rotary, the new K/V written, decode attention.
Tensor attend(const Kernels& kernels, const Tensor& h, const Projection& qkv_projection,
              const Norms& norms, const Tensor& cos_sin, const AttentionInputs& in, double eps,
              const MatmulOptions& options) {
  const int64_t tokens = h.size(0), head_dim = in.k_buffer.size(2);
  const int64_t heads = in.num_heads, kv_heads = in.num_kv_heads;
  const Tensor qkv = kernels.linear(h, qkv_projection, options)
                         .view({tokens, heads + 2 * kv_heads, head_dim});
  Tensor qk = qkv.narrow(1, 0, heads + kv_heads);
  const std::optional<Tensor> q_norm = norms.get(kQNorm), k_norm = norms.get(kKNorm);
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q and k norms come together");
  if (q_norm.has_value()) {
    qk = at::cat({norm_heads(kernels, qkv.narrow(1, 0, heads), *q_norm, eps),
                  norm_heads(kernels, qkv.narrow(1, heads, kv_heads), *k_norm, eps)},
                 1);
  }
  kernels.rotary(qk, cos_sin);
  const at::ScalarType kv_type = in.k_buffer.scalar_type();
  in.k_buffer.index_copy_(0, in.out_cache_loc, qk.narrow(1, heads, kv_heads).to(kv_type));
  in.v_buffer.index_copy_(0, in.out_cache_loc,
                          qkv.narrow(1, heads + kv_heads, kv_heads).to(kv_type));
  return kernels
      .decode_attention(qk.narrow(1, 0, heads), in.k_buffer, in.v_buffer, in.slots, in.seq_lens,
                        in.scaling, in.slot_index, in.window)
      .view({tokens, heads * head_dim});
}

}  // namespace

namespace radixserve {

// Returns the layer's MLP output (after its norm, where the layer has one). The residual
// stream (`residual`, or for the first layer, which has none, `hidden` itself) gets the
// attention output added in place, as the modules' norms add it.
Tensor decode_layer(
    const Tensor& hidden, const std::optional<Tensor>& residual, const Norms& norms,
    at::TensorList projection_tensors, at::IntArrayRef formats, at::IntArrayRef parts,
    std::string_view activation, const Tensor& cos_sin, const Tensor& k_buffer,
    const Tensor& v_buffer, const Tensor& out_cache_loc, const Tensor& slots,
    const Tensor& seq_lens, const std::optional<Tensor>& slot_index, int64_t num_heads,
    int64_t num_kv_heads, double scaling, double eps, int64_t activation_bits, int64_t few_rows,
    bool batch_invariant, int64_t window) {
  TORCH_CHECK(norms.size() == kNorms, "the layer's ", static_cast<int>(kNorms), " norms");
  TORCH_CHECK(norms.get(kInputNorm).has_value() && norms.get(kMlpInputNorm).has_value(),
              "the two residual-add norms");
  const std::array<Projection, kProjections> projections =
      split_projections(projection_tensors, formats, parts);
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
  const MatmulOptions options{activation_bits, few_rows, batch_invariant};
  const AttentionInputs attention{k_buffer, v_buffer,  out_cache_loc, slots,   seq_lens,
                                  slot_index, num_heads, num_kv_heads, scaling, window};
  const Tensor stream = residual.has_value() ? *residual : hidden;
  Tensor h = kernels.rms_norm(hidden.contiguous(), residual, *norms.get(kInputNorm), eps);
  const Tensor attn = attend(kernels, h, projections[kQkv], norms, cos_sin, attention, eps,
                             options);

  const Tensor o = maybe_norm(kernels, kernels.linear(attn, projections[kO], options),
                              norms.get(kAttentionOutNorm), eps);
  h = kernels.rms_norm(o, stream, *norms.get(kMlpInputNorm), eps);
  const Tensor gate_up = kernels.linear(h, projections[kGateUp], options);
  const Tensor down =
      kernels.linear(kernels.gated(activation, gate_up), projections[kDown], options);
  return maybe_norm(kernels, down, norms.get(kMlpOutNorm), eps);
}

}  // namespace radixserve
