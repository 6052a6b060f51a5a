# reformer-serve, one image definition for GPU and CPU hosts:
#   docker build -t reformer-serve .                                  # CUDA 13 (NVIDIA driver >= 580)
#   docker run --gpus all -p 8000:8000 reformer-serve
#   docker build --build-arg VARIANT=cpu -t reformer-serve:cpu .       # CPU hosts
#   docker run -p 8000:8000 reformer-serve:cpu
# Serves the default artifact shipped in the package; REFORMER_* env vars configure it (docs/DEPLOY.md),
# REFORMER_HOST and REFORMER_PORT included: the command names no flag that would override them.
#
# Building where users build (docs/DEPLOY.md, "Building the image"):
#   --build-arg PYTHON_IMAGE=...   a Python base from your own registry (any Debian-like image with python3,
#                                  its venv module and apt: python:3.12-slim-bookworm, or one debootstrapped
#                                  by bench/docker/base_image.sh)
#   --secret id=ca,src=BUNDLE      a PEM bundle pip and apt trust instead of the base's (a corporate or proxy
#                                  CA with the public roots); a BuildKit secret, mounted only while a RUN
#                                  runs, so it stays in no layer
#   wheels in wheelhouse/          (or `--build-context wheelhouse=DIR` with buildx): pip installs from them
#                                  alone, with --no-index, reaching neither PyPI nor PyTorch's index
#
# CUDA comes from the wheels, not from the base image: PyPI's torch 2.13.0 Linux wheel is the CUDA 13 build
# and depends on CUDA 13's runtime libraries as nvidia-* wheels (cuda-toolkit 13.0.3, nvidia-cudnn-cu13);
# onnxruntime-gpu 1.31.1 is built for CUDA 13 too and its [cuda,cudnn] extras name the same wheels. The
# host needs only the NVIDIA driver (>= 580 for CUDA 13) and the container toolkit. TORCH_VERSION,
# ONNXRUNTIME_GPU_VERSION and CUDA_MAJOR go together: tests/docker/test_image_pairing.py holds the
# known pairings and fails on any other.
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

# The wheels an offline build installs from: the wheelhouse/ folder of the build context (only its README
# when no wheels were put there), or whatever folder buildx's `--build-context wheelhouse=DIR` names.
FROM scratch AS wheelhouse
COPY wheelhouse/ /

FROM ${PYTHON_IMAGE} AS build
ARG VARIANT=cuda
ARG CUDA_MAJOR=13
ARG TORCH_VERSION=2.13.0
ARG ONNXRUNTIME_GPU_VERSION=1.31.1
ARG TORCH_INDEX_URL
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    APP_DIR=/opt/reformer
WORKDIR /src
# The C kernels are compiled when the package is installed (setup.py: a portable build, and avx2 and avx512
# builds on x86-64, the best the CPU runs chosen at load time); the runtime stage needs no compiler.
# hadolint ignore=DL3008
RUN --mount=type=secret,id=ca --mount=type=bind,source=docker/apt-ca.sh,target=/usr/local/bin/apt-ca \
    apt-ca apt-get update \
    && apt-ca apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# The dependencies first, from pyproject.toml alone: a change to the source reuses this layer.
COPY pyproject.toml ./
COPY docker/install.sh ./docker/install.sh
# Every package install is in this one script; tests/docker/test_install.py runs it (VARIANT=cpu).
RUN --mount=type=secret,id=ca --mount=type=bind,from=wheelhouse,target=/wheelhouse \
    docker/install.sh deps /opt/venv /src
COPY setup.py README.md ./
COPY model ./model
COPY train ./train
COPY export ./export
COPY service ./service
COPY loadtest ./loadtest
RUN --mount=type=secret,id=ca --mount=type=bind,from=wheelhouse,target=/wheelhouse \
    docker/install.sh package /opt/venv /src

FROM ${PYTHON_IMAGE}
ARG CUDA_MAJOR=13
ARG VARIANT=cuda
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG SOURCE=https://github.com/reformer-serve/reformer-serve
LABEL org.opencontainers.image.title="reformer-serve" \
      org.opencontainers.image.description="A Reformer language model for long documents, served over HTTP" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.reformer-serve.variant="${VARIANT}"
# NVIDIA_*: what the container toolkit reads on `--gpus all` (this base is no nvidia/cuda image, which
# would set them); NVIDIA_REQUIRE_CUDA makes it refuse, with a message, a driver too old for CUDA 13.
ENV PATH=/opt/reformer/site/bin:/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    REFORMER_DEVICE=auto \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    NVIDIA_REQUIRE_CUDA="cuda>=${CUDA_MAJOR}.0"
# libgomp1: the OpenMP runtime the C kernels link (the kernels split a decode step between its threads)
# hadolint ignore=DL3008
RUN --mount=type=secret,id=ca --mount=type=bind,source=docker/apt-ca.sh,target=/usr/local/bin/apt-ca \
    apt-ca apt-get update \
    && apt-ca apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log
RUN groupadd --gid 10001 reformer \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin reformer
# The dependencies (several GB for CUDA) and the package are two layers: a source change rebuilds the second.
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/reformer/site /opt/reformer/site
COPY docker/healthcheck.py /opt/reformer/healthcheck.py
USER 10001:10001
WORKDIR /home/reformer
EXPOSE 8000
# /health is liveness (process and model worker alive); readiness (/ready) is the orchestrator's call.
# The start period covers loading and warming up the model. The probe asks the address and port the
# server chose: docker/healthcheck.py reads them from the server's own flags and environment.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "/opt/reformer/healthcheck.py"]
ENTRYPOINT ["reformer"]
CMD ["serve"]
