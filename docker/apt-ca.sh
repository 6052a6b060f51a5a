#!/bin/sh
# Runs an apt-get command trusting the BuildKit secret `ca` (a PEM bundle, mounted at /run/secrets/ca only
# while the RUN runs) for HTTPS mirrors, when one was given; otherwise runs it unchanged.
#   docker/apt-ca.sh apt-get update
set -eu
if [ -s /run/secrets/ca ]; then
  command=$1
  shift
  exec "$command" -o Acquire::https::CAInfo=/run/secrets/ca "$@"
fi
exec "$@"
