// Every op of the library, as `registration.cpp` registers it and the kernels that call
// one another (decode_layer.cpp) see it. One definition each, in the file named beside it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace radixserve {

// activation.cpp: silu(gate) * up and gelu_tanh(gate) * up of bf16/half rows [T, 2d].
at::Tensor silu_and_mul(const at::Tensor& input);
at::Tensor gelu_tanh_and_mul(const at::Tensor& input);

// norm.cpp: residual add (in place) and RMSNorm of 16-bit rows.
at::Tensor rms_norm(const at::Tensor& input, const std::optional<at::Tensor>& residual,
                    const at::Tensor& weight, double eps);

// rotary.cpp: rotary embedding of [T, heads, head_dim] rows in place.
void rotary(at::Tensor& qk, const at::Tensor& cos_sin);

// The attention kernels take a sliding `window`: a query at position p sees the keys at
// positions (p - window, p]; 0 (or below) for full causal attention.

// decode_attention.cpp: one-token queries over each request's pool slots.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_buffer,
                            const at::Tensor& v_buffer, const at::Tensor& slots,
                            const at::Tensor& seq_lens, double scaling,
                            const std::optional<at::Tensor>& slot_index, int64_t window);

// x86/extend_attention.cpp: causal prefill attention of bf16 requests on AMX tiles.
bool extend_attention_supported();
at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k_buffer,
                            const at::Tensor& v_buffer, const at::Tensor& slots,
                            const at::Tensor& prefix_lens, const at::Tensor& extend_lens,
                            const at::Tensor& q_starts, double scaling, int64_t window);

// x86/linear_bf16.cpp: bf16 matmuls on AMX tiles (over `amx_pack`) and for a few rows.
bool amx_available();
at::Tensor amx_pack(const at::Tensor& weight);
at::Tensor linear_amx(const at::Tensor& input, const at::Tensor& packed, int64_t n_size,
                      const std::optional<at::Tensor>& bias);
at::Tensor linear_few_rows(const at::Tensor& input, const at::Tensor& weight);

// linear_rows.cpp: plain-weight matmul, each row summed in one order at any row count.
at::Tensor linear_rows(const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias);

// quant_linear.cpp: matmuls over weights kept quantized (quant_formats.h), and their floats.
at::Tensor quant_linear(const at::Tensor& input, const at::Tensor& weight, int64_t format,
                        const std::optional<at::Tensor>& bias, int64_t activation_bits,
                        bool batch_invariant);
at::Tensor quant_dequantize(const at::Tensor& weight, int64_t format, int64_t k_size);
std::vector<int64_t> quant_format_table();

// decode_layer.cpp: a whole decoder layer of a decode batch (Llama's, with Qwen3's q/k norms
// or Gemma 3's four norms and GELU), as one op.
at::Tensor decode_layer(const at::Tensor& hidden, const std::optional<at::Tensor>& residual,
                        const c10::List<std::optional<at::Tensor>>& norms,
                        at::TensorList projection_tensors, at::IntArrayRef formats,
                        at::IntArrayRef parts, std::string_view activation,
                        const at::Tensor& cos_sin, const at::Tensor& k_buffer,
                        const at::Tensor& v_buffer, const at::Tensor& out_cache_loc,
                        const at::Tensor& slots, const at::Tensor& seq_lens,
                        const std::optional<at::Tensor>& slot_index, int64_t num_heads,
                        int64_t num_kv_heads, double scaling, double eps, int64_t activation_bits,
                        int64_t few_rows, bool batch_invariant, int64_t window);

}  // namespace radixserve
