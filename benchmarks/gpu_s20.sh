#!/usr/bin/env bash
# Session 20's device calls, one H200.
#   PART=suite   the whole suite compiled (gpu_s18.sh PART=final's list: no sharding, no notebooks),
#                then benchmarks/step_heads.py: serving steps replayed with and without the head
#                columns (the step-shape change of session 20), bytes compared first
#   PART=shapes  trace_writes.py with compression launch shapes of 16 values of a pooled row per
#                thread ($SHAPES) beside the defaults, then the notebooks' cells
#   PART=final   the suite as in PART=suite, then the notebooks' cells (main's final code)
#   PART=final2  the suite, profile_step.py three ways (session 19's contraction launches and K/V
#                gather by words; the new launches with the word gather; both new), the notebooks
#   PART=profile benchmarks/profile_step.py: a serving step's device time kernel by kernel
#   PART=contractions  test_gpu / test_serving / test_indexer compiled, then profile_step.py with the
#                ordered contractions' launch defaults of session 19 and of session 20 (an A/B)
#   PART=olprobe benchmarks/probe_ordered_linear.py: launch shapes of the ordered contractions ($OL_ARGS)
# Logs under $OUT.   device tool: PART=suite bash benchmarks/gpu_s20.sh   (carry .vectors and .whl)
PART=${PART:-suite}
HERE="$(cd "$(dirname "$0")" && pwd)"
source "$HERE/_gpu_env.sh"
if [ "$PART" = suite ] || [ "$PART" = final ] || [ "$PART" = final2 ]; then
  timeout "${T_S:-260}" python3 -m pytest -v -p no:cacheprovider -n "${XDIST:-12}" -rfE tests \
    --ignore=tests/test_sharding.py --ignore=tests/test_notebooks.py \
    --deselect tests/test_triton.py::test_triton_large_cache > "$OUT/pytest_all.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_all.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_all.log" | tail -12
  if [ "$PART" = suite ]; then
    timeout "${SH_S:-200}" python3 benchmarks/step_heads.py --json "$OUT/step_heads.json" > "$OUT/step_heads.txt" 2>&1
    echo "rc=$?" >> "$OUT/step_heads.txt"; grep -v "^W\|^I0" "$OUT/step_heads.txt" | tail -8
  fi
fi
if [ "$PART" = shapes ]; then
  timeout "${TW_S:-200}" python3 benchmarks/trace_writes.py --compress-shapes ${SHAPES:-8x2 4x1 16x2 8x1} \
    --json "$OUT/trace_writes.json" > "$OUT/trace_writes.txt" 2>&1
  echo "rc=$?" >> "$OUT/trace_writes.txt"; grep -v "^W\|^I0\|^measured" "$OUT/trace_writes.txt" | tail -30
fi
if [ "$PART" = final2 ]; then
  for v in "s19:--session19-contractions --word-gather" "words:--word-gather" "new:"; do
    name=${v%%:*}; args=${v#*:}
    timeout "${PS_S:-90}" python3 benchmarks/profile_step.py $args --top 8 --json "$OUT/profile_$name.json" \
      > "$OUT/profile_$name.txt" 2>&1
    echo "rc=$?" >> "$OUT/profile_$name.txt"; grep -E "profile_step|span|all |rc=" "$OUT/profile_$name.txt"
  done
fi
if [ "$PART" = shapes ] || [ "$PART" = final ] || [ "$PART" = final2 ]; then
  timeout "${N_S:-150}" python3 tests/scripts/run_notebook_cells.py ${NOTEBOOKS:-} > "$OUT/notebooks.txt" 2>&1
  echo "rc=$?" >> "$OUT/notebooks.txt"; grep -E "NOTEBOOK|rc=" "$OUT/notebooks.txt"
fi
if [ "$PART" = profile ] || [ "$PART" = contractions ]; then
  if [ "$PART" = contractions ]; then      # the ordered-linear tests compiled, then the step A/B
    timeout "${TC_S:-200}" python3 -m pytest -v -p no:cacheprovider -n 8 -rfE tests/test_gpu.py tests/test_serving.py \
      tests/test_indexer.py > "$OUT/pytest_contractions.log" 2>&1
    echo "rc=$?" >> "$OUT/pytest_contractions.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_contractions.log" | tail -8
    timeout "${PS_S:-150}" python3 benchmarks/profile_step.py --session19-contractions --top 12 \
      --json "$OUT/profile_step_s19.json" > "$OUT/profile_step_s19.txt" 2>&1
    echo "rc=$?" >> "$OUT/profile_step_s19.txt"; grep -v "^W\|^I0" "$OUT/profile_step_s19.txt" | tail -40
  fi
  timeout "${PS_S:-150}" python3 benchmarks/profile_step.py --top 12 --json "$OUT/profile_step.json" > "$OUT/profile_step.txt" 2>&1
  echo "rc=$?" >> "$OUT/profile_step.txt"; grep -v "^W\|^I0" "$OUT/profile_step.txt" | tail -40
fi
if [ "$PART" = olprobe ]; then
  timeout "${OL_S:-300}" python3 benchmarks/probe_ordered_linear.py ${OL_ARGS:-} > "$OUT/probe_ordered_linear.txt" 2>&1
  echo "rc=$?" >> "$OUT/probe_ordered_linear.txt"; grep -v "^W\|^I0" "$OUT/probe_ordered_linear.txt" | tail -40
fi
