#!/usr/bin/env bash
# Everything that needs a CUDA GPU, in one go (one device call): the CUDA tests, the replay
# benchmark, the host-path benchmark, the vision-encoder demo, the shape-bucket memory benchmark
# and example. Logs go under $OUT (the device tool's folder) or ./gpu-out.
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=$PWD:/tmp/site; bash benchmarks/run_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# Transformer Engine links cuDNN's sub-libraries by name; where a system cuDNN differs from the one
# torch's wheel bundles, the loader would mix the two ("undefined symbol ... libcudnn_graph.so.9").
# Put torch's cuDNN first so TE and torch share it.
torch_cudnn=$(python -c "import os, nvidia.cudnn as c; print(os.path.join(list(c.__path__)[0], 'lib'))" 2>/dev/null) \
    && export LD_LIBRARY_PATH=$torch_cudnn${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
status=0
OUT=$out bash benchmarks/run_cuda_tests.sh 2>&1 | tee "$out/cuda_tests.log" | tail -30 || status=1  # in parallel
baseline=()  # BASELINE=DIR compares another copy of the package (DIR/dualgraph) in the same run
[ -n "${BASELINE:-}" ] && baseline=(--baseline "$BASELINE")
python benchmarks/bench_torch_replay.py --rounds 5 "${baseline[@]}" --json "$out/bench.json" \
    --plot "$out/bench.png" 2>&1 | tee "$out/bench.log" | tail -60 || status=1
python benchmarks/bench_host_overhead.py --device cuda "${baseline[@]}" --json "$out/host.json" \
    2>&1 | tee "$out/host.log" | tail -40 || status=1
python examples/vision_encoder.py --steps 20 2>&1 | tee "$out/demo.log" | tail -15 || status=1
python benchmarks/bench_buckets_memory.py --json "$out/buckets_memory.json" 2>&1 \
    | tee "$out/buckets_memory.log" | tail -8 || status=1
python examples/variable_resolution.py 2>&1 | tee "$out/variable_resolution.log" | tail -10 || status=1
python benchmarks/bench_pipeline_memory.py --json "$out/pipeline_memory.json" 2>&1 \
    | tee "$out/pipeline_memory.log" | tail -8 || status=1
python examples/pipeline_schedule.py 2>&1 | tee "$out/pipeline_schedule.log" | tail -12 || status=1
python examples/pipeline_schedule.py --param-grads in_graph --batch 2 2>&1 \
    | tee "$out/pipeline_schedule_b2.log" | tail -12 || status=1
exit $status
