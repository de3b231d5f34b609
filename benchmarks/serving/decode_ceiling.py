"""The memory-bandwidth ceiling of batched decode: one step reads every weight once and
every request's KV once, so it cannot take less than those bytes over the bandwidth.

At batch 32 and 512-token contexts the embedded SmolLM2-135M in bf16 reads about 270 MB
of weights and 380 MB of KV per step; at 27 GB/s (the default bandwidth, taken for the CPU
machine the recorded runs were made on) that is about 24 ms per step, 1,300 tokens/s.
Measured decode speed over this ceiling says how much of the machine a peer uses;
`compare --decode-only` measures it.

    python -m benchmarks.serving.decode_ceiling [--batch 32] [--context 512] \
        [--bandwidth-gbs 27]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from engine.model.config import ModelConfig

DEFAULT_BANDWIDTH_GBS = 27.0


@dataclass(frozen=True)
class Ceiling:
    weight_bytes: int
    kv_bytes: int
    bandwidth_gbs: float
    batch: int

    @property
    def step_ms(self) -> float:
        return (self.weight_bytes + self.kv_bytes) / (self.bandwidth_gbs * 1e9) * 1000

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_ms * 1000


def decode_params(cfg: ModelConfig) -> int:
    """Parameters one decode step reads: all of them, except that an untied input embedding
    is only gathered (a few rows), while the output projection is read whole."""
    h, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    attention = h * q + 2 * h * kv + q * h
    attention += (q + 2 * kv) * cfg.qkv_bias + h * cfg.o_proj_bias + 2 * hd * cfg.qk_norm
    mlp = 3 * h * i + (2 * i + h) * cfg.mlp_bias
    layer = attention + mlp + 2 * h
    return cfg.num_hidden_layers * layer + h + cfg.vocab_size * h


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int) -> int:
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes


def ceiling(
    cfg: ModelConfig,
    batch: int,
    context: int,
    dtype_bytes: int = 2,
    bandwidth_gbs: float = DEFAULT_BANDWIDTH_GBS,
) -> Ceiling:
    """Bytes of one decode step of `batch` requests holding `context` tokens each."""
    return Ceiling(
        decode_params(cfg) * dtype_bytes,
        batch * context * kv_bytes_per_token(cfg, dtype_bytes),
        bandwidth_gbs,
        batch,
    )


def main() -> None:
    from engine.model.loader import open_checkpoint

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.serving.decode_ceiling", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--dtype-bytes", type=int, default=2, help="2 for bf16")
    parser.add_argument("--bandwidth-gbs", type=float, default=DEFAULT_BANDWIDTH_GBS)
    args = parser.parse_args()
    c = ceiling(
        open_checkpoint(args.model).config,
        args.batch,
        args.context,
        args.dtype_bytes,
        args.bandwidth_gbs,
    )
    print(
        f"batch {args.batch}, {args.context}-token contexts, {args.dtype_bytes}-byte values: "
        f"weights {c.weight_bytes / 1e6:.0f} MB + KV {c.kv_bytes / 1e6:.0f} MB per step; "
        f"at {c.bandwidth_gbs:g} GB/s "
        f"{c.step_ms:.1f} ms/step = {c.tokens_per_s:,.0f} tokens/s at most"
    )


if __name__ == "__main__":
    main()
