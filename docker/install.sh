#!/usr/bin/env bash
# The image's install steps (the Dockerfile's RUNs that install Python packages), also run by
# tests/docker/test_install.py in a fresh venv with the CPU wheels, so a broken step fails the suite.
#
#   docker/install.sh deps VENV SRC      make the venv; torch and every dependency pyproject.toml names
#   docker/install.sh package VENV SRC   the package itself (compiling the C kernels), no dependencies,
#                                        into APP_DIR/site (its `reformer` command in APP_DIR/site/bin)
#
# Two steps so that the image's dependency layer depends on pyproject.toml alone: a change to the source
# reruns only the second, a few seconds of pip and the kernels' compilation. The package goes to its own
# folder, which the venv finds through a .pth file the first step writes: the runtime stage copies the venv
# and the package as two layers, and a source change leaves the venv's several GB alone.
#
# Environment (the Dockerfile's ARGs):
#   VARIANT                  cuda (default) or cpu
#   TORCH_VERSION            exact torch release, e.g. 2.13.0; every install below is held to it, so pip
#                            never fetches another torch
#   TORCH_INDEX_URL          where torch comes from. Unset: PyPI for cuda (PyPI's Linux torch 2.13 is the
#                            CUDA 13 build; it brings its CUDA libraries as nvidia-* wheels),
#                            https://download.pytorch.org/whl/cpu for cpu. Set but empty: pip's own
#                            configuration decides (the tests: constraints-cpu.txt and local wheels)
#   ONNXRUNTIME_GPU_VERSION  onnxruntime-gpu release for cuda (its CUDA major must be torch's)
#   CUDA_MAJOR               the CUDA major torch and onnxruntime-gpu are built for; checked after install
#   WHEELHOUSE               a folder of wheels (default /wheelhouse, where the Dockerfile mounts them): when
#                            it holds any, pip installs from it alone (--no-index), reaching no index at all
#   CA_BUNDLE                a PEM bundle pip trusts instead of its own (default /run/secrets/ca, where the
#                            BuildKit secret `ca` is mounted while the RUN runs), used when present
#   APP_DIR                  where the package goes (default /opt/reformer)
#   PYTHON                   interpreter that makes the venv (default python3)
set -euo pipefail

STEP=${1:?usage: docker/install.sh deps|package VENV SRC}
VENV=${2:?usage: docker/install.sh deps|package VENV SRC}
SRC=${3:?usage: docker/install.sh deps|package VENV SRC}
VARIANT=${VARIANT:-cuda}
TORCH_VERSION=${TORCH_VERSION:?TORCH_VERSION is required (an exact release)}
CUDA_MAJOR=${CUDA_MAJOR:-13}
WHEELHOUSE=${WHEELHOUSE:-/wheelhouse}
CA_BUNDLE=${CA_BUNDLE:-/run/secrets/ca}
APP_DIR=${APP_DIR:-/opt/reformer}
case "$VARIANT" in
  cuda) : "${ONNXRUNTIME_GPU_VERSION:?ONNXRUNTIME_GPU_VERSION is required for VARIANT=cuda}"
        DEFAULT_INDEX="" ;;
  cpu) DEFAULT_INDEX="https://download.pytorch.org/whl/cpu" ;;
  *) echo "install.sh: VARIANT must be cuda or cpu, not '$VARIANT'" >&2; exit 2 ;;
esac
if [[ -z ${TORCH_INDEX_URL+set} ]]; then TORCH_INDEX_URL=$DEFAULT_INDEX; fi

PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check --quiet)
# The secret is read where it is mounted; nothing copies it, so it leaves with the RUN.
if [[ -s $CA_BUNDLE ]]; then export PIP_CERT=$CA_BUNDLE; fi
INDEX=()
[[ -n $TORCH_INDEX_URL ]] && INDEX=(--index-url "$TORCH_INDEX_URL")
if compgen -G "$WHEELHOUSE/*.whl" >/dev/null; then
  PIP+=(--no-index --find-links "$WHEELHOUSE")
  INDEX=()
  echo "install.sh: installing from $WHEELHOUSE only (--no-index)"
