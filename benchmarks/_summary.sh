# Sourced by run_te_tests.sh and run_cuda_tests.sh: the summary of their pytest processes' logs.
#   source benchmarks/_summary.sh; summarize_logs 6 gpu-out/cuda_tests_*.log; exit $?
# Each log ends with the "rc=N" line its process wrote.

# summarize_logs LINES LOG...: print each log's name and its last LINES summary lines (failures,
# errors, pytest's counts, rc=); return 1 unless every log says rc=0.
summarize_logs() {
    local lines=$1 log status=0
    shift
    for log in "$@"; do
        echo "== $log"
        grep -E "^(FAILED|ERROR)|passed|failed|skipped|rc=" "$log" | tail -n "$lines"
        grep -q "^rc=0$" "$log" || status=1
    done
    return $status
}
