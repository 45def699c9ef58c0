#!/bin/bash
# bash .baseline/run3.sh: the mixed workload (X12: rate 12, full final) on new (9a51cc3: warm-up to 2000 frames, DFT vocoder) then main (fc5932b), then the GPU tests of the vocoder on this checkout
set -u
T0=$(date +%s)
LIMIT=${LIMIT:-560} bash .baseline/run.sh X12-new X12-main
left=$(( ${LIMIT:-560} - ($(date +%s) - T0) ))
echo "== gpu tests with $left s left"
if [ $left -gt 30 ]; then
  PYTHONPATH=.:/tmp/site timeout $((left - 5)) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_vocoder_graphs.py tests/test_vocoder_model.py tests/test_fidelity_gpu.py > $OUT/gpu_tests.log 2>&1; echo "rc $?" >> $OUT/gpu_tests.log
  tail -5 $OUT/gpu_tests.log
fi
echo "== all done $(( $(date +%s) - T0 )) s"
