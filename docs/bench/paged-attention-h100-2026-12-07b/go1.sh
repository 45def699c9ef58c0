# The call that gave this folder's outputs, run from a checkout of branch paged-attention with
# micro.py and trace.py of ../paged-attention-2026-12-07 copied to .baseline/, main's tree
# (git archive main flow_service gateway vocoder_service token2wav bench) in
# .baseline/trees/main, and the cp312 wheels of grpcio 1.85.1 (+ health, reflection),
# protobuf 7.35.1, soxr, av, websockets and pytest-asyncio in .whl/.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi -L | tee $OUT/gpu.txt; python3 -c "import torch,triton;print(torch.__version__,triton.__version__)" | tee -a $OUT/gpu.txt
BS=1,2,8,32 timeout 120 python3 .baseline/micro.py > $OUT/micro.txt 2>&1
timeout 130 python3 -m pytest -q -p no:cacheprovider -x tests/test_paged_attention.py "tests/test_prefix_cache.py::test_gpu_runner_graphs_over_the_cache" > $OUT/pytest.txt 2>&1
P="-m bench profile-prefix --device cuda --dtype bfloat16 --schedule blocks --batch 1,2,8,16 --modes graphs+cache --repeats 3"
timeout 110 python3 $P > $OUT/prof-branch.txt 2>&1
(cd .baseline/trees/main && PYTHONPATH=.:/tmp/site timeout 110 python3 $P) > $OUT/prof-main.txt 2>&1
BS=2 OUT=$OUT timeout 90 python3 .baseline/trace.py > $OUT/trace.txt 2>&1
# the run tool returns at most 8 files: tar the trace (trace_B2.json.gz) next time
