#!/usr/bin/env bash
# The GPU check (bench/gpu/README.md, "GPU check"): one call on a lent GPU machine, under 8 minutes, exit status 0 only
# when every step passed. It uses the machine's own python3 (its CUDA torch, nvidia-ml-py,
# prometheus-client, httpx, safetensors, onnxruntime) and installs the wheels that travel with the tree
# (bench/wheels: fastapi, uvicorn, pydantic, pydantic-settings, starlette and their dependencies; made here
# by `make gpu-wheels`) into a scratch folder on PYTHONPATH. bench/gpu/gpu_check.py does the work and writes
# bench/results/gpu_check.json.
#
#   bench/gpu/gpu_check.sh [--dry-run] [--artifact DIR] [--out FILE] [--wheels DIR]
#
#   --dry-run       the same steps on the CPU at tiny sizes, float32 (the test suite runs this)
#   --artifact DIR  artifact to serve (default: the one shipped in the package)
#   --out FILE      the JSON report (default bench/results/gpu_check.json; server logs beside it)
#   --wheels DIR    wheels to install first (default bench/wheels, when it holds any)
#   --budget-s S    stop and fail after S seconds (at most the default 440)
# GPU_CHECK_PYTHON names the interpreter (default python3).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
PY=${GPU_CHECK_PYTHON:-python3}
WHEELS="$REPO/bench/wheels"
# The whole run, the wheel install included, stays inside 8 minutes: 20 s for the install, the Python
# part stops itself at 440 s and is killed at 450 s.
INSTALL_S=20 BUDGET_S=440 KILL_S=450
PASS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) PASS+=(--dry-run); shift ;;
    --artifact) PASS+=(--artifact "$(realpath "$2")"); shift 2 ;;
    --out) PASS+=(--out "$(realpath -m "$2")"); shift 2 ;;
    --wheels) WHEELS=$(realpath "$2"); shift 2 ;;
    --budget-s) (( ${2%.*} < BUDGET_S )) && BUDGET_S=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown option $1" >&2; exit 2 ;;
  esac
done

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  SITE=$(mktemp -d /tmp/gpu-check-site.XXXXXX)
  timeout "$INSTALL_S" "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
    --disable-pip-version-check --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$SITE:$PYTHONPATH"
  echo "gpu_check: installed $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $SITE"
fi
"$PY" - <<'PY'
import importlib, sys
needed = ("torch", "fastapi", "uvicorn", "pydantic", "pydantic_settings", "starlette", "prometheus_client",
          "httpx", "safetensors", "onnxruntime", "numpy")
missing = [name for name in needed if importlib.util.find_spec(name) is None]
if missing:
    sys.exit(f"gpu_check: missing Python packages: {', '.join(missing)} (run `make gpu-wheels` here and carry bench/wheels)")
PY
exec timeout --kill-after=5 "$KILL_S" "$PY" "$REPO/bench/gpu/gpu_check.py" --budget-s "$BUDGET_S" "${PASS[@]}"
