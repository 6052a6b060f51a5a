# reformer-serve on a GPU host:
#   docker build -t reformer-serve .
#   docker run --gpus all -p 8000:8000 reformer-serve
# serves the default artifact shipped in the package on CUDA; REFORMER_* env vars configure it
# (docs/DEPLOY.md). The CUDA versions of the base image, the torch wheel index and onnxruntime-gpu go
# together: change them together.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG ONNXRUNTIME_GPU_VERSION=1.31.1
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# Ubuntu's own Python (3.12 on 24.04); the base image's security updates decide the exact patch level,
# so the versions are not pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the CUDA wheel index, so that the package's `torch>=2.4` is already met and pip
# does not fetch a second build from PyPI.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY model ./model
COPY train ./train
COPY export ./export
COPY service ./service
COPY bench ./bench
# A regular (not editable) install: the default artifact is package data of `export` and lands in
# site-packages with it. The package depends on the CPU `onnxruntime`; both wheels provide the same
# module, so the CPU one is swapped for the CUDA build.
RUN pip install . \
    && pip uninstall -y onnxruntime \
    && pip install "onnxruntime-gpu==${ONNXRUNTIME_GPU_VERSION}"

FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    REFORMER_DEVICE=auto
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 reformer \
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
