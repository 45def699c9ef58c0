#!/usr/bin/env bash
# Real-time capacity on one GPU machine (an H200): `python -m bench capacity` (bench/capacity.py
# defines "on time" and "capacity") with the full-size preset (random weights), bf16 then fp32.
#
#   bash bench/run_capacity_gpu.sh                    # from the repo root; ~8 minutes, under 9
#   DEVICE=cpu PRESET=small BENCH_SECONDS=150 UTT_TOKENS=60 START_RATE=0.5 FP32_START_RATE=0.5 \
#     DURATION=2 MIN_STREAMS=2 CLOSED=2 OVERLOAD_S=2 bash bench/run_capacity_gpu.sh  # dry run
#
# bf16: closed loop at 64 streams (stack-stalled streams, first chunk p95), the capacity search
# with tokens all at once and at 50 tokens/s, then an overload run at 2x the all-at-once
# capacity through a gateway with admission control on. fp32, if time is left: the capacity
# search with tokens all at once only.
#
# GATEWAYS=N starts N gateway processes in front of the one flow and vocoder (a deployment runs
# several behind a load balancer; streams go round robin); CLIENT_PROCS=K drives the load from K
# processes (a client population is not one Python event loop). Both default to 1, the setup
# of every run before them. The overload run keeps one admission gateway (admission is per
# gateway process), e.g.
#   GATEWAYS=4 CLIENT_PROCS=4 SKIP_FP32=1 BENCH_SECONDS=540 bash bench/run_capacity_gpu.sh
#
# Needs python3 with torch (CUDA), numpy, grpcio, grpcio-health-checking, grpcio-reflection,
# protobuf, prometheus-client; matplotlib for the plots. Missing gRPC packages are installed
# from carried wheels in .whl/ when that folder exists (see the device README).
#
# Output in ${OUT:-out}/capacity (at most 8 files):
#   capacity.md            both dtypes' tables: paste into docs/BENCHMARKS.md
#   capacity_bf16.json     figures of every probe, criteria, environment (fp32 likewise)
#   capacity_bf16.png      on-time share and first-chunk p95 against arrival rate, capacity marked
#   raw.tar.gz             every run's JSON (all streams) and the services' logs
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

PY=${PYTHON:-python3}
PRESET=${PRESET:-cosyvoice3-0.5b}
DEVICE=${DEVICE:-cuda}
TOTAL=${BENCH_SECONDS:-470}  # whole script, s (a run may overrun its budget by ~30 s + stop)
UTT_TOKENS=${UTT_TOKENS:-250}  # 10 s utterances
START_RATE=${START_RATE:-5}  # streams/s (x 10 s = 50 audio s/s)
FP32_START_RATE=${FP32_START_RATE:-1.5}
DURATION=${DURATION:-10}  # Poisson window per probe, s (grows to expect MIN_STREAMS arrivals)
MIN_STREAMS=${MIN_STREAMS:-40}
CLOSED=${CLOSED:-64}
OVERLOAD_S=${OVERLOAD_S:-20}
GATEWAYS=${GATEWAYS:-1}
CLIENT_PROCS=${CLIENT_PROCS:-1}
# BF16_ARGS: extra flags for the bf16 search (e.g. --closed-concurrency 0 --vocoder-arg=...)
# the gateway's --start-buffer-ms: held first audio of streams whose input is open (paced runs).
# 240: capacity at 50 tokens/s 36 -> 67 audio s/s against 150, paced first chunk p95 246 ms
# (H200, docs/BENCHMARKS.md "Current figures"); tokens-at-once streams are not held.
START_BUFFER_MS=${START_BUFFER_MS:-240}
DEST=${OUT:-out}/capacity
if [ -n "${OUT:-}" ]; then RAW=${BENCH_RAW:-/tmp/token2wav-capacity}; else RAW=${BENCH_RAW:-$DEST/raw}; fi
START=$SECONDS
left() { echo $((TOTAL - (SECONDS - START))); }

. bench/gpu_env.sh
$PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'

rm -rf "$RAW" && mkdir -p "$RAW" "$DEST"
common=(--device "$DEVICE" --preset "$PRESET" --utterance-tokens "$UTT_TOKENS"
  --duration "$DURATION" --min-streams "$MIN_STREAMS" --warmup-streams 4
  --drain-timeout 20 --startup-timeout 240 --quiet
  --gateways "$GATEWAYS" --client-procs "$CLIENT_PROCS"
  --gateway-arg="--start-buffer-ms=$START_BUFFER_MS")

# bf16 gets ~72 % of the time (its budget includes starting the stack); fp32 the rest.
# SKIP_FP32=1: bf16 only, with all of the time.
bf16_budget=$(( $(left) * 72 / 100 ))
[ -n "${SKIP_FP32:-}" ] && bf16_budget=$(( $(left) - 15 ))
echo "== bf16 capacity (budget ${bf16_budget} s, $(left) s left in all)"
$PY -m bench capacity "${common[@]}" --dtype bfloat16 --paces 0,50 \
  --closed-concurrency "$CLOSED" --start-rate "$START_RATE" --growth 1.4 --refine 2 \
  --overload-factor 2 --overload-duration "$OVERLOAD_S" \
  --time-budget "$bf16_budget" --out-dir "$RAW/bf16" ${BF16_ARGS:-} >"$RAW/bf16.stdout"
echo "bf16 exit $? after $((SECONDS - START)) s"

fp32_budget=$(( $(left) - 15 ))
if [ -n "${SKIP_FP32:-}" ]; then
  echo "== fp32 skipped (SKIP_FP32)"
elif [ "$fp32_budget" -gt 60 ]; then
  echo "== fp32 capacity (budget ${fp32_budget} s)"
  $PY -m bench capacity "${common[@]}" --dtype float32 --paces 0 --closed-concurrency 0 \
    --start-rate "$FP32_START_RATE" --growth 1.5 --refine 1 --overload-duration 0 \
    --time-budget "$fp32_budget" --out-dir "$RAW/fp32" >"$RAW/fp32.stdout"
  echo "fp32 exit $? after $((SECONDS - START)) s"
else
  echo "== fp32 skipped: $(left) s left"
fi

: >"$DEST/capacity.md"
for d in bf16 fp32; do
  [ -f "$RAW/$d/capacity.md" ] || continue
  cat "$RAW/$d/capacity.md" >>"$DEST/capacity.md"
  echo >>"$DEST/capacity.md"
  cp "$RAW/$d/capacity.json" "$DEST/capacity_$d.json"
  cp "$RAW/$d/capacity.png" "$DEST/capacity_$d.png" 2>/dev/null
done
tar -czf "$DEST/raw.tar.gz" -C "$RAW" . 2>/dev/null
cat "$DEST/capacity.md"
echo "done in $((SECONDS - START)) s; output in $DEST"
