#!/usr/bin/env bash
# paged_logits forms and launch shapes on one H200, one device call: the same-run
# timing table of probe_logits.py (decode B = 64 x 128k by default), then Nsight
# Compute metrics of one call of each variant (time, registers, occupancy, issue
# activity, DRAM bytes, load requests vs sectors, stall reasons). Logs under $OUT.
#   device tool: bash benchmarks/gpu_logits_probe.sh      VARIANTS=... (probe_logits.py --variants)
#   PROBE_ARGS="--rows 4 --context 32768" (other probe_logits.py options)  NCU=0 (timing only)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
V="${VARIANTS:+--variants $VARIANTS} ${PROBE_ARGS:-}"
timeout "${P_S:-240}" python3 benchmarks/probe_logits.py $V > "$OUT/probe_logits.txt" 2>&1
echo "rc=$?" >> "$OUT/probe_logits.txt"; cat "$OUT/probe_logits.txt" | grep -v "^W\|^I0"
[ "${NCU:-1}" = 0 ] && exit 0
M=gpu__time_duration.sum,launch__registers_per_thread,launch__occupancy_limit_registers,\
sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,dram__bytes.sum,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active,\
l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,\
sm__sass_inst_executed_op_local_ld.sum,\
smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio
NCUB=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout "${N_S:-240}" "$NCUB" --profile-from-start off --cache-control none --clock-control none --metrics "$M" --csv \
  env PYTHONPATH=$PWD python3 benchmarks/probe_logits.py --profile $V > "$OUT/ncu_logits.csv" 2> "$OUT/ncu_logits.err"
python3 benchmarks/_ncu_table.py "$OUT/ncu_logits.csv" logits
