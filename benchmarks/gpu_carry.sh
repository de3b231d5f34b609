#!/usr/bin/env bash
# Run here, before asking for a lent GPU machine: prepares under .carry/ (git-ignored) what
# that machine lacks, for the device tool's `carry` (at most 64 MiB a call, tree included):
#   .carry/wheels/    Python 3.12 wheels of the packages the engine, its benchmarks and its
#                     CUDA tests import that the machine's image does not hold, at the versions
#                     installed in .venv (the versions tested here)
#   .carry/model-1/, .carry/model-2/
#                     the embedded GGUF (94 MiB) in two halves, each with the whole file's sha256
# Two calls then run benchmarks/gpu_checks.sh's graph stage, back to back (the machine is given
# back after 30 s idle, and the first half must still be there for the second call):
#   carry [.carry/wheels, .carry/model-1]:  benchmarks/gpu_checks.sh graph-tests $OUT
#   carry [.carry/wheels, .carry/model-2]:  benchmarks/gpu_checks.sh graph-bench $OUT
# gpu_checks.sh installs the wheels and joins the halves itself (`setup`).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}

# Not in the GPU image (the device tool's KINDS.md lists what is), or older there than these need.
carried=(
    gguf xgrammar apache-tvm-ffi fastapi starlette pydantic pydantic-core annotated-types
    typing-inspection uvicorn pyzmq msgspec opentelemetry-api opentelemetry-sdk
    opentelemetry-semantic-conventions opentelemetry-proto opentelemetry-exporter-otlp-proto-http
    opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-common
    opentelemetry-exporter-http-transport googleapis-common-protos httpx2 httpcore2 jsonschema
    jsonschema-specifications referencing rpds-py typing-extensions anyio idna truststore
)
mapfile -t pins < <("$python" - "${carried[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        print(name)
EOF
)

rm -rf .carry/wheels
mkdir -p .carry/wheels
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .carry/wheels "${pins[@]}"

gguf=$("$python" -c 'from engine.model.embedded import embedded_model_path as p; print(p())')
digest=$(sha256sum "$gguf" | cut -d' ' -f1)
half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
for part in 1 2; do
    rm -rf ".carry/model-$part"
    mkdir -p ".carry/model-$part"
    dd if="$gguf" of=".carry/model-$part/part" bs="$half" skip=$((part - 1)) count=1 status=none
    printf '%s  %s\n' "$digest" "$(basename "$gguf")" >".carry/model-$part/sha256"
done
du -sh .carry/wheels .carry/model-1 .carry/model-2
