#!/usr/bin/env bash
# The one script a GPU host runs to check the real thing (DESIGN.md §8, issue 5): it installs the
# package into a venv that sees the host's CUDA build of torch, starts `reformer serve` on CUDA, waits
# for /ready, sends /generate and /embed requests of 1K to 64K bytes, scrapes /metrics and prints the
# reformer_gpu_* series and the timings, stops the server with SIGTERM (a clean drain exits 0), times
# the model's forward pass at 1K-64K tokens on the device, and runs bench/forward.py when it can target
# the device. Every step has a timeout; the whole run stays under 8 minutes.
#
#   bench/gpu_check.sh [--docs DIR] [--artifact DIR] [--out DIR] [--port N] [--wheels DIR] [--allow-cpu]
#
#   --docs DIR      text files to cut the requests from (default: generated text)
#   --artifact DIR  artifact to serve (default: the one shipped in the package)
#   --out DIR       where the logs, /metrics scrape and JSON summary go (default bench/results/gpu_check)
#   --wheels DIR    install offline from these wheels (a host with no package index)
#   --allow-cpu     run on the CPU when no GPU is visible (to try the script itself; no GPU series then)
#   --skip-install  use the venv as it is (GPU_CHECK_VENV names it; default /tmp/reformer-gpu-check-venv)
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
DOCS=""
ARTIFACT=""
OUT="$REPO/bench/results/gpu_check"
PORT=8000
WHEELS=""
ALLOW_CPU=0
SKIP_INSTALL=0
VENV=${GPU_CHECK_VENV:-/tmp/reformer-gpu-check-venv}
# Per-step limits (seconds): install, load + warm-up, all requests, forward benchmark, drain.
INSTALL_S=${GPU_CHECK_INSTALL_S:-150} READY_S=${GPU_CHECK_READY_S:-180} STOP_S=45
REQUESTS_S=${GPU_CHECK_REQUESTS_S:-120} FORWARD_S=${GPU_CHECK_FORWARD_S:-150}

while [[ $# -gt 0 ]]; do
  case "$1" in
    --docs) DOCS=$(realpath "$2"); shift 2 ;;
    --artifact) ARTIFACT=$(realpath "$2"); shift 2 ;;
    --out) OUT=$(realpath -m "$2"); shift 2 ;;
    --port) PORT=$2; shift 2 ;;
    --wheels) WHEELS=$(realpath "$2"); shift 2 ;;
    --allow-cpu) ALLOW_CPU=1; shift ;;
    --skip-install) SKIP_INSTALL=1; shift ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown option $1" >&2; exit 2 ;;
  esac
done

mkdir -p "$OUT"
START=$(date +%s)
step() { printf '\n== [%4ds] %s\n' "$(( $(date +%s) - START ))" "$*"; }

step "venv $VENV (system site packages: the host's CUDA torch)"
if [[ ! -x "$VENV/bin/python" ]]; then
  python3 -m venv --system-site-packages "$VENV"
fi
PY="$VENV/bin/python"
PIP_ARGS=(--quiet --disable-pip-version-check)
[[ -n "$WHEELS" ]] && PIP_ARGS+=(--no-index --find-links "$WHEELS")
# A torch already installed (the host's CUDA build) satisfies the package's torch>=2.4: pip keeps it.
if [[ $SKIP_INSTALL == 0 ]]; then
  timeout "$INSTALL_S" "$PY" -m pip install "${PIP_ARGS[@]}" -e "$REPO"
fi
"$PY" - <<'EOF'
import torch
print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, GPU visible: {torch.cuda.is_available()}")
for index in range(torch.cuda.device_count()):
    props = torch.cuda.get_device_properties(index)
    print(f"  cuda:{index} {props.name}, {props.total_memory / 2**30:.1f} GiB")
EOF
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  DEVICE=cuda
elif [[ $ALLOW_CPU == 1 ]]; then
  DEVICE=cpu
  echo "no GPU visible: running on the CPU as asked (--allow-cpu); the GPU series will be absent"
else
  echo "gpu_check: torch sees no GPU (use --allow-cpu to try the script on a CPU host)" >&2
  exit 1
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total \
  --format=csv | tee "$OUT/nvidia-smi-before.csv"

if [[ -z "$DOCS" ]]; then
  DOCS="$OUT/docs"
  step "generating text documents in $DOCS (no --docs given)"
  mkdir -p "$DOCS"
  "$PY" - "$DOCS" <<'EOF'
import random, sys
from pathlib import Path
# Seeded pseudo-prose with accents and punctuation, so the byte tokenizer sees multi-byte characters.
words = ("the of and to in that was he it his with had for as at by on not be but from which she her all "
         "said were they have one been this you prince pierre natasha raskolnikov moscow café naïve war "
         "peace crime punishment house letter night morning road river long short window garden").split()
