# Sourced by bench/run_gpu.sh and bench/run_capacity_gpu.sh (needs $PY): puts the checkout on
# PYTHONPATH, checks the Python packages the stack needs and, when one is missing, installs the
# wheels carried in .whl/ into /tmp/site (the device machine reaches no registry); then says
# which GPU and torch it runs on.
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
# the stubs' import also checks that grpcio and protobuf are new enough for them
deps='import grpc, grpc_health.v1.health, grpc_reflection.v1alpha.reflection, prometheus_client, torch
import token2wav.v1.gateway_pb2_grpc, token2wav.v1.flow_pb2_grpc, token2wav.v1.vocoder_pb2_grpc'
if ! $PY -c "$deps" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    echo "installing carried wheels from .whl/ into /tmp/site"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PYTHONPATH
  fi
  $PY -c "$deps" || { echo "missing Python packages (see the header of $0)"; exit 1; }
fi
$PY -c 'import matplotlib' 2>/dev/null || echo "matplotlib missing: no plots"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
