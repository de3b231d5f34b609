// Every op schema of the library, and its kernel, in one place: `ops.py` wraps each one,
// and tests/engine/kernels/test_registration.py checks that each is defined once.

#include "ops.h"

#include <torch/library.h>

TORCH_LIBRARY(radixserve_cpu, m) {
  m.def("silu_and_mul(Tensor input) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor input) -> Tensor");
  m.def("rms_norm(Tensor input, Tensor(a!)? residual, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor(a!) qk, Tensor cos_sin) -> ()");
  m.def(
      "decode_attention(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor slots, "
      "Tensor seq_lens, float scaling, Tensor? slot_index=None, int window=0) -> Tensor");
  m.def("extend_attention_supported() -> bool");
  m.def(
      "extend_attention(Tensor q, Tensor k_buffer, Tensor v_buffer, Tensor slots, "
      "Tensor prefix_lens, Tensor extend_lens, Tensor q_starts, float scaling, int window=0) "
      "-> Tensor");
  m.def("amx_available() -> bool");
  m.def("amx_pack(Tensor weight) -> Tensor");
  m.def("linear_amx(Tensor input, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("linear_few_rows(Tensor input, Tensor weight) -> Tensor");
  m.def("linear_rows(Tensor input, Tensor weight, Tensor? bias) -> Tensor");
  m.def(
      "quant_linear(Tensor input, Tensor weight, int format, Tensor? bias, "
      "int activation_bits, bool batch_invariant=False) -> Tensor");
  m.def("quant_dequantize(Tensor weight, int format, int k_size) -> Tensor");
  m.def("quant_format_table() -> int[]");
  m.def(
      "decode_layer(Tensor(a!) hidden, Tensor(b!)? residual, Tensor?[] norms, "
      "Tensor[] projections, int[] formats, int[] parts, str activation, Tensor cos_sin, "
      "Tensor(c!) k_buffer, Tensor(d!) v_buffer, Tensor out_cache_loc, Tensor slots, "
      "Tensor seq_lens, Tensor? slot_index, int num_heads, int num_kv_heads, float scaling, "
      "float eps, int activation_bits, int few_rows, bool batch_invariant, int window=0) "
      "-> Tensor");
}

// Ops without tensors (what this build and CPU can do) dispatch on no device.
TORCH_LIBRARY_IMPL(radixserve_cpu, CompositeExplicitAutograd, m) {
  m.impl("extend_attention_supported", &radixserve::extend_attention_supported);
  m.impl("amx_available", &radixserve::amx_available);
  m.impl("quant_format_table", &radixserve::quant_format_table);
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("silu_and_mul", &radixserve::silu_and_mul);
  m.impl("gelu_tanh_and_mul", &radixserve::gelu_tanh_and_mul);
  m.impl("rms_norm", &radixserve::rms_norm);
  m.impl("rotary", &radixserve::rotary);
  m.impl("decode_attention", &radixserve::decode_attention);
  m.impl("extend_attention", &radixserve::extend_attention);
  m.impl("amx_pack", &radixserve::amx_pack);
  m.impl("linear_amx", &radixserve::linear_amx);
  m.impl("linear_few_rows", &radixserve::linear_few_rows);
  m.impl("linear_rows", &radixserve::linear_rows);
  m.impl("quant_linear", &radixserve::quant_linear);
  m.impl("quant_dequantize", &radixserve::quant_dequantize);
  m.impl("decode_layer", &radixserve::decode_layer);
}
