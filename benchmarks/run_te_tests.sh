#!/usr/bin/env bash
# The Transformer Engine matrix (tests/test_torch_transformer_engine.py) in N pytest processes on
# one GPU: test ids are spread round-robin; each process writes a log under $OUT or ./gpu-out,
# and the summary lines are printed. Needs TE installed (../shared/tools/device-prep --te).
#   PROCESSES=4 LIMIT=300 bash benchmarks/run_te_tests.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
processes=${PROCESSES:-4}
limit=${LIMIT:-300}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
torch_cudnn=$(python3 -c "import os, nvidia.cudnn as c; print(os.path.join(list(c.__path__)[0], 'lib'))" 2>/dev/null) \
    && export LD_LIBRARY_PATH=$torch_cudnn${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
python3 -m pytest -q -p no:cacheprovider --collect-only tests/test_torch_transformer_engine.py \
    | grep -E "^tests/[^ ]*::[^ ]*$" > "$out/te_ids.txt"  # ids with spaces (argument checks, CPU) run in CI
echo "TE test ids: $(wc -l < "$out/te_ids.txt")"
split -n "r/$processes" -d "$out/te_ids.txt" "$out/te_ids_part"
for part in "$out"/te_ids_part*; do
    (
        status=0
        # shellcheck disable=SC2046
        timeout "$limit" python3 -m pytest -q -p no:cacheprovider -rfE $(cat "$part") || status=$?
        echo "rc=$status"
    ) > "$part.log" 2>&1 &
done
wait
# shellcheck source=benchmarks/_summary.sh
source benchmarks/_summary.sh
summarize_logs 8 "$out"/te_ids_part*.log
