"""The Python face of the CPU kernel library (`csrc/`, one op schema each in
`csrc/registration.cpp`): typed wrappers over `torch.ops.radixserve_cpu`, which
`build.available()` loads. Layers reach them through `CustomOp.forward_cpu`
(`engine/kernels/custom_op.py`); docs/cpu-kernels.md has the paths, formats and how to add
a kernel.

Why C++: at decode sizes a step's cost on CPU is per-op dispatch and memory traffic, not
arithmetic.
- `decode_attention` (`csrc/decode_attention.cpp`): the torch ops of the portable path
  gather every key of the batch into a new tensor before two batched matmuls; the kernel
  reads keys and values in place through each request's slots, one task per request (or
  per KV head of it, when requests are few).
- `extend_attention` (`csrc/x86/extend_attention.cpp`): the prefill attention of a bf16
  batch's multi-token requests in one call, the products on AMX tiles, where SDPA takes them
  at float speed, one call per request over keys gathered first.
- `rms_norm` (`csrc/norm.cpp`): the residual add and RMSNorm of 16-bit activations in one
  op, where torch dispatches about eight.
- `rotary` (`csrc/rotary.cpp`), `silu_and_mul` and `gelu_tanh_and_mul`
  (`csrc/activation.cpp`): a layer's rotary embedding and gated activation in one op each,
  where torch dispatches three or four.
- `linear_amx` and `linear_few_rows` (`csrc/x86/linear_bf16.cpp`): bf16 matmuls on AMX tiles
  over a weight packed once for them (`amx_pack`), and by dot products over the plain weight
  for the one or two rows (`FEW_ROWS`) of the smallest decode batches. oneDNN's packed
  kernels pay a fixed cost per call and read small weights well below the bandwidth
  (docs/benchmarks/model.md).
- `quant_linear` (`csrc/quant_linear.cpp`): matmuls over weights kept quantized (GGUF's
  blocks, int8 rows; the layouts in `csrc/quant_formats.h`), widened in registers for decode
  rows (`csrc/quant_gemv.h`, or integer products in `csrc/x86/quant_integer.h`) and per band
  for a prefill's GEMM: a decode step reads 4.5-8.5 bits a weight instead of 16.
- `linear_rows` (`csrc/linear_rows.cpp`): the matmul of plain weights under
  `--enable-deterministic-inference`, each row summed in one order at any row count (with
  `quant_linear`'s `batch_invariant` for quantized ones, and `decode_attention` over every
  token of a prefill): a library GEMM's order changes with the number of rows.
- `decode_layer` (`csrc/decode_layer.cpp`): a whole decoder layer of a decode batch (Llama's,
  Qwen3's, Gemma 3's), the kernels above called from C++ in the modules' order: one Python
  dispatch per layer where the modules make about fifteen, whose Python and dispatch were a
  large share of a small batch's step on two cores (docs/benchmarks/model.md, "One op per
  decode layer").
"""

from __future__ import annotations

import functools

import torch

from engine.kernels.cpu.build import available

FEW_ROWS = 2
"""Up to this many rows `linear_few_rows` beats both oneDNN's packed bf16 matmul and the AMX
kernel on the CPUs measured (docs/benchmarks/model.md)."""


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    scaling: float,
    slot_index: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """`[n, heads, dim]` attention of one-token queries over the first `seq_lens[r]` slots
    of row r of `slots` (`[n, max_len]` int64), the pool buffers `[slots, kv_heads, dim]`;
    with `slot_index` (`[n]` int64), query r reads row `slot_index[r]` of `slots` instead,
    so that the tokens of one request share its row. A sliding `window` > 0 reads only the
    last `window` of those slots (the query sits at position `seq_lens[r] - 1`): the slots
    before them are never read, so they may name freed KV."""
    out: torch.Tensor = torch.ops.radixserve_cpu.decode_attention(
        q, k_buffer, v_buffer, slots, seq_lens, scaling, slot_index, window
    )
    return out


@functools.cache
def extend_attention_available() -> bool:
    """The kernels are loaded and `extend_attention` may use AMX here."""
    return available() and bool(torch.ops.radixserve_cpu.extend_attention_supported())


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    slots: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    q_starts: torch.Tensor,
    scaling: float,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention of bf16 multi-token requests `[T, heads, head_dim]` (head_dim a
    multiple of 64): request r's `extend_lens[r]` queries start at row `q_starts[r]` of `q`
    and see the first `prefix_lens[r] + i + 1` of its `slots[r]` (int64 `[n, max_len]`: its
    prefix, then its new tokens); with a sliding `window` > 0, only the last `window` of
    those, and no slot before the first new token's window is read. Rows of `q` outside
    every request come back zero."""
    out: torch.Tensor = torch.ops.radixserve_cpu.extend_attention(
        q, k_buffer, v_buffer, slots, prefix_lens, extend_lens, q_starts, scaling, window
    )
    return out


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`RMSNorm` of bf16/half `[T, hidden]` rows, `residual += x` first (in place) when given:
    float32 inside, rounded where transformers rounds (normalised, then times the weight)."""
    out: torch.Tensor = torch.ops.radixserve_cpu.rms_norm(x, residual, weight, eps)
    return out


