# The call that gave this folder's outputs (H100, 2026-12-08 00:36 UTC), run from a checkout of branch triton-conv at
# its first two commits with conv2.py in .baseline/, main's tree (git archive main flow_service gateway vocoder_service token2wav
# bench tests pyproject.toml) in .baseline/trees/main and the cp312 wheels of ../paged-attention-h100-2026-12-07b/go1.sh in .whl/.
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
el() { echo "$1 at $(( $(date +%s) - T0 )) s" >> $OUT/gpu.txt; }
nvidia-smi -L | tee $OUT/gpu.txt; python3 -c "import torch,triton;print(torch.__version__,triton.__version__, torch.backends.cudnn.version())" | tee -a $OUT/gpu.txt
timeout 50 python3 .baseline/conv2.py > $OUT/conv2.txt 2>&1; el conv2
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_causal_conv.py tests/test_kernels.py "tests/test_prefix_cache.py::test_gpu_runner_graphs_over_the_cache" > $OUT/pytest-conv.txt 2>&1; el pytest
P="-m bench profile-prefix --device cuda --dtype bfloat16 --schedule blocks --batch 1,2,8,16 --modes graphs+cache --repeats 3"
timeout 75 python3 $P > $OUT/prof-conv.txt 2>&1; el prof-conv
(cd .baseline/trees/main && PYTHONPATH=.:/tmp/site timeout 75 python3 $P) > $OUT/prof-main.txt 2>&1; el prof-main
left=$(( 330 - ($(date +%s) - T0) ))
[ $left -gt 50 ] && (cd .baseline/trees/main && PYTHONPATH=.:/tmp/site timeout $left python3 -m pytest -q -p no:cacheprovider "tests/test_prefix_cache.py::test_gpu_runner_graphs_over_the_cache") > $OUT/runner-main.txt 2>&1; el runner-main
cat $OUT/gpu.txt $OUT/conv2.txt; tail -8 $OUT/pytest-conv.txt; cat $OUT/prof-conv.txt $OUT/prof-main.txt; tail -3 $OUT/runner-main.txt
