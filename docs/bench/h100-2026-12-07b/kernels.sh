#!/bin/bash
# the fused rotary on the GPU: its exactness tests, then the kernel bench (fused vs fused+rotary, graphed)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py -k "rotary or match_the_plain or bf16_kernels" > $OUT/gpu_tests.log 2>&1; echo "rc $?" >> $OUT/gpu_tests.log
tail -5 $OUT/gpu_tests.log
timeout ${BENCH_S:-200} python3 -m bench kernels --device cuda --graphs --variants fused,fused+rotary --dtype bfloat16 --rows 64,8,1 --frames 206 --kinds streaming --repeats 5 --budget-s $(( ${BENCH_S:-200} - 20 )) --out $OUT > $OUT/kernels.log 2>&1; echo "rc $?" >> $OUT/kernels.log
grep -v "^INFO\|compiled" $OUT/kernels.log | tail -20