def rotary(qk: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotate `qk` `[T, heads, head_dim]` (float32, bf16 or half; whole heads side by side in
    each row) in place by `cos_sin` `[T, 2, 1, head_dim]` (`RotaryEmbedding.cos_sin`),
    bit for bit as the torch ops of `RotaryEmbedding.forward`."""
    torch.ops.radixserve_cpu.rotary(qk, cos_sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of bf16/half `x` `[T, 2 * d]` (gate, then up), rounded where torch's
    `F.silu(gate).mul_(up)` rounds."""
    out: torch.Tensor = torch.ops.radixserve_cpu.silu_and_mul(x)
    return out


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`gelu(gate, approximate="tanh") * up` of bf16/half `x` `[T, 2 * d]`, rounded where
    torch's two ops round."""
    out: torch.Tensor = torch.ops.radixserve_cpu.gelu_tanh_and_mul(x)
    return out


@functools.cache
def amx_available() -> bool:
    """The kernels are loaded, were built with AMX, and the kernel may use it here."""
    return available() and bool(torch.ops.radixserve_cpu.amx_available())


def amx_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` `[N, K]` bf16 as `linear_amx` reads it (N padded to a multiple of 64 and K to
    one of 32), where that applies (else None)."""
    if not (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and amx_available()):
        return None
    packed: torch.Tensor = torch.ops.radixserve_cpu.amx_pack(weight.detach())
    return packed


def is_amx_packed(packed: torch.Tensor) -> bool:
    """Whether `packed` came from `amx_pack` (6-D) rather than from oneDNN (2-D)."""
    return packed.dim() == 6


def linear_amx(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x @ weight.T + bias` for bf16 `x` `[rows, K]` over `amx_pack(weight)` (`weight`
    `[out_features, K]`): float32 sums, the bias added before the one rounding."""
    out: torch.Tensor = torch.ops.radixserve_cpu.linear_amx(x, packed, out_features, bias)
    return out


def linear_few_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` for bf16 `x` `[rows, in]` (rows up to `FEW_ROWS`), float32 sums."""
    out: torch.Tensor = torch.ops.radixserve_cpu.linear_few_rows(x, weight)
    return out


def decode_layer(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    norms: list[torch.Tensor | None],
    projections: list[torch.Tensor],
    formats: list[int],
    parts: list[int],
    activation: str,
    activation_bits: int,
    cos_sin: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out_cache_loc: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_index: torch.Tensor | None,
    batch_invariant: bool,
    window: int,
    num_heads: int,
    num_kv_heads: int,
    scaling: float,
    eps: float,
) -> torch.Tensor:
    """One decoder layer of a decode batch, bf16 or, over quantized projections, float32:
    the MLP output (after the MLP-output norm where there is one); the attention output is
    added to the residual stream in place (to `hidden` itself when `residual` is None), the
    new K/V written at `out_cache_loc`. The arguments from `norms` to `activation_bits` are
    `DecodeOpWeights`' fields in its order (engine/model/models/llama.py: the six norms,
    None where the layer lacks one, and each projection's parts with their formats); those
    from `k_buffer` to `window` are `CpuDecodeInputs`' (`window`: the layer's sliding
    window, 0 for none, as `decode_attention` takes it)."""
    out: torch.Tensor = torch.ops.radixserve_cpu.decode_layer(
        hidden,
        residual,
        norms,
        projections,
        formats,
        parts,
        activation,
        cos_sin,
        k_buffer,
        v_buffer,
        out_cache_loc,
        slots,
        seq_lens,
        slot_index,
        num_heads,
        num_kv_heads,
        scaling,
        eps,
        activation_bits,
        FEW_ROWS,
        batch_invariant,
        window,
    )
    return out


def quant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    format: int,
    bias: torch.Tensor | None = None,
    activation_bits: int = 32,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """`x @ W^T + bias` for float/bf16/half `x` `[rows, K]` over `weight` held quantized
    (`engine/model/layers/quantization.py`: uint8 rows of `format`), in `x`'s dtype; decode
    rows rounded to `activation_bits` (16 or 8) per block of 32 first, or kept float (32).
    `batch_invariant` (float activations only): every row summed in one order at any row
    count."""
    out: torch.Tensor = torch.ops.radixserve_cpu.quant_linear(
        x, weight, format, bias, activation_bits, batch_invariant
    )
    return out


def linear_rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x @ W^T + bias` for `x` `[rows, K]` over a plain float/bf16/half `weight`, in `x`'s
    dtype, each row summed in one order at any row count (`csrc/linear_rows.cpp`)."""
    out: torch.Tensor = torch.ops.radixserve_cpu.linear_rows(x, weight, bias)
    return out


def quant_dequantize(weight: torch.Tensor, format: int, in_features: int) -> torch.Tensor:
    """The float32 `[N, in_features]` weights of quantized rows `weight`."""
    out: torch.Tensor = torch.ops.radixserve_cpu.quant_dequantize(weight, format, in_features)
    return out


def quant_format_table() -> list[int]:
    """The kernels' block layouts, flat: (format, weights per block, bytes per block, bytes
    after a row's blocks) for each format `quant_linear` takes."""
    table: list[int] = torch.ops.radixserve_cpu.quant_format_table()
    return table
