# One image, three services: `python -m gateway | flow_service | vocoder_service` (the compose
# file and the Kubernetes manifests pick one with `command:`). One image because the three share
# every dependency and the generated token2wav.v1 stubs: one build, one cache, one pull per
# node, and the wire contract can never differ between the services of one release. The
# gateway does carry torch it barely needs; that costs disk, not correctness.
#
# CPU (default; what `docker compose build` makes):
#   docker build -t token2wav:cpu .
# CUDA (the torch wheel brings its own CUDA libraries; the nvidia/cuda *base* image only adds
# the environment the NVIDIA container toolkit reads, so a -runtime image would duplicate GBs):
#   docker build -t token2wav:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# Offline or mirrored torch: put a wheel in deploy/wheels/ and set TORCH_SPEC / TORCH_INDEX_URL
# (deploy/smoke/compose-smoke.sh does this with a locally built base image).
#
# No `# syntax=` line and no RUN --mount on purpose: both need BuildKit (the first even pulls
# its frontend from a registry), and this file must also build with the classic builder.

ARG BASE_IMAGE=python:3.12-slim

# ---- python-base: the base image plus python3 and venv (nvidia/cuda images have neither) ----
FROM ${BASE_IMAGE} AS python-base
RUN if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -c 'import sys; assert sys.version_info >= (3, 10), sys.version'

# ---- builder: a venv with torch, then the dependencies, then the project as a wheel ----
FROM python-base AS builder
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv

# Extra CAs (deploy/certs/*.crt, empty by default) for pip behind a TLS-intercepting proxy;
# /etc/pip.conf belongs to this stage only, so they never reach the runtime image.
COPY deploy/certs/ /tmp/certs/
RUN if ls /tmp/certs/*.crt >/dev/null 2>&1; then \
        cat /etc/ssl/certs/ca-certificates.crt /tmp/certs/*.crt > /tmp/ca-bundle.pem \
        && printf '[global]\ncert = /tmp/ca-bundle.pem\n' > /etc/pip.conf; \
    fi

# Layers from slowest- to fastest-changing. torch first: the biggest by far (and the only one
# whose index differs between CPU and CUDA); a code change never reinstalls it.
COPY deploy/wheels/ /tmp/wheels/
RUN pip install --find-links /tmp/wheels --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"

# The runtime dependencies, read from pyproject.toml alone, so that editing code (or README)
# reuses this layer; torch is already satisfied. With the `frontend` extra, so that the gateway's
# --frontend-dir (voices from audio) works in the image.
COPY pyproject.toml deploy/docker/pyproject_deps.py /tmp/
RUN (python3 -c 'import tomllib' 2>/dev/null || pip install tomli) \
    && python3 /tmp/pyproject_deps.py /tmp/pyproject.toml frontend > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt

# The project itself, built into a wheel that the runtime stage installs without deps. bench/
# and tests/ stay out: a serving image needs neither.
COPY pyproject.toml README.md /src/
COPY token2wav /src/token2wav
COPY flow_service /src/flow_service
COPY vocoder_service /src/vocoder_service
COPY gateway /src/gateway
RUN pip wheel --no-deps --wheel-dir /dist /src

# ---- runtime ----
FROM python-base AS runtime
ARG UID=10001
# A fixed numeric uid: Kubernetes' runAsNonRoot can only verify a numeric USER. /models is
# where weights (flow.pt, hift.pt) are mounted read-only; none there means random weights.
RUN groupadd --gid "$UID" t2w \
    && useradd --uid "$UID" --gid t2w --no-create-home --home-dir /tmp --no-log-init \
        --shell /usr/sbin/nologin t2w \
    && mkdir -p /models

# The venv (torch + deps) is one layer that only changes with pyproject's dependencies; the
# project is a separate small layer on top.
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /dist/ /tmp/dist/
RUN /opt/venv/bin/pip install --no-deps --no-index --no-cache-dir \
        --disable-pip-version-check /tmp/dist/*.whl \
    && rm -rf /tmp/dist

# HOME=/tmp: torch and friends write caches under $HOME; /tmp is the one writable place when
# the root file system is read-only (compose `read_only`, k8s readOnlyRootFilesystem).
# *_HOST=0.0.0.0: the services bind loopback by default, which a container cannot be reached on.
# *_REFLECTION=false: no gRPC reflection in the image (it is on for local runs from a checkout).
# NVIDIA_DRIVER_CAPABILITIES: which driver libraries the NVIDIA container toolkit mounts (its
# default, utility, lacks CUDA); which GPUs is left to compose/Kubernetes, never `all` here.
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    GATEWAY_HOST=0.0.0.0 \
    FLOW_HOST=0.0.0.0 \
    VOCODER_HOST=0.0.0.0 \
    GATEWAY_REFLECTION=false \
    FLOW_REFLECTION=false \
    VOCODER_REFLECTION=false \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

WORKDIR /tmp
USER ${UID}:${UID}
# gRPC: gateway 50051, flow 50052, vocoder 50053; Prometheus: 9101, 9102, 9103.
EXPOSE 50051 50052 50053 9101 9102 9103
CMD ["python", "-m", "gateway"]
