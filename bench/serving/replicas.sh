#!/usr/bin/env bash
# Multi-replica operation (issue 9): `reformer serve` replicas on loopback ports behind nginx, with the
# project's load test (`reformer loadtest`) sent through nginx.
#   1. steady runs with 1, 2 and 3 replicas: throughput as replicas are added;
#   2. a rolling restart with 3 replicas: mid-run, one replica gets SIGTERM (it stops admitting with
#      503 and drains), exits, and is started again, as a Kubernetes rolling update would do.
# nginx passes a request on to the next replica when one answers 503 or the connection fails
# (proxy_next_upstream error timeout http_503 non_idempotent), so no admitted request should be lost
# and clients should see no 5xx. Sent/succeeded/failed and throughput go to a JSON file and a table.
#
#   bench/serving/replicas.sh [--docs DIR] [--artifact DIR] [--duration S] [--concurrency N] [--lengths L]
#                     [--endpoint E] [--out FILE.json]
# Only loopback addresses are used. nginx comes from Debian's package (installed with apt-get if missing).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
DOCS="$REPO/corpus/data"  # written by `reformer data`
ARTIFACT=""
DURATION=30
CONCURRENCY=8
LENGTHS=4096
ENDPOINT=both
OUT="$REPO/bench/results/replicas.json"
NGINX_PORT=${REPLICAS_NGINX_PORT:-18100}
BASE_PORT=${REPLICAS_BASE_PORT:-18101}
REPLICAS_MAX=3
GRACE_S=20        # the replicas' drain period (REFORMER_GRACE_PERIOD_S)
READY_S=300       # load and warm-up of one replica
KILL_AFTER_S=8    # into the rolling-restart run, the moment the SIGTERM is sent
REFORMER=${REFORMER:-$REPO/.venv/bin/reformer}
PY=${PYTHON:-$REPO/.venv/bin/python}

while [[ $# -gt 0 ]]; do
  case "$1" in
    --docs) DOCS=$2; shift 2 ;;
    --artifact) ARTIFACT=$2; shift 2 ;;
    --duration) DURATION=$2; shift 2 ;;
    --concurrency) CONCURRENCY=$2; shift 2 ;;
    --lengths) LENGTHS=$2; shift 2 ;;
    --endpoint) ENDPOINT=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"; exit 0 ;;
    *) echo "replicas: unknown option $1" >&2; exit 2 ;;
  esac
done

WORK=$(mktemp -d /tmp/reformer-replicas.XXXXXX)
mkdir -p "$(dirname "$OUT")"
NGINX_PID=""