fi
PIN="$VENV/torch-pin.txt"

case "$STEP" in
  deps)
    "${PYTHON:-python3}" -m venv "$VENV"
    echo "torch==$TORCH_VERSION" >"$PIN"
    # setuptools and wheel build the package in the next step without build isolation, so that step
    # needs no index either.
    "${PIP[@]}" "setuptools>=68" wheel
    "${PIP[@]}" "${INDEX[@]}" -c "$PIN" "torch==$TORCH_VERSION"
    "$VENV/bin/python" - "$SRC/pyproject.toml" >"$VENV/requirements.txt" <<'PY'
import sys
import tomllib

print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))
PY
    "${PIP[@]}" -c "$PIN" -r "$VENV/requirements.txt"
    purelib=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$APP_DIR/site" >"$purelib/reformer-serve-app.pth"
    if [[ $VARIANT == cuda ]]; then
      # Both wheels provide the `onnxruntime` module: the CPU one the package depends on makes way for the
      # CUDA build; its cuda/cudnn extras name the same nvidia-* CUDA 13 wheels torch already brought.
      "$VENV/bin/python" -m pip uninstall --quiet -y onnxruntime
      "${PIP[@]}" -c "$PIN" "onnxruntime-gpu[cuda,cudnn]==$ONNXRUNTIME_GPU_VERSION"
    fi
    exit 0 ;;
  package) ;;
  *) echo "install.sh: STEP must be deps or package, not '$STEP'" >&2; exit 2 ;;
esac

# A regular (not editable) install: the default artifact is package data of `export` and lands in
# the package's folder with it. --no-deps: the step above installed them (pip check says if any is missing).
rm -rf "$APP_DIR/site"
"${PIP[@]}" --no-deps --no-build-isolation --target "$APP_DIR/site" "$SRC"
if ! problems=$("$VENV/bin/python" -m pip check); then
  # the CUDA image holds onnxruntime-gpu, which provides the `onnxruntime` module the package depends on
  [[ $VARIANT == cuda ]] && problems=$(grep -v "requires onnxruntime, which is not installed" <<<"$problems" || true)
  if [[ -n $problems ]]; then echo "$problems" >&2; exit 1; fi
fi

# What was installed is what was asked for (no GPU is needed to read the builds); run from / so that the
# installed packages are imported, not the source beside them.
cd /
VARIANT=$VARIANT TORCH_VERSION=$TORCH_VERSION CUDA_MAJOR=$CUDA_MAJOR APP_DIR=$APP_DIR "$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import os

import onnxruntime
import torch

import export
import service
from model.kernels import load

variant, major = os.environ["VARIANT"], os.environ["CUDA_MAJOR"]
assert torch.__version__.split("+")[0] == os.environ["TORCH_VERSION"], torch.__version__
if variant == "cuda":
    assert torch.version.cuda is not None and torch.version.cuda.split(".")[0] == major, torch.version.cuda
    assert "CUDAExecutionProvider" in onnxruntime.get_available_providers()
    assert not any(d.metadata["Name"] == "onnxruntime" for d in md.distributions()), "CPU onnxruntime left"
else:
    assert torch.version.cuda is None, f"a CUDA torch ({torch.version.cuda}) in the CPU image"
app = os.environ["APP_DIR"]
assert all(m.__file__.startswith(app) for m in (export, service)), (export.__file__, app)
shipped = os.path.join(os.path.dirname(export.__file__), "default_artifact")
assert os.path.isdir(shipped) and os.listdir(shipped), "the default artifact was not installed"
# setup.py skips a kernel variant whose compilation fails (optional): the image must carry at least one
kernels = load()
assert kernels.loaded and kernels.source.startswith("installed:"), (kernels.source, kernels.reason)
print(f"installed: torch {torch.__version__} (CUDA {torch.version.cuda}), onnxruntime "
      f"{onnxruntime.__version__} {onnxruntime.get_available_providers()}, kernels {kernels.source}")
PY
