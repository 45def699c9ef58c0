#!/bin/bash
# the kernel bench alone: fused vs fused+rotary (on the q/k view), graphed and not
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout 150 python3 -m bench kernels --device cuda --graphs --variants fused,fused+rotary --dtype bfloat16 --rows 64,8,1 --frames 206 --kinds streaming --repeats 5 --compile-reserve-s 15 --budget-s 130 --out $OUT > $OUT/kernels.log 2>&1; echo "rc $?" >> $OUT/kernels.log
grep -v "^INFO\|compiled" $OUT/kernels.log | tail -20
