"""The building blocks the models are assembled from (names follow SGLang and vLLM); those
with kernels of their own dispatch through `engine.kernels.custom_op.CustomOp`."""
