#!/usr/bin/env bash
# Session 14's device calls, one H200.
#   PART=check   the Triton-language port's e4m3 code by the fp8 conversion: the numerics, write-kernel,
#                Triton (jax-triton carried in .whl) and GPU write tests compiled; then PART=ncu
#   PART=ncu     Nsight Compute on the shipped write kernels, one profiling pass per case (compression
#                at $TOKENS tokens; the decode update at B = 256, next_n 1 and 4): the SASS opcode mix
#                (benchmarks/_sass_summary.py) and issue / occupancy / stall metrics, as tables under $OUT
#                (SAVE_SASS=1: also each case's whole SASS listing with counts, sass_CASE.csv.gz; CASES: a
#                subset of the cases, or decode4b1: B = 1, next_n 4; COMPRESS_SHAPE: compression's tile x
#                warps, d = default tile)
#   PART=shapes  trace_writes.py with launch-shape variants of both write kernels under the new
#                Hadamard ($DECODE_VARIANTS, $COMPRESS_SHAPES; each byte-checked against the default),
#                then the notebooks' code cells compiled
#   PART=writes  the write-kernel, launch-shape and GPU write tests compiled (the new default warps),
#                then trace_writes.py with the default shapes
#   PART=suite, PART=x2: as in benchmarks/gpu_s13.sh (the whole suite compiled, trace_writes, notebooks;
#                the sharding tests on nvidia-h200-x2)
# Logs under $OUT.   device tool: PART=check bash benchmarks/gpu_s14.sh   (carry .vectors and .whl)
PART=${PART:-check}
if [ "$PART" = suite ] || [ "$PART" = x2 ]; then
  exec env PART="$PART" bash "$(dirname "$0")/gpu_s13.sh"
fi
source "$(dirname "$0")/_gpu_env.sh"            # also installs a carried jax-triton wheel
if [ "$PART" = check ]; then
  timeout "${T_S:-300}" python3 -m pytest -v -p no:cacheprovider -n 8 -rfE tests/test_numerics.py \
    tests/test_write_kernels.py tests/test_triton.py --deselect tests/test_triton.py::test_triton_large_cache \
    tests/test_gpu.py -k "not reads and not read_path and not byte_view and not ordered and not attention" \
    > "$OUT/pytest_check.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_check.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_check.log" | tail -12
  PART=ncu
fi
if [ "$PART" = ncu ]; then
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  M=gpu__time_duration.sum,launch__registers_per_thread,launch__grid_size,launch__block_size,\
sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,\
sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,\
smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_drain_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,\
lts__t_bytes.sum,sm__cycles_elapsed.max,smsp__cycles_active.max
  for CASE in ${CASES:-compress decode1 decode4}; do
    case $CASE in
      compress) ARGS="--profile --tokens ${TOKENS:-131072} --shapes ${COMPRESS_SHAPE:-dx4} --probes exact" ;;
      decode1) ARGS="--decode --profile --batches 256 --next-n 1 --probes exact" ;;
      decode4) ARGS="--decode --profile --batches 256 --next-n 4 --probes exact" ;;
      decode4b1) ARGS="--decode --profile --batches 1 --next-n 4 --probes exact" ;;       # session 22
    esac
    timeout "${NCU_S:-150}" "$NCU" --profile-from-start off --cache-control none --clock-control none \
      --kernel-name regex:kpool --section SourceCounters --metrics "$M" -f -o "/tmp/ncu_$CASE" \
      env PYTHONPATH="$PYTHONPATH" python3 benchmarks/probe_compress.py $ARGS > "$OUT/ncu_$CASE.log" 2>&1
    echo "rc=$?" >> "$OUT/ncu_$CASE.log"; grep -E "profiled|rc=|ERR" "$OUT/ncu_$CASE.log" | tail -3
    "$NCU" --import "/tmp/ncu_$CASE.ncu-rep" --page source --print-source sass --csv > "/tmp/sass_$CASE.csv" 2>&1
    python3 benchmarks/_sass_summary.py "/tmp/sass_$CASE.csv" > "$OUT/sass_$CASE.txt" 2>&1; head -20 "$OUT/sass_$CASE.txt"
    [ -n "${SAVE_SASS:-}" ] && gzip -c "/tmp/sass_$CASE.csv" > "$OUT/sass_$CASE.csv.gz"     # the whole listing
    "$NCU" --import "/tmp/ncu_$CASE.ncu-rep" --page raw --csv --metrics "$M" > "$OUT/metrics_$CASE.csv" 2>&1
    python3 - "$OUT/metrics_$CASE.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
if len(rows) < 3:
    sys.exit("no metric rows: " + open(sys.argv[1]).read()[:400])
hdr, units = rows[0], rows[1]
for r in rows[2:]:
    print("--- " + r[hdr.index("Kernel Name")][:60])
    for i, h in enumerate(hdr):
        if "__" in h:
            print(f"  {h:<95}{r[i]:>14} {units[i]}")
PY
  done
fi
if [ "$PART" = shapes ]; then
  timeout "${TW_S:-300}" python3 benchmarks/trace_writes.py --decode-variants ${DECODE_VARIANTS:-forward:1 forward:2 forward:8} \
    --compress-shapes ${COMPRESS_SHAPES:-2x4 4x2 4x8 8x4 8x8} --json "$OUT/trace_writes_shapes.json" > "$OUT/trace_writes_shapes.txt" 2>&1
  echo "rc=$?" >> "$OUT/trace_writes_shapes.txt"; grep -v "^W\|^I0\|^measured" "$OUT/trace_writes_shapes.txt" | tail -45
  timeout "${N_S:-200}" python3 tests/scripts/run_notebook_cells.py > "$OUT/notebooks.txt" 2>&1
  echo "rc=$?" >> "$OUT/notebooks.txt"; grep -E "NOTEBOOK|rc=" "$OUT/notebooks.txt"
fi
if [ "$PART" = writes ]; then
  timeout "${T_S:-240}" python3 -m pytest -v -p no:cacheprovider -n 8 -rfE tests/test_write_kernels.py \
    tests/test_write_launch_shapes.py tests/test_reference.py \
    tests/test_gpu.py -k "not reads and not read_path and not byte_view and not ordered and not attention" \
    > "$OUT/pytest_writes.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_writes.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_writes.log" | tail -12
  timeout "${TW_S:-200}" python3 benchmarks/trace_writes.py --json "$OUT/trace_writes.json" > "$OUT/trace_writes.txt" 2>&1
  echo "rc=$?" >> "$OUT/trace_writes.txt"; grep -v "^W\|^I0\|^measured" "$OUT/trace_writes.txt" | tail -30
fi
