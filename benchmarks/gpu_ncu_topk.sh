#!/usr/bin/env bash
# Per-kernel Nsight Compute metrics of filter-mode top-k at [64, 32768] and [64, 131072], k = 512
# (profile_topk.py; L2 warm, clocks not locked). Logs under $OUT.
#   device tool: bash benchmarks/gpu_ncu_topk.sh
cd "$(dirname "$0")/.."; OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
M=gpu__time_duration.sum,launch__registers_per_thread,launch__grid_size,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active
NCUB=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
for shape in ${SHAPES:-64:32768:512}; do shape=${shape//:/ }
  timeout 150 "$NCUB" --profile-from-start off --cache-control none --clock-control none --metrics "$M" --csv \
    env PYTHONPATH=$PWD python3 benchmarks/profile_topk.py $shape > "$OUT/ncu_topk_${shape// /_}.csv" 2> "$OUT/err.txt"
  python3 benchmarks/_ncu_table.py "$OUT/ncu_topk_${shape// /_}.csv"
done