log() { printf '[replicas %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

replica_pid() { cat "$WORK/replica$1.pid"; }

# Each replica runs under a small watcher subshell that writes the replica's pid and, when it ends, its
# exit code to files: the background rolling_restart and stop_all are not the replicas' parent shell,
# so they signal by pid and poll rather than `wait`.
stop_all() {
  local pidfile pid deadline
  for pidfile in "$WORK"/replica*.pid; do
    if [[ -e "$pidfile" ]]; then kill -TERM "$(cat "$pidfile")" 2>/dev/null || true; fi
  done
  deadline=$(( $(date +%s) + GRACE_S + 15 ))
  for pidfile in "$WORK"/replica*.pid; do
    [[ -e "$pidfile" ]] || continue
    pid=$(cat "$pidfile")
    while kill -0 "$pid" 2>/dev/null && (( $(date +%s) < deadline )); do sleep 0.2; done
    kill -KILL "$pid" 2>/dev/null || true
    rm -f "$pidfile"
  done
  if [[ -n "$NGINX_PID" ]]; then
    kill -QUIT "$NGINX_PID" 2>/dev/null || true
    wait "$NGINX_PID" 2>/dev/null || true
  fi
  NGINX_PID=""
}
trap stop_all EXIT

ensure_nginx() {
  if ! command -v nginx >/dev/null; then
    log "installing nginx (Debian package)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light >/dev/null
  fi
  nginx -v 2>&1 | sed 's/^/  /'
}

start_replica() {  # index
  local port=$((BASE_PORT + $1)) args=(serve --host 127.0.0.1 --port "$((BASE_PORT + $1))")
  [[ -n "$ARTIFACT" ]] && args+=("$ARTIFACT")
  rm -f "$WORK/replica$1.pid" "$WORK/replica$1.exit"
  (
    OMP_NUM_THREADS=$THREADS REFORMER_GRACE_PERIOD_S=$GRACE_S REFORMER_LOG_JSON=true "$REFORMER" "${args[@]}" \
      >>"$WORK/replica$1.log" 2>&1 &
    echo $! >"$WORK/replica$1.pid"
    wait $! && code=0 || code=$?
    echo "$code" >"$WORK/replica$1.exit"
  ) &
  until [[ -s "$WORK/replica$1.pid" ]]; do sleep 0.05; done
  log "replica $1 on port $port (pid $(replica_pid "$1"))"
}

wait_ready() {  # index
  local port=$((BASE_PORT + $1)) start
  start=$(date +%s)
  until curl -sf "http://127.0.0.1:$port/ready" >/dev/null; do
    if ! kill -0 "$(replica_pid "$1")" 2>/dev/null; then
      echo "replica $1 exited before it was ready:" >&2; tail -20 "$WORK/replica$1.log" >&2; exit 1
    fi
    if (( $(date +%s) - start > READY_S )); then echo "replica $1 not ready after ${READY_S}s" >&2; exit 1; fi
    sleep 0.5
  done
  log "replica $1 ready after $(( $(date +%s) - start ))s"
}

start_nginx() {  # replica count
  local servers=""
  for ((index = 0; index < $1; index++)); do
    # max_fails=0: a replica that answered 503 while draining is retried by later requests as soon as
    # it is back, rather than being shunned for fail_timeout.
    servers+="    server 127.0.0.1:$((BASE_PORT + index)) max_fails=0;"$'\n'
  done
  mkdir -p "$WORK/nginx"
  chmod 1777 "$WORK/nginx"  # workers run as an unprivileged user when nginx starts as root
  cat >"$WORK/nginx.conf" <<EOF
worker_processes 1;
pid $WORK/nginx.pid;
error_log $WORK/nginx-error.log warn;
daemon off;
events { worker_connections 1024; }
http {
  # upstream_status lists every replica tried: "503, 200" is a draining replica's refusal, retried.
  log_format upstreams '\$request \$status upstreams=[\$upstream_addr] statuses=[\$upstream_status]';
  access_log $WORK/nginx-access.log upstreams;
  client_body_temp_path $WORK/nginx/body;
  proxy_temp_path $WORK/nginx/proxy;
  fastcgi_temp_path $WORK/nginx/fastcgi;
  uwsgi_temp_path $WORK/nginx/uwsgi;
  scgi_temp_path $WORK/nginx/scgi;
  client_max_body_size 8m;
  client_body_buffer_size 8m;   # keep request bodies in memory: they are resent on a retry
  upstream reformer {
$servers    keepalive 32;
  }
  server {
    listen 127.0.0.1:$NGINX_PORT;
    location / {
      proxy_pass http://reformer;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;          # Server-Sent Events from /generate_stream pass through as they come
      proxy_read_timeout 600s;
      # A draining replica answers 503 before doing any work, and a stopped one refuses the
      # connection: both are safe to send elsewhere, POSTs included.
      proxy_next_upstream error timeout http_503 non_idempotent;
      proxy_next_upstream_tries 3;
    }
  }
}
EOF
  nginx -t -c "$WORK/nginx.conf" 2>&1 | sed 's/^/  /'
  nginx -c "$WORK/nginx.conf" &
  NGINX_PID=$!
  until curl -s -o /dev/null "http://127.0.0.1:$NGINX_PORT/health"; do sleep 0.2; done
  until [[ -s "$WORK/nginx-access.log" ]]; do sleep 0.1; done  # the /health above, logged
  log "nginx on port $NGINX_PORT in front of $1 replica(s)"
}

run_loadtest() {  # name
  local logged
  logged=$(wc -l <"$WORK/nginx-access.log")
  "$REFORMER" loadtest --url "http://127.0.0.1:$NGINX_PORT" --docs "$DOCS" --lengths "$LENGTHS" \
    --concurrency "$CONCURRENCY" --duration "$DURATION" --endpoint "$ENDPOINT" \
    --out "$WORK/$1.json" >"$WORK/$1.loadtest.log" 2>&1 || log "loadtest $1 exited with $?"
  # This run's part of nginx's access log (nginx's workers could not reopen a moved log in $WORK).
  tail -n "+$((logged + 1))" "$WORK/nginx-access.log" >"$WORK/$1.access.log"
}

inflight_on() {  # index: requests the replica is handling, not counting the /metrics scrape that asks
  local value
  value=$(curl -sf "http://127.0.0.1:$((BASE_PORT + $1))/metrics" \
    | awk '$1 == "reformer_inflight_requests" {print int($2)}')
  echo $(( ${value:-1} - 1 ))
}

rolling_restart() {  # index: SIGTERM one replica mid-run, wait for its drain and exit, start it again
  sleep "$KILL_AFTER_S"
  local start code pid inflight=0 waited=0
  # Signal it while it is working, so the drain has admitted requests to finish (give up after 30 s).
  while (( waited < 300 )); do
    inflight=$(inflight_on "$1")
    (( inflight > 0 )) && break
    sleep 0.1; waited=$((waited + 1))
  done
  pid=$(replica_pid "$1")
  start=$(date +%s)
  log "SIGTERM to replica $1 (pid $pid) with $inflight request(s) in flight"
  kill -TERM "$pid"
  until [[ -s "$WORK/replica$1.exit" ]]; do sleep 0.1; done
  code=$(cat "$WORK/replica$1.exit")
  log "replica $1 exited with code $code after $(( $(date +%s) - start ))s"
  echo "$code $(( $(date +%s) - start )) $inflight" >"$WORK/restart-$1.txt"
  start_replica "$1"
  wait_ready "$1"
}

ensure_nginx
[[ -d "$DOCS" ]] || { echo "replicas: --docs $DOCS is not a directory" >&2; exit 2; }
log "work directory $WORK; $(nproc) CPU cores on this machine"
RUNS=()
for ((count = 1; count <= REPLICAS_MAX; count++)); do
  # The replicas share this machine's cores, as pods share a node's: each gets its share of threads.
  THREADS=$(( $(nproc) / count > 0 ? $(nproc) / count : 1 ))
  for ((index = 0; index < count; index++)); do start_replica "$index"; done
  for ((index = 0; index < count; index++)); do wait_ready "$index"; done
  start_nginx "$count"
  log "steady run: $count replica(s) of $THREADS thread(s), ${DURATION}s per level at concurrency $CONCURRENCY"
  run_loadtest "steady-$count"
  RUNS+=("steady-$count")
  if (( count == REPLICAS_MAX )); then
    log "rolling-restart run: $count replicas, replica 0 restarted mid-run"
    rolling_restart 0 &
    RESTARTER=$!
    run_loadtest "rolling-$count"
    wait "$RESTARTER"
    RUNS+=("rolling-$count")
  fi
  stop_all
done
trap - EXIT

ARTIFACT="$ARTIFACT" DOCS="$DOCS" DURATION="$DURATION" CONCURRENCY="$CONCURRENCY" LENGTHS="$LENGTHS" ENDPOINT="$ENDPOINT" \
  NPROC="$(nproc)" "$PY" - "$WORK" "$OUT" "${RUNS[@]}" <<'EOF'
import json, os, sys
from pathlib import Path
from rich.console import Console
from rich.table import Table

work, out, names = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
rows = []
for name in names:
    report = json.loads((work / f"{name}.json").read_text())
    results = report["results"]
    errors: dict[str, int] = {}
    for level in results:
        for key, count in level["errors"].items():
            errors[key] = errors.get(key, 0) + count
    scenario, replicas = name.rsplit("-", 1)
    row = {"scenario": scenario, "replicas": int(replicas),
           "sent": sum(level["requests"] for level in results),
           "succeeded": sum(level["ok"] for level in results),
           "failed": sum(sum(level["errors"].values()) for level in results),
           "errors": errors,
           # The load test runs its endpoints one after another: overall rate = successes / total time.
           "requests_per_s": round(sum(level["ok"] for level in results)
                                   / max(sum(level["duration_s"] for level in results), 1e-9), 3),
           "by_endpoint": {level["endpoint"]: {"requests": level["requests"], "ok": level["ok"],
                                               "requests_per_s": level["requests_per_s"],
                                               "p50_s": (level.get("latency_s") or {}).get("p50"),
                                               "p95_s": (level.get("latency_s") or {}).get("p95")}
                           for level in results}}
    # nginx's view: responses that needed more than one replica, and what the first one answered.
    access = (work / f"{name}.access.log").read_text().splitlines()
    retried = [line for line in access if ", " in line.rpartition("statuses=[")[2]]
    refusals: dict[str, int] = {}  # what the replicas that were passed over answered (502: closed connection)
    for line in retried:
        for status in line.rpartition("statuses=[")[2].rstrip("]").split(", ")[:-1]:
            refusals[status] = refusals.get(status, 0) + 1
    row["nginx"] = {"responses": len(access), "retried_on_another_replica": len(retried),
                    "passed_over_answers": refusals, "examples": retried[:3]}
    restart = work / "restart-0.txt"
    if scenario == "rolling" and restart.exists():
        code, seconds, inflight = restart.read_text().split()
        row["restarted_replica"] = {"exit_code": int(code), "drain_and_exit_s": int(seconds),
                                    "in_flight_at_sigterm": int(inflight)}
    rows.append(row)
settings = {key.lower(): os.environ[key] for key in ("DOCS", "DURATION", "CONCURRENCY", "LENGTHS", "ENDPOINT")}
settings["cpu_cores"] = int(os.environ["NPROC"])
settings["artifact"] = os.environ["ARTIFACT"] or "the default artifact shipped in the package"
out.write_text(json.dumps({"settings": settings, "runs": rows}, indent=2) + "\n")
table = Table(title="reformer-serve behind nginx")
endpoints = sorted({endpoint for row in rows for endpoint in row["by_endpoint"]})
columns = ["scenario", "replicas", "sent", "succeeded", "failed", "errors", "req/s overall",
           *(f"{endpoint} req/s" for endpoint in endpoints), "retried by nginx"]
for column in columns:
    table.add_column(column)
for row in rows:
    per_endpoint = [row["by_endpoint"].get(endpoint, {}).get("requests_per_s") for endpoint in endpoints]
    rates = [f"{rate:.2f}" if rate is not None else "-" for rate in per_endpoint]
    table.add_row(row["scenario"], str(row["replicas"]), str(row["sent"]), str(row["succeeded"]),
                  str(row["failed"]), json.dumps(row["errors"]) if row["errors"] else "-",
                  f"{row['requests_per_s']:.2f}", *rates,
                  str(row["nginx"]["retried_on_another_replica"]))
for row in rows:
    if "restarted_replica" in row:
        restarted = row["restarted_replica"]
        print(f"rolling restart: SIGTERM with {restarted['in_flight_at_sigterm']} request(s) in flight; "
              f"drained and exited with code {restarted['exit_code']} in {restarted['drain_and_exit_s']} s")
Console(width=200).print(table)
print(f"JSON: {out}; logs: {work}")
EOF