rng = random.Random(0)
for book in range(3):
    sentences = []
    for _ in range(9000):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(6, 18)))
        sentences.append(sentence.capitalize() + rng.choice([".", ".", "!", "?", ";"]))
    Path(sys.argv[1], f"book{book}.txt").write_text(" ".join(sentences), encoding="utf-8")
EOF
fi

SERVER_ARGS=(serve --host 127.0.0.1 --port "$PORT" --device "$DEVICE" --grace-period-s 30)
[[ -n "$ARTIFACT" ]] && SERVER_ARGS+=("$ARTIFACT")
step "starting: reformer ${SERVER_ARGS[*]}"
"$VENV/bin/reformer" "${SERVER_ARGS[@]}" >"$OUT/server.log" 2>&1 &
SERVER_PID=$!
cleanup() { kill "$SERVER_PID" 2>/dev/null || true; }
trap cleanup EXIT

step "waiting for /ready (at most ${READY_S}s: load and warm-up)"
READY_START=$(date +%s)
until curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null; do
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "gpu_check: the server exited before it was ready; its log:" >&2
    tail -40 "$OUT/server.log" >&2; exit 1
  fi
  if (( $(date +%s) - READY_START > READY_S )); then
    echo "gpu_check: not ready after ${READY_S}s; log tail:" >&2; tail -40 "$OUT/server.log" >&2; exit 1
  fi
  sleep 1
done
echo "ready after $(( $(date +%s) - READY_START ))s"
curl -sf "http://127.0.0.1:$PORT/info" >"$OUT/info.json" || true

step "requests of 1K-64K bytes: /embed and /generate, then 8 concurrent 4K embeds"
FAILED_STEPS=()
timeout "$REQUESTS_S" "$PY" - "http://127.0.0.1:$PORT" "$DOCS" "$OUT/requests.json" <<'EOF' \
  || { echo "gpu_check: the requests step failed or ran out of time (exit $?)"; FAILED_STEPS+=(requests); }
import asyncio, json, sys, time
from pathlib import Path
import httpx

url, docs_dir, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
text = " ".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted(docs_dir.glob("*.txt")))
data = text.encode("utf-8")
if len(data) < 70_000:
    sys.exit(f"gpu_check: {docs_dir} holds {len(data)} bytes of text; 64K-byte requests need more")

def cut(nbytes: int, offset: int = 0) -> str:
    # Cut on a byte budget, dropping a split multi-byte character at the end.
    return data[offset : offset + nbytes].decode("utf-8", errors="ignore")

info = httpx.get(f"{url}/info", timeout=30).json()
print("server:", json.dumps({k: info.get(k) for k in ("model_id", "backend", "device", "dtype", "version")}))
NEW_TOKENS = 32
# Inputs longer than the model's limit keep their last tokens; the prompt leaves room for the new ones.
max_input = int(info.get("limits", {}).get("max_input_tokens") or 65536)
prompt_budget = max(1, max_input - NEW_TOKENS)
rows = []
print(f"{'route':<22}{'bytes':>7}{'status':>9}{'seconds':>9}{'prompt tok':>11}{'new tok':>8}", flush=True)

def show(row: dict) -> None:
    print(f"{row['route']:<22}{row['bytes']:>7}{str(row['status']):>9}{row['seconds']:>9.3f}"
          f"{row.get('x-prompt-tokens') or '':>11}{row.get('x-generated-tokens') or '':>8}", flush=True)
    if "body" in row:
        print("    ", row["body"], flush=True)

with httpx.Client(base_url=url, timeout=90) as client:
    for nbytes in (1024, 4096, 16384, 65536):
        doc = cut(nbytes)
        for route, body in (
            ("/embed", {"inputs": doc, "truncate": True}),
            ("/generate", {"inputs": doc,
                           "parameters": {"max_new_tokens": NEW_TOKENS, "truncate": prompt_budget}}),
        ):
            start = time.perf_counter()
            response = client.post(route, json=body)
            elapsed = time.perf_counter() - start
            rows.append({"route": route, "bytes": len(doc.encode()), "status": response.status_code,
                         "seconds": round(elapsed, 4),
                         **{h: response.headers.get(h) for h in ("x-prompt-tokens", "x-generated-tokens",
                                                                 "x-queue-time", "x-inference-time")}})
            if response.status_code != 200:
                rows[-1]["body"] = response.text[:300]
            show(rows[-1])

