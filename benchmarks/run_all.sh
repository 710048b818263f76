#!/usr/bin/env bash
# Run the benchmark suite in sequence from the repository root: gpt_a, small, cpu_overhead,
# fp8_mlp, v1_vs_v2, graphs, numa_copy (first_step.py is left out: it is slow and wants a fresh process;
# distributed.py wants two GPUs under torchrun).
# A failing benchmark does not stop the others; the ones that failed are listed at the end and the
# exit status is 1 if any failed. Extra arguments go to every script (e.g. --cpu-smoke).
#
#   bash benchmarks/run_all.sh              # on the GPU machine
#   bash benchmarks/run_all.sh --cpu-smoke  # tiny CPU check of the scripts
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 2
PY="${PYTHON:-python}"

failed=()
for bench in gpt_a small cpu_overhead fp8_mlp v1_vs_v2 graphs numa_copy; do
    echo
    echo "=================== benchmarks/${bench}.py $* ==================="
    start=$(date +%s)
    "$PY" "benchmarks/${bench}.py" "$@"
    rc=$?
    echo "=== ${bench}: exit ${rc} after $(( $(date +%s) - start )) s"
    if [ "$rc" -ne 0 ]; then
        failed+=("${bench} (exit ${rc})")
    fi
done

echo
if [ "${#failed[@]}" -gt 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
echo "all benchmarks completed"
