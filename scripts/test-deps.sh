#!/usr/bin/env bash
# Installs what the test suite needs beyond the Python venv, from Debian's packages: `prometheus`, for the
# `prometheus` and `promtool` binaries (tests/service/observability/test_prometheus.py, tests/docker/test_prometheus_rules.py),
# and `nginx` (tests/docker/test_prefix_routing.py runs it in front of two replicas). Both `make test` and
# .ci/run call it. Does nothing when every binary is on PATH. Installs as root, or through sudo when sudo
# works without a password; otherwise it stops at once (a prompt would hang CI, and a suite run without the
# binaries ends in failures that only name them) and prints the command to run.
set -euo pipefail

# binary -> the Debian package that ships it (nginx lives in /usr/sbin, which a user's PATH may lack)
declare -A package_of=([prometheus]=prometheus [promtool]=prometheus [nginx]=nginx)
PATH="$PATH:/usr/sbin"
missing=()
for tool in prometheus promtool nginx; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
if [[ ${#missing[@]} == 0 ]]; then
  exit 0
fi
# the packages of the missing binaries, each once, in a fixed order (bash only: the tests run this script on a
# PATH of fakes, without sort or tr)
declare -A wanted=()
for tool in "${missing[@]}"; do wanted[${package_of[$tool]}]=1; done
list=()
for package in nginx prometheus; do
  [[ -n ${wanted[$package]:-} ]] && list+=("$package")
done
packages="${list[*]}"

install="apt-get update -q && apt-get install -y -q --no-install-recommends $packages"
if [[ $(id -u) == 0 ]]; then
  run=(env DEBIAN_FRONTEND=noninteractive)
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  run=(sudo -n env DEBIAN_FRONTEND=noninteractive)
else
  echo "test-deps: ${missing[*]} missing, and installing them needs root (no passwordless sudo here)." >&2
  echo "Run this once, then run the tests again:" >&2
  echo "  sudo sh -c '$install'" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null; then
  echo "test-deps: ${missing[*]} missing and there is no apt-get here; install them (Prometheus' server and" \
       "promtool, nginx) with this system's package manager and put them on PATH." >&2
  exit 1
fi
echo "test-deps: installing Debian's $packages (for ${missing[*]})" >&2
"${run[@]}" apt-get update -q
# shellcheck disable=SC2086  # one word per package
"${run[@]}" apt-get install -y -q --no-install-recommends $packages
for tool in "${missing[@]}"; do
  command -v "$tool" >/dev/null || { echo "test-deps: $tool still missing after installing $packages" >&2; exit 1; }
done
