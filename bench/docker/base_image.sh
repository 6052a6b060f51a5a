#!/usr/bin/env bash
# Makes a Python base image from Debian's own packages, for hosts that cannot pull from Docker Hub:
# debootstrap a minimal Debian, add python3 and its venv module, and `docker import` the tree.
#
#   bench/docker/base_image.sh [TAG]          (default reformer-base:bookworm; needs root and debootstrap)
#
# The image holds Debian's public CA roots (the ca-certificates package) and nothing of this host's: a
# corporate or proxy CA reaches a build only as a BuildKit secret (docs/DEPLOY.md), so the check proves
# that path. Pass the tag as PYTHON_IMAGE: `docker build --build-arg PYTHON_IMAGE=reformer-base:bookworm .`
set -euo pipefail

TAG=${1:-reformer-base:bookworm}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
DOCKER=${DOCKER:-docker}
ROOT=$(mktemp -d /tmp/reformer-base.XXXXXX)
trap 'rm -rf "$ROOT"' EXIT

# python3-venv: the image's install step makes a venv; ca-certificates: pip's and apt's public roots.
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$ROOT" "$MIRROR"
chroot "$ROOT" apt-get clean
rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/*.bin "$ROOT"/var/log/* "$ROOT"/tmp/*
# Same layout as the python images for the one thing the Dockerfile calls: `python3` on PATH.
tar -C "$ROOT" --numeric-owner -c . | "$DOCKER" import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  --message "debootstrap $SUITE minbase + python3, python3-venv, ca-certificates" \
  - "$TAG"
"$DOCKER" run --rm --network host "$TAG" python3 -c 'import sys, venv; print("base:", sys.version.split()[0])'
