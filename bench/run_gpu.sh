#!/usr/bin/env bash
# The full benchmark on one GPU machine (an H200): services and load generator on the same box,
# full-size preset (random weights), bf16 then fp32, batching on and off alternating.
#
#   bash bench/run_gpu.sh                   # from the repo root; about 8-9 minutes at most
#   BENCH_SECONDS=300 bash bench/run_gpu.sh # a shorter budget: fewer runs, the rest skipped
#   GATEWAYS=4 CLIENT_PROCS=4 bash bench/run_gpu.sh  # 4 gateways per stack, load from 4 processes
#
# GATEWAYS=N: gateway processes per stack in front of the same flow and vocoder (a deployment
# runs several behind a load balancer; streams go round robin); CLIENT_PROCS=K: load-generator
# processes (a client population is not one Python event loop). Both default to 1.
#
# Needs python3 with torch (CUDA), numpy, grpcio, grpcio-health-checking, grpcio-reflection,
# protobuf, prometheus-client; matplotlib for the plots. Missing gRPC packages are installed
# from carried wheels in .whl/ when that folder exists (see the device README).
#
# Output in ${OUT:-out}/bench (at most 8 files, so it fits what the device tool brings back):
#   results.md      the merged tables (bf16 + fp32): paste into docs/BENCHMARKS.md
#   bench.json      every run with every stream, plus the environment
#   *.png           xRT and p95 first-chunk latency against concurrency, latency CDFs
#   raw.tar.gz      per-run JSONs, per-sweep results, the services' logs
# The working tree of the sweeps is $BENCH_RAW (default /tmp/token2wav-bench when $OUT is set).
#
# Budget: each sweep has a time budget; a run whose estimate (from the xRT measured so far in
# the same mode) would overrun it is skipped and listed under "Skipped" in results.md, and a
# run that overruns anyway is cut off (its unfinished streams count as CLIENT_CANCELLED).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

PY=${PYTHON:-python3}
PRESET=${PRESET:-cosyvoice3-0.5b}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu PRESET=small BENCH_SECONDS=120: a dry run of the script
TOTAL=${BENCH_SECONDS:-510}  # whole script, s; the device tool stops a command at 600
DEST=${OUT:-out}/bench
if [ -n "${OUT:-}" ]; then RAW=${BENCH_RAW:-/tmp/token2wav-bench}; else RAW=${BENCH_RAW:-$DEST/raw}; fi
START=$SECONDS
left() { echo $((TOTAL - (SECONDS - START))); }

. bench/gpu_env.sh
$PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'

rm -rf "$RAW" && mkdir -p "$RAW" "$DEST"
# Progress goes to stderr (this log); each sweep's own table goes to $RAW/<dtype>.stdout.
common=(--device "$DEVICE" --preset "$PRESET" --warmup-streams 4 --startup-timeout 240
  --gateways "${GATEWAYS:-1}" --client-procs "${CLIENT_PROCS:-1}")

# bf16 first: the headline targets (xRT at 64 streams, first chunk alone and at 16 streams,
# underruns at 32 paced streams, on/off at 64). Batching off only at 1, 16 and 64 streams.
# Last, if the budget allows, Poisson arrivals at 2 and 6 streams/s (20 and 60 audio s/s).
bf16_budget=$(( $(left) * 55 / 100 - 40 ))
echo "== bf16 sweep (budget ${bf16_budget} s for runs, $(left) s left in all)"
$PY -m bench sweep "${common[@]}" --dtype bfloat16 \
  --concurrency 1,2,4,8,16,32,64 --utterances-per-stream 2 --max-utterances-per-level 64 \
  --off-concurrency 1,16,64 --paced-concurrency 32 --paced-rate 25 \
  --rates 2,6 --duration 10 --off-rates '' \
  --time-budget "$bf16_budget" --out-dir "$RAW/bf16" >"$RAW/bf16.stdout"
echo "bf16 sweep exit $? after $((SECONDS - START)) s"

# fp32: fewer levels, one utterance per stream above 16.
fp32_budget=$(( $(left) - 70 ))
if [ "$fp32_budget" -gt 30 ]; then
  echo "== fp32 sweep (budget ${fp32_budget} s for runs, $(left) s left in all)"
  $PY -m bench sweep "${common[@]}" --dtype float32 \
    --concurrency 1,4,16,64 --utterances-per-stream 2 --max-utterances-per-level 32 \
    --off-concurrency 1,16,64 \
    --time-budget "$fp32_budget" --out-dir "$RAW/fp32" >"$RAW/fp32.stdout"
  echo "fp32 sweep exit $? after $((SECONDS - START)) s"
else
  echo "== fp32 sweep skipped: $(left) s left"
fi

$PY -m bench report "$RAW"/bf16 "$RAW"/fp32 --out-dir "$RAW/all" >/dev/null
cp "$RAW/all/results.md" "$RAW/all/bench.json" "$DEST/" 2>/dev/null
for png in xrt_vs_concurrency first_chunk_p95_vs_concurrency first_chunk_cdf_bfloat16 \
  first_chunk_cdf_float32; do
  cp "$RAW/all/$png.png" "$DEST/" 2>/dev/null
done
tar -czf "$DEST/raw.tar.gz" -C "$RAW" --exclude='all/bench.json' . 2>/dev/null
cat "$DEST/results.md"
echo "done in $((SECONDS - START)) s; output in $DEST"
