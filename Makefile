# The two commands a new user needs: `make run` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The dev/CI install pins torch: 2.13.0 is the CPU wheel CI has on disk; an unpinned torch would
# pull a multi-GB CUDA build. Real users install with `pip install .` and their own torch.
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: venv test lint fmt protos check-protos run clean test-gpu

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

# pytest exits 5 when it collected no test: that is a failure here, not a pass.
test: venv
	$(PY) -m ruff check .
	$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

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

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
