#!/usr/bin/env bash
# Runs a benchmark (or training) command only once the machine is quiet, and reports the load around it,
# so a figure is never taken while other work shares the cores (bench/README.md, "Read this first").
# Usage: bench/quiet_run.sh [--max-load 0.5] [--wait 900] -- COMMAND [ARGS...]
# Exit status: the command's; 3 when the 1-minute load stayed at or above --max-load for --wait seconds.
set -u
max=0.5 wait=900
while [ $# -gt 0 ]; do
  case "$1" in
    --max-load) max=$2; shift 2 ;;
    --wait) wait=$2; shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || { echo "usage: bench/quiet_run.sh [--max-load L] [--wait S] -- COMMAND [ARGS...]" >&2; exit 2; }
load() { cut -d' ' -f1 /proc/loadavg; }
start=$SECONDS
until awk -v l="$(load)" -v m="$max" 'BEGIN { exit !(l < m) }'; do
  if (( SECONDS - start >= wait )); then
    echo "quiet-run: load $(load) still >= $max after ${wait}s; these are running:" >&2
    ps -eo pid,pcpu,etime,args --sort=-pcpu | head -6 >&2
    exit 3
  fi
  sleep 5
done
before=$(load)
"$@"; rc=$?
echo "quiet-run: 1-minute load before ${before}, after $(load); exit ${rc}" >&2
exit $rc
