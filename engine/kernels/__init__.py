"""The compute kernels the model's layers call, one library per device kind:
`cpu/` (C++ per instruction-set path, built on first use) and `triton/` (CUDA), behind one
dispatch rule for layers (`custom_op.CustomOp`)."""
