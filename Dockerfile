# reformer-serve, one image definition for GPU and CPU hosts:
#   docker build -t reformer-serve .                                  # CUDA 13 (NVIDIA driver >= 580)
#   docker run --gpus all -p 8000:8000 reformer-serve
#   docker build --build-arg VARIANT=cpu -t reformer-serve:cpu .       # CPU hosts
#   docker run -p 8000:8000 reformer-serve:cpu
# Serves the default artifact shipped in the package; REFORMER_* env vars configure it (docs/DEPLOY.md).
#
# CUDA comes from the wheels, not from the base image: PyPI's torch 2.13.0 Linux wheel is the CUDA 13 build
# and depends on CUDA 13's runtime libraries as nvidia-* wheels (cuda-toolkit 13.0.3, nvidia-cudnn-cu13);
# onnxruntime-gpu 1.31.1 is built for CUDA 13 too and its [cuda,cudnn] extras name the same wheels. The
# host needs only the NVIDIA driver (>= 580 for CUDA 13) and the container toolkit. TORCH_VERSION,
# ONNXRUNTIME_GPU_VERSION and CUDA_MAJOR go together: tests/docker/test_image_pairing.py holds the
# known pairings and fails on any other.
ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG VARIANT=cuda
ARG CUDA_MAJOR=13
ARG TORCH_VERSION=2.13.0
ARG ONNXRUNTIME_GPU_VERSION=1.31.1
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# The C kernels are compiled when the package is installed (setup.py: a portable build, and avx2 and avx512
# builds on x86-64, the best the CPU runs chosen at load time); the runtime stage needs no compiler.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml setup.py README.md ./
COPY model ./model
COPY train ./train
COPY export ./export
COPY service ./service
COPY loadtest ./loadtest
COPY docker/install.sh ./docker/install.sh
# Every package install is in this one script; tests/docker/test_install.py runs it (VARIANT=cpu).
RUN docker/install.sh /opt/venv /src

FROM ${PYTHON_IMAGE}
ARG CUDA_MAJOR=13
# NVIDIA_*: what the container toolkit reads on `--gpus all` (this base is no nvidia/cuda image, which
# would set them); NVIDIA_REQUIRE_CUDA makes it refuse, with a message, a driver too old for CUDA 13.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    REFORMER_DEVICE=auto \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    NVIDIA_REQUIRE_CUDA="cuda>=${CUDA_MAJOR}.0"
# libgomp1: the OpenMP runtime the C kernels link (the kernels split a decode step between its threads)
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --gid 10001 reformer \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin reformer
COPY --from=build /opt/venv /opt/venv
USER 10001:10001
WORKDIR /home/reformer
EXPOSE 8000
# /health is liveness (process and model worker alive); readiness (/ready) is the orchestrator's call.
# The start period covers loading and warming up the model.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["reformer"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
