#!/bin/bash
# bash .baseline/run.sh ITEM...: runs the items in order while time is left (LIMIT s, 570 by default), each one tarred into $OUT as it ends
# trees: mkdir -p .baseline/trees/X && git archive X flow_service gateway vocoder_service token2wav bench | tar -x -C .baseline/trees/X; carry .baseline and .whl (cp312 manylinux wheels of grpcio, grpcio-health-checking and grpcio-reflection 1.85.1, protobuf 7.35.1, soxr, av, websockets, pytest-asyncio)
# items: R69-/R9-/L9-<tree> (the mixed workload at 6.9 / 9 / both streams/s, with the flow's --log-batches), L-<tree> (P0 with the flow's --log-batches), A-<tree> (closed loop of 64, command (A)), AL-<tree> (the same with the flow's --log-batches), P-<tree> (mixed poisson, start buffer 0,200), P200-<tree> (same, 200 only), S-<tree>, Snc-<tree> (sweep 64, with / without prefix cache)
set -u
T0=$(date +%s); LIMIT=${LIMIT:-570}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt; python3 -c 'import torch;print(torch.__version__)' >> $R/gpu.txt; nproc >> $R/gpu.txt; cp $R/gpu.txt $OUT/
A="--device cuda --dtype bfloat16 --preset cosyvoice3-0.5b --paces 0 --start-rate 10 --max-rate 10 --refine 0 --closed-concurrency 64 --overload-duration 0 --gateways 4 --client-procs 4 --quiet"
P="--batching on --mix mixed --rates 2.75,6.9 --duration 15 --device cuda --dtype bfloat16 --gateways 2 --client-procs 2 --quiet"
S="--device cuda --dtype bfloat16 --preset cosyvoice3-0.5b --concurrency 64 --utterances-per-stream 1 --batching on --gateways 4 --client-procs 4 --warmup-streams 4 --quiet"
# a later plan overrides the command: line 1 of .baseline/items for LIMIT 560, line 2 otherwise
[ -f .baseline/items ] && set -- $(sed -n "$([ "$LIMIT" = 560 ] && echo 1 || echo 2)p" .baseline/items)
for item in "$@"; do
  kind=${item%%-*}; tree=${item#*-}
  case $kind in
    X) need=150; cmd="poisson ${P/2.75,6.9/9,12} --start-buffer-ms 0 --flow-arg=--log-batches=true";;
    X12) need=95; cmd="poisson ${P/2.75,6.9/12} --start-buffer-ms 0 --flow-arg=--log-batches=true";;
    XC) need=150; cmd="poisson ${P/2.75,6.9/9,12} --start-buffer-ms 0 --flow-arg=--log-batches=true --gateway-arg=--final-attention=chunked";;
    AC) need=110; cmd="capacity $A --gateway-arg=--final-attention=chunked";;
    B) need=200; cmd="capacity --device cuda --dtype bfloat16 --preset cosyvoice3-0.5b --paces 50 --floor-streams 0 --start-rate 6 --growth 1.25 --refine 1 --closed-concurrency 0 --overload-duration 0 --gateway-arg=--start-buffer-ms=240 --gateways 4 --client-procs 4 --quiet";;
    BK) need=200; cmd="capacity --device cuda --dtype bfloat16 --preset cosyvoice3-0.5b --paces 25 --floor-streams 0 --start-rate 3 --growth 1.25 --refine 1 --closed-concurrency 0 --overload-duration 0 --schedule blocks --gateways 4 --client-procs 4 --quiet";;
    A) need=110; cmd="capacity $A";;
    AL) need=190; cmd="capacity $A --flow-arg=--log-batches=true";;
    P) need=240; cmd="poisson $P --start-buffer-ms 0,200";;
    P200) need=150; cmd="poisson $P --start-buffer-ms 200";;
    P0) need=140; cmd="poisson $P --start-buffer-ms 0";;
    L) need=150; cmd="poisson $P --start-buffer-ms 0 --flow-arg=--log-batches=true";;
    R69) need=110; cmd="poisson ${P/2.75,6.9/6.9} --start-buffer-ms 0 --flow-arg=--log-batches=true";;
    R9) need=120; cmd="poisson ${P/2.75,6.9/9} --start-buffer-ms 0 --flow-arg=--log-batches=true";;
    L9) need=170; cmd="poisson ${P/2.75,6.9/6.9,9} --start-buffer-ms 0 --flow-arg=--log-batches=true";;
    S) need=140; cmd="sweep $S --flow-arg=--log-batches=true";;
    Snc) need=140; cmd="sweep $S --flow-arg=--prefix-cache-mb=0 --flow-arg=--log-batches=true";;
  esac
  left=$(( LIMIT - ($(date +%s) - T0) ))
  if [ $left -lt $need ]; then echo "== skip $item: $left s left"; continue; fi
  echo "== $item at $(( $(date +%s) - T0 )) s"
  (cd .baseline/trees/$tree && PYTHONPATH=.:/tmp/site timeout $left python3 -m bench $cmd --out-dir $R/$item > $R/$item.log 2>&1; echo "rc $?" >> $R/$item.log)
  tail -4 $R/$item.log
  tar czf $OUT/$item.tgz -C $R $item $item.log  # each item comes back even if a later one is cut off
done
echo "== done $(( $(date +%s) - T0 )) s"
ls -la $OUT
