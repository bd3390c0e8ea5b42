#!/usr/bin/env bash
# Session 16's device calls, one H200.
#   PART=check   the kernels' products as one inline mul.rn.f32 (_backend.mul_rn) and the pooling exp's
#                power of two added to the bits, compiled: the numerics, write-kernel, launch-shape,
#                reference, Triton-port and GPU write tests (the new mul_rn test included); then
#                probe_compress.py A/B against session 15's forms, compression ($PROBES_C) at 32k / 128k
#                tokens and the decode update ($PROBES_D) at B = 256 / 1, next_n 1 / 4, $REPEAT times
#   PART=check2  the exp's exact reduction steps as one fma.rn.f32 each (_backend.sub_exact_rn): the
#                numerics, write-kernel, launch-shape, reference and GPU write tests, probe A/B
#                ($PROBES_C at 32k / 128k tokens, $PROBES_D), then Nsight Compute on the compression
#                kernel at its shipped 4 x 2 shape with the whole SASS listing (gpu_s14.sh PART=ncu)
#   PART=pipes   Nsight Compute's ComputeWorkloadAnalysis and InstructionStats sections on the shipped
#                compression kernel (4 x 2, 128k tokens) and decode update (B = 256, next_n 1): every
#                collected pipe metric (instructions and active cycles per pipe), as a table under $OUT
#   PART=final   the whole suite compiled (gpu_s13.sh's list), trace_writes.py at the default shapes
#                (the benchmarks.md table), the notebooks' cells
# Logs under $OUT.   device tool: PART=check bash benchmarks/gpu_s16.sh   (carry .vectors and .whl)
PART=${PART:-check}
HERE="$(cd "$(dirname "$0")" && pwd)"
source "$HERE/_gpu_env.sh"
if [ "$PART" = check ]; then
  timeout "${T_S:-200}" python3 -m pytest -v -p no:cacheprovider -n 8 -rfE tests/test_numerics.py \
    tests/test_write_kernels.py tests/test_write_launch_shapes.py tests/test_reference.py \
    tests/test_triton.py --deselect tests/test_triton.py::test_triton_large_cache \
    tests/test_gpu.py -k "not reads and not read_path and not byte_view and not ordered and not attention" \
    > "$OUT/pytest_check.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_check.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_check.log" | tail -12
  timeout "${PC_S:-170}" python3 benchmarks/probe_compress.py --shapes dx2 --repeat "${REPEAT:-2}" \
    --probes "${PROBES_C:-exact,session-15 numerics,mul by rounded,exp power by multiply}" \
    > "$OUT/probe_compress.txt" 2>&1
  echo "rc=$?" >> "$OUT/probe_compress.txt"; grep -v "^W\|^I0" "$OUT/probe_compress.txt" | tail -24
  timeout "${PD_S:-170}" python3 benchmarks/probe_compress.py --decode --repeat "${REPEAT:-2}" \
    --probes "${PROBES_D:-exact,session-15 numerics,exp no table,no pool arithmetic}" \
    > "$OUT/probe_decode.txt" 2>&1
  echo "rc=$?" >> "$OUT/probe_decode.txt"; grep -v "^W\|^I0" "$OUT/probe_decode.txt" | tail -42
fi
if [ "$PART" = check2 ]; then
  timeout "${T_S:-170}" python3 -m pytest -v -p no:cacheprovider -n 8 -rfE tests/test_numerics.py \
    tests/test_write_kernels.py tests/test_write_launch_shapes.py tests/test_reference.py \
    tests/test_gpu.py -k "not reads and not read_path and not byte_view and not ordered and not attention" \
    > "$OUT/pytest_check.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_check.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_check.log" | tail -12
  timeout "${PC_S:-130}" python3 benchmarks/probe_compress.py --shapes dx2 --repeat "${REPEAT:-2}" \
    --probes "${PROBES_C:-exact,exact products unfused,session-15 numerics}" > "$OUT/probe_compress.txt" 2>&1
  echo "rc=$?" >> "$OUT/probe_compress.txt"; grep -v "^W\|^I0" "$OUT/probe_compress.txt" | tail -16
  timeout "${PD_S:-90}" python3 benchmarks/probe_compress.py --decode \
    --probes "${PROBES_D:-exact,exact products unfused,session-15 numerics}" > "$OUT/probe_decode.txt" 2>&1
  echo "rc=$?" >> "$OUT/probe_decode.txt"; grep -v "^W\|^I0" "$OUT/probe_decode.txt" | tail -20
  CASES=compress COMPRESS_SHAPE=dx2 SAVE_SASS=1 PART=ncu bash "$HERE/gpu_s14.sh"
fi
if [ "$PART" = pipes ]; then
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  for CASE in compress decode1; do
    case $CASE in
      compress) ARGS="--profile --tokens 131072 --shapes dx2 --probes exact" ;;
      decode1) ARGS="--decode --profile --batches 256 --next-n 1 --probes exact" ;;
    esac
    timeout "${NCU_S:-150}" "$NCU" --profile-from-start off --cache-control none --clock-control none \
      --kernel-name regex:kpool --section ComputeWorkloadAnalysis --section InstructionStats \
      --section SchedulerStats --section WarpStateStats -f -o "/tmp/pipes_$CASE" \
      env PYTHONPATH="$PYTHONPATH" python3 benchmarks/probe_compress.py $ARGS > "$OUT/pipes_$CASE.log" 2>&1
    echo "rc=$?" >> "$OUT/pipes_$CASE.log"; grep -E "profiled|rc=|ERR" "$OUT/pipes_$CASE.log" | tail -3
    "$NCU" --import "/tmp/pipes_$CASE.ncu-rep" --page raw --csv > "/tmp/pipes_$CASE.csv" 2>&1
    python3 - "/tmp/pipes_$CASE.csv" > "$OUT/pipes_$CASE.txt" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
hdr, units = rows[0], rows[1]
for r in rows[2:]:
    print("--- " + r[hdr.index("Kernel Name")][:60])
    for i, h in enumerate(hdr):
        if "pipe" in h or "inst_executed.sum" in h or "issue_active" in h or "warps_issue_stalled" in h and "pct" not in h:
            print(f"  {h:<100}{r[i]:>16} {units[i]}")
PY
    grep -E "pipe_(alu|fma|fmaheavy|fmalite|xu|lsu|adu|cbu|uniform)[a-z_]*\.(sum|avg\.pct)" "$OUT/pipes_$CASE.txt" | head -40
  done
fi
if [ "$PART" = final ]; then
  timeout "${T_S:-260}" python3 -m pytest -v -p no:cacheprovider -n "${XDIST:-12}" -rfE tests \
    --ignore=tests/test_sharding.py --ignore=tests/test_notebooks.py \
    --deselect tests/test_triton.py::test_triton_large_cache > "$OUT/pytest_all.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_all.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_all.log" | tail -12
  timeout "${TW_S:-130}" python3 benchmarks/trace_writes.py --json "$OUT/trace_writes.json" > "$OUT/trace_writes.txt" 2>&1
  echo "rc=$?" >> "$OUT/trace_writes.txt"; grep -v "^W\|^I0\|^measured" "$OUT/trace_writes.txt" | tail -22
  timeout "${N_S:-90}" python3 tests/scripts/run_notebook_cells.py ${NOTEBOOKS:-} > "$OUT/notebooks.txt" 2>&1
  echo "rc=$?" >> "$OUT/notebooks.txt"; grep -E "NOTEBOOK|rc=" "$OUT/notebooks.txt"
fi
