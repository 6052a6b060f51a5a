#!/usr/bin/env bash
# Installs what the test suite needs beyond the Python venv: Debian's `prometheus` package, for the
# `prometheus` and `promtool` binaries (tests/service/test_prometheus.py, tests/docker/test_prometheus_rules.py).
# Both `make test` and .ci/run call it. Does nothing when both binaries are on PATH. Installs as root, or
# through sudo when sudo works without a password; otherwise it stops at once (a prompt would hang CI, and
# a suite run without the binaries ends in six failures that only name them) and prints the command to run.
set -euo pipefail

if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
  exit 0
fi

install="apt-get update -q && apt-get install -y -q --no-install-recommends prometheus"
if [[ $(id -u) == 0 ]]; then
  run=(env DEBIAN_FRONTEND=noninteractive)
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  run=(sudo -n env DEBIAN_FRONTEND=noninteractive)
else
  echo "test-deps: prometheus and promtool are missing, and installing them needs root (no passwordless sudo here)." >&2
  echo "Run this once, then run the tests again:" >&2
  echo "  sudo sh -c '$install'" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null; then
  echo "test-deps: prometheus and promtool are missing and there is no apt-get here; install Prometheus" \
       "(its server and promtool) with this system's package manager and put both on PATH." >&2
  exit 1
fi
echo "test-deps: installing Debian's prometheus package (prometheus, promtool)" >&2
"${run[@]}" apt-get update -q
"${run[@]}" apt-get install -y -q --no-install-recommends prometheus
for tool in prometheus promtool; do
  command -v "$tool" >/dev/null || { echo "test-deps: $tool still missing after installing prometheus" >&2; exit 1; }
done
