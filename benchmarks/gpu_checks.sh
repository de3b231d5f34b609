#!/usr/bin/env bash
# The checks that need a CUDA GPU, for a machine that has one (CI has none):
#   benchmarks/gpu_checks.sh tests   OUT   the CUDA-only tests (Triton kernels compiled, not
#                                          interpreted), then the engine suite with the GPU as
#                                          every "auto" device (overlap loop on CUDA streams)
#   benchmarks/gpu_checks.sh serving OUT   the serving comparison with the triton backend
# Results go under OUT (junit XML and logs; OUT/serving/results.json, plots and OUT/serving.md).
set -uo pipefail
stage=${1:?tests or serving}
out=${2:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$out/gpu.txt"

case $stage in
tests)
    python3 -m pytest -q -p no:cacheprovider --timeout 120 --junitxml "$out/cuda-tests.xml" \
        tests/engine/model/attention/test_triton_backend.py tests/engine/model/test_runner.py \
        tests/engine/mem/test_mem_pools.py 2>&1 | tee "$out/cuda-tests.log" | tail -15
    timeout "${ENGINE_SUITE_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider --timeout 60 \
        --junitxml "$out/engine-suite.xml" tests/engine 2>&1 | tee "$out/engine-suite.log" | tail -25
    ;;
serving)
    timeout "${SERVING_TIMEOUT:-330}" python3 -m benchmarks.serving.compare --out "$out/serving" \
        --peers hf-bf16 hf-fp32 rs-radix-off rs-overlap-off rs-all-on --bandwidth-gbs 4300 \
        2>&1 | tee "$out/serving.log" | tail -40
    ;;
*)
    echo "unknown stage $stage: tests or serving" >&2
    exit 2
    ;;
esac
