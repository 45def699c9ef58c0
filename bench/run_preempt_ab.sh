#!/usr/bin/env bash
# A/B of flow preemption (first chunks run between the solver steps of a running batch) on one
# GPU: two whole-stack bf16 sweeps, --preempt true then false, batching on, same streams.
#
#   bash bench/run_preempt_ab.sh     # from the repo root; about 4 minutes on an H200
#
# Output in ${OUT:-out}/preempt (results-{on,off}.md, raw.tar.gz with the run JSONs and logs).
# Setup as in bench/run_gpu.sh (carried wheels in .whl/ are installed when gRPC is missing).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
DEST=${OUT:-out}/preempt
RAW=${BENCH_RAW:-/tmp/token2wav-preempt}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ! $PY -c 'import grpc, grpc_health.v1.health, prometheus_client' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
rm -rf "$RAW" && mkdir -p "$RAW" "$DEST"
START=$SECONDS
for preempt in ${ORDER:-true false}; do  # ORDER="false true": the other way round
  label=$([ "$preempt" = true ] && echo on || echo off)
  echo "== preempt $preempt ($((SECONDS - START)) s)"
  $PY -m bench sweep --device "${DEVICE:-cuda}" --preset "${PRESET:-cosyvoice3-0.5b}" \
    --dtype bfloat16 --warmup-streams 4 --startup-timeout 240 --batching on \
    --concurrency 1,8,16,32,64 --utterances-per-stream 4 --max-utterances-per-level 128 \
    --paced-concurrency 32 --paced-rate 25 \
    --flow-arg="--preempt=$preempt" --time-budget "${SWEEP_SECONDS:-200}" \
    --out-dir "$RAW/$label" >"$RAW/$label.stdout"
  echo "exit $? after $((SECONDS - START)) s"
  cp "$RAW/$label/results.md" "$DEST/results-$label.md" 2>/dev/null
  grep -rh "urgent batches" "$RAW/$label" 2>/dev/null | tail -1
done
tar -czf "$DEST/raw.tar.gz" -C "$RAW" . 2>/dev/null
cat "$DEST"/results-*.md
echo "done in $((SECONDS - START)) s"
