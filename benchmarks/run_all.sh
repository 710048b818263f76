#!/usr/bin/env bash
# Run every figure benchmarks/README.md quotes, one script (one process) after another, from the
# repository root. The SUITE below is the README's tables, one line per question, in their order.
# A failing benchmark does not stop the others; the ones that failed are listed at the end and the
# exit status is 1 if any failed. Extra arguments go to every script (e.g. --cpu-smoke).
#
#   bash benchmarks/run_all.sh              # on one GPU (1-2 hours: the long-context searches take most)
#   bash benchmarks/run_all.sh --cpu-smoke  # tiny CPU check of every script (numbers meaningless)
#
# Left out, and why: many_small.py under --cpu-smoke (it has no CPU path); distributed.py and
# context_parallel.py where fewer than two GPUs are visible; ab_engine.py (it compares this tree
# with another one you name) and host_profile.py, profile_fp8_llama.py, extrapolate.py (they
# explain a figure, they give none of their own).
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 2
PY="${PYTHON:-python}"

SUITE=(
    "gpt_a"                                   # T1, T2, T3
    "many_small"                              # T4
    "host_cost --interleave"                  # T5a
    "host_cost --interleave --workload moe"   # T5c
    "host_parts"                              # T5b: what each engine call costs
    "fp8_mlp"                                 # T6
    "graphs"                                  # T7
    "pareto"                                  # T8, T9, T10, T11, T17
    "fp8_linear"                              # T12, T13
    "first_step"                              # T14
    "long_context"                            # T15, T16, T25
    "fp8_llama"                               # T18, T19
    "max_context"                             # T20, T21, T26, T27
    "varlen"                                  # T22
    "device_everywhere"                       # T23
    "device_everywhere --recovery"            # T24
    "shared_node"                             # issue 48 s3: two jobs on one node
    "numa_copy"                               # issue 15: the link per NUMA node
    "distributed"                             # issue 15: FSDP2, two GPUs
    "context_parallel --case T29"             # T29: two GPUs
    "context_parallel --case T30"             # T30
    "context_parallel --case T31"             # T31
    "context_parallel --case T32"             # T32
)

smoke=0
for arg in "$@"; do
    [ "$arg" = "--cpu-smoke" ] && smoke=1
done
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)

failed=()
skipped=()
for entry in "${SUITE[@]}"; do
    read -r -a words <<< "$entry"
    bench="${words[0]}"
    if [ "$smoke" = 1 ] && [ "$bench" = many_small ]; then
        skipped+=("many_small (no CPU path)")
        continue
    fi
    if [ "$smoke" = 0 ] && { [ "$bench" = distributed ] || [ "$bench" = context_parallel ]; } && [ "$gpus" -lt 2 ]; then
        skipped+=("$entry (${gpus} GPU visible, needs 2)")
        continue
    fi
    echo
    echo "=================== benchmarks/${bench}.py ${words[*]:1} $* ==================="
    start=$(date +%s)
    "$PY" "benchmarks/${bench}.py" "${words[@]:1}" "$@"
    rc=$?
    echo "=== ${entry}: exit ${rc} after $(( $(date +%s) - start )) s"
    if [ "$rc" -ne 0 ]; then
        failed+=("${entry} (exit ${rc})")
    fi
done

echo
if [ "${#skipped[@]}" -gt 0 ]; then
    echo "skipped: ${skipped[*]}"
fi
if [ "${#failed[@]}" -gt 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
echo "all benchmarks completed"
