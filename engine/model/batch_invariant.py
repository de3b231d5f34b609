"""`--enable-deterministic-inference` on the model's side: every kernel of a step sums each
token's row in one order that depends on that token's own data and position alone.

A step's numbers change with its neighbours in three places (docs/benchmarks/determinism.md):
the matmuls (a library GEMM blocks, and so sums, by the number of rows; `quant_linear` rounds
the activations of one or two rows to integers and hands more than 16 to the GEMM), the
prefill's attention (SDPA or the AMX kernel tile a request's queries and keys by its extend
length, so a prefix read from the radix cache or computed in another chunk sums in another
order), and the one-op decode layer (decode batches only, the default matmuls inside). In
this mode:

- every `Linear`, the LM head and the LoRA terms call `cpu_ops.linear_rows` (plain
  weights) or `quant_linear`'s register path with float activations (quantized ones): one
  dot product per output, summed over K in a fixed order, at any row count;
- every new token of a prefill attends through the decode kernel as a one-token query over
  its request's first `position + 1` keys (`TorchAttnBackend._token_group`), so prefill,
  chunked prefill, a radix hit, a retracted request's re-prefill and decode all sum a
  position's attention the same way;
- the one-op layer (`cpu_ops.decode_layer`, the same kernels called from C++) runs
  every batch, prefill tokens as one-token rows, where the model can use it; else the
  modules run every batch.

RMSNorm, rotary, SiLU-and-mul and the sampler's softmax are per row already, and the
sampler's draws depend on (seed, output position) alone (`seeded_uniform`). Tests:
tests/engine/test_deterministic_inference.py.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.cpu import build as cpu_build
from engine.model.attention import AttentionBackend
from engine.model.attention.torch_backend import TorchAttnBackend
from engine.model.layers.linear import Linear
from engine.model.layers.logits_processor import LogitsProcessor

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
"""The activations the batch-invariant kernels take (float64 has no vector path)."""


def check_supported(
    device: torch.device, dtype: torch.dtype, attn_backend: AttentionBackend
) -> None:
    """Refuse the mode where its kernels cannot run: they are the CPU ones."""
    if device.type != "cpu":
        raise ValueError(
            "--enable-deterministic-inference runs the CPU kernels: "
            f"not supported on {device.type} yet"
        )
    if dtype not in KERNEL_DTYPES:
        raise ValueError(
            f"--enable-deterministic-inference runs float32 or bfloat16 activations, not {dtype}"
        )
    if not isinstance(attn_backend, TorchAttnBackend) or not attn_backend.cpu_kernel:
        raise ValueError(
            "--enable-deterministic-inference needs the CPU kernels (csrc/), which could not "
            "be loaded here (see the log), or was given --attention-backend other than torch"
        )


def make_batch_invariant(model: nn.Module, attn_backend: AttentionBackend) -> None:
    """Switch a loaded model and its attention backend (one `check_supported` passed) to
    the batch-invariant kernels, before any LoRA layer is attached (each takes the setting
    of its base layer)."""
    assert isinstance(attn_backend, TorchAttnBackend) and cpu_build.available()
    for module in model.modules():
        if isinstance(module, (Linear, LogitsProcessor)):
            module.batch_invariant = True
    attn_backend.batch_invariant = True
