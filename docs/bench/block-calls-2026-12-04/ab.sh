#!/usr/bin/env bash
# The A/B driver of these runs: $1 = label, $2 = checkout to run, $3 = time budget (s), the rest
# extra `bench capacity` flags; needs $OUT (the device tool's output folder).
set -u; PY=python3
label=$1 tree=$2 budget=$3; shift 3
cd "$tree" && . bench/gpu_env.sh >/dev/null
python3 -m bench capacity --device cuda --preset cosyvoice3-0.5b --dtype bfloat16 \
  --utterance-tokens 250 --duration 10 --min-streams 40 --warmup-streams 4 --drain-timeout 20 \
  --startup-timeout 240 --quiet --gateways 2 --client-procs 2 --growth 1.4 --refine 1 \
  --overload-duration 0 --time-budget "$budget" --out-dir "/tmp/ab/$label" "$@" \
  > "$OUT/$label.stdout" 2>&1
echo "$label exit $?"
cp "/tmp/ab/$label/capacity.md" "$OUT/$label.md" 2>/dev/null
cat "$OUT/$label.md" 2>/dev/null | head -40
