#!/usr/bin/env bash
# The CUDA tests in N pytest processes at once on one GPU (a device call has at most 10 minutes;
# run R, in one process, ran out of time inside the TE matrix). Files are spread over the
# processes by their number of CUDA tests (greedy, largest first); each process writes its own
# log under $OUT (the device tool's folder) or ./gpu-out, and the summary lines are printed.
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=$PWD:/tmp/site; PROCESSES=4 LIMIT=500 bash benchmarks/run_cuda_tests.sh
# The JAX and parity files run whole (not only their CUDA tests): on the GPU machine JAX runs
# there by default.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
processes=${PROCESSES:-4}
limit=${LIMIT:-500}  # seconds per process
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
torch_cudnn=$(python3 -c "import os, nvidia.cudnn as c; print(os.path.join(list(c.__path__)[0], 'lib'))" 2>/dev/null) \
    && export LD_LIBRARY_PATH=$torch_cudnn${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
python3 - "$processes" > "$out/groups.txt" <<'PY'
import collections, subprocess, sys
found = subprocess.run(
    [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
     "--collect-only", "tests"], capture_output=True, text=True, check=False,
).stdout
counts = collections.Counter(line.split("::")[0] for line in found.splitlines() if "::" in line)
whole = ["tests/test_jax_graphed.py", "tests/test_jax_leaves.py", "tests/test_parity.py"]
groups = [[0, [], []] for _ in range(int(sys.argv[1]))]
for path, count in counts.most_common():
    if path not in whole:
        group = min(groups, key=lambda g: g[0])
        group[0] += count
        group[1].append(path)
min(groups, key=lambda g: g[0])[2].extend(whole)
for _, cuda_files, whole_files in groups:
    print(" ".join(cuda_files) + "|" + " ".join(whole_files))
PY
i=0
while IFS='|' read -r cuda_files whole_files; do
    i=$((i + 1))
    (
        status=0
        if [ -n "$cuda_files" ]; then
            timeout "$limit" python3 -m pytest -q -m cuda -p no:cacheprovider -rfE $cuda_files || status=$?
        fi
        if [ -n "$whole_files" ]; then
            timeout "$limit" python3 -m pytest -q -p no:cacheprovider -rfE $whole_files || status=$?
        fi
        echo "rc=$status"
    ) > "$out/cuda_tests_$i.log" 2>&1 &
done < "$out/groups.txt"
wait
# shellcheck source=benchmarks/_summary.sh
source benchmarks/_summary.sh
summarize_logs 6 "$out"/cuda_tests_*.log