async def concurrent_embeds(n: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=90) as client:
        start = time.perf_counter()
        responses = await asyncio.gather(*(client.post("/embed", json={"inputs": cut(4096, 4096 * i)})
                                           for i in range(n)))
        elapsed = time.perf_counter() - start
    statuses = sorted({r.status_code for r in responses})
    return {"route": "/embed x8 concurrent", "bytes": 4096, "status": statuses,
            "seconds": round(elapsed, 4), "requests_per_s": round(n / elapsed, 2)}

rows.append(asyncio.run(concurrent_embeds(8)))
show(rows[-1])
print(f"    {rows[-1]['requests_per_s']} requests/s")
out.write_text(json.dumps({"info": info, "requests": rows}, indent=2))
failed = [r for r in rows if r["status"] not in (200, [200])]
sys.exit(1 if failed else 0)
EOF

step "/metrics: GPU series and request counters"
curl -sf "http://127.0.0.1:$PORT/metrics" >"$OUT/metrics.txt"
grep -E '^reformer_gpu_' "$OUT/metrics.txt" || echo "(no reformer_gpu_* series: no GPU in use)"
grep -E '^reformer_(requests_total|request_duration_seconds_(sum|count)|batch_size_(sum|count))' \
  "$OUT/metrics.txt" || true
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=memory.used,memory.total,utilization.gpu \
  --format=csv | tee "$OUT/nvidia-smi-after.csv"

step "SIGTERM: the server drains and exits (at most ${STOP_S}s)"
STOP_START=$(date +%s)
kill -TERM "$SERVER_PID"
if timeout "$STOP_S" tail --pid="$SERVER_PID" -f /dev/null; then
  wait "$SERVER_PID" && CODE=0 || CODE=$?
  echo "exited with code $CODE after $(( $(date +%s) - STOP_START ))s"
  [[ $CODE == 0 ]] || FAILED_STEPS+=(drain)
else
  echo "gpu_check: still running ${STOP_S}s after SIGTERM" >&2
  FAILED_STEPS+=(drain)
fi
trap - EXIT

step "forward pass of the served model on $DEVICE: tokens/s and peak memory, 1K-64K tokens"
timeout "$FORWARD_S" "$PY" - "$DEVICE" "$ARTIFACT" "$OUT/forward_served.json" <<'EOF' \
  || { echo "gpu_check: the forward timing failed or ran out of time (exit $?)"; FAILED_STEPS+=(forward); }
import json, sys, time
import torch
from export import load_artifact

device, artifact_path, out = torch.device(sys.argv[1]), sys.argv[2] or None, sys.argv[3]
artifact = load_artifact(artifact_path) if artifact_path else load_artifact()
dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
model = artifact.model.to(device=device, dtype=dtype).eval()
limit = artifact.config.max_position_embeddings
rows = []
print(f"{'tokens':>7}{'ms':>10}{'tokens/s':>12}{'peak MiB':>10}   ({dtype}, limit {limit} tokens)", flush=True)
for length in (1024, 4096, 16384, 65536):
    if length > limit:
        print(f"{length:>7}  over the model's max_position_embeddings: not run", flush=True)
        continue
    ids = torch.randint(2, 258, (1, length), device=device)
    with torch.inference_mode():
        model(ids)  # warm-up: kernels chosen, allocator grown
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            model(ids)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    best = min(times)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
    rows.append({"tokens": length, "seconds_best_of_3": best, "tokens_per_s": length / best, "peak_mib": peak})
    print(f"{length:>7}{best * 1e3:>10.1f}{length / best:>12.0f}{peak:>10.0f}", flush=True)
json.dump({"device": str(device), "dtype": str(dtype), "rows": rows}, open(out, "w"), indent=2)
EOF

# bench/forward.py compares against the anchors (transformers, reformer-pytorch, full attention); it is
# run here when it can target the device the check runs on.
if [[ -f "$REPO/bench/forward.py" ]] && "$PY" "$REPO/bench/forward.py" --help | grep -q -- "--device"; then
  step "bench/forward.py on $DEVICE (at most ${FORWARD_S}s)"
  (cd "$REPO" && timeout "$FORWARD_S" "$PY" bench/forward.py --device "$DEVICE" --out "$OUT/forward.json") \
    || { echo "gpu_check: bench/forward.py failed or ran out of time (exit $?)"; FAILED_STEPS+=(forward.py); }
else
  echo "bench/forward.py is missing or has no --device option: the anchors' forward comparison is not run here"
fi

step "done in $(( $(date +%s) - START ))s; files in $OUT"
ls -1 "$OUT"
if (( ${#FAILED_STEPS[@]} )); then
  echo "gpu_check: FAILED: ${FAILED_STEPS[*]}"
  exit 1
fi
echo "gpu_check: all steps passed"
