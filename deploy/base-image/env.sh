#!/usr/bin/env bash
# The compose build settings for a host that reaches no image registry: prints KEY=VALUE lines
# for docker-compose.yml's build (`make base-image` writes them to .env, which Compose reads, so
# `docker compose up -d --build` and `make compose-up` work as written; the smoke test exports
# them). Copies what the build needs into the build context: the local torch wheel into
# deploy/wheels/ and the host's extra CA certificates into deploy/certs/ (both git-ignored,
# neither reaches the final image).
#
#   deploy/base-image/env.sh [BASE_IMAGE]      (default token2wav-base:bookworm; docker needed)
#
# Env: TORCH_WHEEL (a torch wheel file; unset: the one in /opt/wheels that fits the base
# image's Python; empty: none, torch then comes from the index), INDEX_URL (package index for
# the build; default: pypi.org next to a local wheel, which also serves torch's dependencies,
# else the Dockerfile's CPU PyTorch index).
set -euo pipefail
cd "$(dirname "$0")/../.."

BASE_IMAGE="${1:-token2wav-base:bookworm}"
note() { printf '%s\n' "$*" >&2; }

docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 ||
    { note "base image $BASE_IMAGE missing (deploy/base-image/build.sh builds it)"; exit 1; }
pytag="$(docker run --rm "$BASE_IMAGE" python3 -c 'import sys; print("cp%d%d" % sys.version_info[:2])')"
echo "T2W_BASE_IMAGE=$BASE_IMAGE"

index="${INDEX_URL:-}"
wheel="${TORCH_WHEEL-$(compgen -G "/opt/wheels/torch-*-$pytag-*linux*x86_64.whl" | sort | tail -1 || true)}"
if [[ -n "$wheel" ]]; then
    cp -u "$wheel" deploy/wheels/
    # torch-2.13.0+cpu-cp311-... -> torch==2.13.0+cpu: pin exactly the local file.
    echo "T2W_TORCH_SPEC=torch==$(basename "$wheel" | cut -d- -f2)"
    index="${index:-https://pypi.org/simple}"
    note "torch from the local wheel $(basename "$wheel") (copied to deploy/wheels/)"
fi
if [[ -n "$index" ]]; then
    echo "T2W_TORCH_INDEX_URL=$index"
fi
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp -u /usr/local/share/ca-certificates/*.crt deploy/certs/
    note "extra CAs for the build stage: $(cd deploy/certs && echo *.crt)"
fi
