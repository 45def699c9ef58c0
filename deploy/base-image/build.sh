#!/usr/bin/env bash
# Build a local stand-in for the Dockerfile's public base image, for hosts that reach Debian's
# mirrors but no image registry (the compose smoke test's case): debootstrap a minimal Debian
# with python3 + venv, then `docker import` it. Real users never need this; they pull
# python:3.12-slim or nvidia/cuda.
#
#   deploy/base-image/build.sh [IMAGE_TAG]      (root; needs debootstrap and a docker daemon)
#
# Env: SUITE (default bookworm, Python 3.11), MIRROR (default http://deb.debian.org/debian),
# FORCE=1 rebuilds an existing tag.
set -euo pipefail

TAG="${1:-token2wav-base:bookworm}"
SUITE="${SUITE:-bookworm}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"

# Every prerequisite first: debootstrap takes about a minute, and its result needs a daemon.
command -v docker >/dev/null || {
    echo "no docker command: install Docker (Debian: apt-get install docker.io)" >&2
    exit 1
}
docker info >/dev/null 2>&1 || {
    echo "no Docker daemon answers (start it: systemctl start docker, or dockerd &)" >&2
    exit 1
}
if [[ "${FORCE:-0}" != 1 ]] && docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "base image $TAG already present (FORCE=1 rebuilds)"
    exit 0
fi
if [[ $(id -u) != 0 ]]; then
    echo "debootstrap needs root" >&2
    exit 1
fi
command -v debootstrap >/dev/null || { echo "apt-get install debootstrap" >&2; exit 1; }

root="$(mktemp -d /tmp/t2w-rootfs.XXXXXX)"
trap 'rm -rf "$root"' EXIT

echo "debootstrap $SUITE into $root"
# minbase + python3-venv (pulls the bundled pip wheel the Dockerfile's `python3 -m venv` needs)
# and ca-certificates (pip talks HTTPS).
nice debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$SUITE" "$root" "$MIRROR" >/tmp/t2w-debootstrap.log 2>&1 || {
    tail -20 /tmp/t2w-debootstrap.log >&2
    exit 1
}
# What a slim image drops: package lists, docs, caches.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/usr/share/doc/* \
    "$root"/usr/share/man/* "$root"/usr/share/locale/*

tar --numeric-owner -C "$root" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    - "$TAG" >/dev/null
docker run --rm "$TAG" python3 -c 'import sys, venv, ensurepip; print("base image", sys.version)'
echo "built $TAG"
