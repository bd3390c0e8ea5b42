#!/usr/bin/env bash
# Session 20's device calls, one H200.
#   PART=suite   the whole suite compiled (gpu_s18.sh PART=final's list: no sharding, no notebooks),
#                then benchmarks/step_heads.py: serving steps replayed with and without the head
#                columns (the step-shape change of session 20), bytes compared first
#   PART=shapes  trace_writes.py with compression launch shapes of 16 values of a pooled row per
#                thread ($SHAPES) beside the defaults, then the notebooks' cells
# Logs under $OUT.   device tool: PART=suite bash benchmarks/gpu_s20.sh   (carry .vectors and .whl)
PART=${PART:-suite}
HERE="$(cd "$(dirname "$0")" && pwd)"
source "$HERE/_gpu_env.sh"
if [ "$PART" = suite ]; then
  timeout "${T_S:-260}" python3 -m pytest -v -p no:cacheprovider -n "${XDIST:-12}" -rfE tests \
    --ignore=tests/test_sharding.py --ignore=tests/test_notebooks.py \
    --deselect tests/test_triton.py::test_triton_large_cache > "$OUT/pytest_all.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_all.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_all.log" | tail -12
  timeout "${SH_S:-200}" python3 benchmarks/step_heads.py --json "$OUT/step_heads.json" > "$OUT/step_heads.txt" 2>&1
  echo "rc=$?" >> "$OUT/step_heads.txt"; grep -v "^W\|^I0" "$OUT/step_heads.txt" | tail -8
fi
if [ "$PART" = shapes ]; then
  timeout "${TW_S:-200}" python3 benchmarks/trace_writes.py --compress-shapes ${SHAPES:-8x2 4x1 16x2 8x1} \
    --json "$OUT/trace_writes.json" > "$OUT/trace_writes.txt" 2>&1
  echo "rc=$?" >> "$OUT/trace_writes.txt"; grep -v "^W\|^I0\|^measured" "$OUT/trace_writes.txt" | tail -30
  timeout "${N_S:-150}" python3 tests/scripts/run_notebook_cells.py ${NOTEBOOKS:-} > "$OUT/notebooks.txt" 2>&1
  echo "rc=$?" >> "$OUT/notebooks.txt"; grep -E "NOTEBOOK|rc=" "$OUT/notebooks.txt"
fi
