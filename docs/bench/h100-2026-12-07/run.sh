#!/bin/bash
# bash .baseline/run.sh ITEM...: runs the items in order while time is left (570 s in all), then tars the results into $OUT
# items: A-<tree> (closed loop of 64, command (A)), P-<tree> (mixed poisson, start buffer 0,200), P200-<tree> (same, 200 only), S-<tree>, Snc-<tree> (sweep 64, with / without prefix cache)
set -u
T0=$(date +%s); LIMIT=${LIMIT:-570}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; python3 -c 'import torch;print(torch.__version__)' >> $R/gpu.txt; nproc >> $R/gpu.txt
A="--device cuda --dtype bfloat16 --preset cosyvoice3-0.5b --paces 0 --start-rate 10 --max-rate 10 --refine 0 --closed-concurrency 64 --overload-duration 0 --gateways 4 --client-procs 4 --quiet"
P="--batching on --mix mixed --rates 2.75,6.9 --duration 15 --device cuda --dtype bfloat16 --gateways 2 --client-procs 2 --quiet"
S="--device cuda --dtype bfloat16 --preset cosyvoice3-0.5b --concurrency 64 --utterances-per-stream 1 --batching on --gateways 4 --client-procs 4 --warmup-streams 4 --quiet"
for item in "$@"; do
  kind=${item%%-*}; tree=${item#*-}
  case $kind in
    A) need=190; cmd="capacity $A";;
    P) need=240; cmd="poisson $P --start-buffer-ms 0,200";;
    P200) need=150; cmd="poisson $P --start-buffer-ms 200";;
    P0) need=140; cmd="poisson $P --start-buffer-ms 0";;
    S) need=140; cmd="sweep $S";;
    Snc) need=140; cmd="sweep $S --flow-arg=--prefix-cache-mb=0";;
  esac
  left=$(( LIMIT - ($(date +%s) - T0) ))
  if [ $left -lt $need ]; then echo "== skip $item: $left s left"; continue; fi
  echo "== $item at $(( $(date +%s) - T0 )) s"
  (cd .baseline/trees/$tree && PYTHONPATH=.:/tmp/site timeout $left python3 -m bench $cmd --out-dir $R/$item > $R/$item.log 2>&1; echo "rc $?" >> $R/$item.log)
  tail -4 $R/$item.log
done
echo "== done $(( $(date +%s) - T0 )) s"
cd /tmp && tar czf $OUT/res.tgz res && ls -la $OUT
