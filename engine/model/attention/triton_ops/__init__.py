"""Triton attention kernels over the paged KV pool (extend and split-KV decode).

Every `tl.dot` asks for `input_precision="ieee"`: fp32 tiles would otherwise run as TF32 on
tensor cores (10-bit mantissa), too coarse for the fp32 parity tests against
transformers; 16-bit tiles are unaffected.
"""

from engine.model.attention.triton_ops.decode_attention import decode_attention_fwd
from engine.model.attention.triton_ops.extend_attention import extend_attention_fwd

__all__ = ["decode_attention_fwd", "extend_attention_fwd"]
