"""Triton kernels for CUDA: the decoder layer's elementwise steps (`layers`), paged
attention (`extend_attention`, `decode_attention`) and the LoRA segment matmul (`lora`).
Importing any of them imports Triton, so callers import them only for CUDA tensors (or
under Triton's interpreter in tests).

Every `tl.dot` asks for `input_precision="ieee"`: fp32 tiles would otherwise run as TF32 on
tensor cores (10-bit mantissa), too coarse for the fp32 parity tests against
transformers; 16-bit tiles are unaffected.
"""
