#!/usr/bin/env bash
# The compression kernel under the microscope, one device call: Nsight Compute
# metrics (time, registers, occupancy, spills, load vectorisation, stall reasons)
# for the probes of probe_compress.py. Logs under $OUT. (XLA's --xla_dump_to does not
# hold the Pallas Triton kernels' PTX; for the instruction mix use ncu's SASS page and
# benchmarks/_sass_summary.py.)
#   device tool: bash benchmarks/gpu_compress_probe.sh
#   PROBES="exact,mac -> c + a*b,all cheap" SHAPES=8x4,16x8 TOKENS=131072 (defaults)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PROBES=${PROBES:-exact,mac -> c + a*b,all cheap}; SHAPES=${SHAPES:-8x4,16x8}; TOKENS=${TOKENS:-131072}
M=gpu__time_duration.sum,launch__registers_per_thread,launch__occupancy_limit_registers,\
sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,\
sm__sass_inst_executed_op_local_ld.sum,sm__sass_inst_executed_op_local_st.sum,dram__bytes.sum,\
sm__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,\
l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout 300 "$NCU" --profile-from-start off --cache-control none --clock-control none --metrics "$M" --csv \
  env PYTHONPATH=$PWD python3 benchmarks/probe_compress.py --profile --tokens "$TOKENS" --shapes "$SHAPES" \
  --probes "$PROBES" > "$OUT/ncu_compress.csv" 2> "$OUT/ncu_compress.err"
grep "profiled" "$OUT/ncu_compress.csv" "$OUT/ncu_compress.err" | tail -1
python3 - "$OUT/ncu_compress.csv" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows:
    sys.exit("ncu wrote no kernel rows")
hdr = rows[0]; ii = hdr.index("ID"); ki = hdr.index("Kernel Name"); mi = hdr.index("Metric Name"); vi = hdr.index("Metric Value")
by = collections.OrderedDict()
for r in rows[1:]:
    if "compress" in r[ki]:
        by.setdefault(r[ii], {})[r[mi]] = r[vi]
for i, m in by.items():
    print(f"--- kernel #{i}")
    for k, v in m.items():
        print(f"  {k:<90}{v:>16}")
PY
