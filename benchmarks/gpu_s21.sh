#!/usr/bin/env bash
# Session 21's device calls, one H200.
#   PART=all     the whole suite compiled (no sharding, no notebooks: gpu_s20.sh's list), then
#                profile_step.py two ways in one run (the attention on a gathered K/V copy, as in
#                session 20; the contraction kernels reading the cache's rows), then the notebooks
#   PART=profile only the two profile_step.py runs
#   PART=check   test_gpu / test_serving / test_indexer compiled, profile_step.py (rows only), notebook 03
#   PART=profile3 profile_step.py three ways in one run: the gathered K/V unpacked by shifts (session
#                20's step), by a bitcast, and the contraction kernels reading the cache's rows
# Logs under $OUT.   device tool: PART=all bash benchmarks/gpu_s21.sh   (carry .vectors and .whl)
PART=${PART:-all}
HERE="$(cd "$(dirname "$0")" && pwd)"
source "$HERE/_gpu_env.sh"
if [ "$PART" = all ]; then
  timeout "${T_S:-260}" python3 -m pytest -v -p no:cacheprovider -n "${XDIST:-12}" -rfE tests \
    --ignore=tests/test_sharding.py --ignore=tests/test_notebooks.py \
    --deselect tests/test_triton.py::test_triton_large_cache > "$OUT/pytest_all.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_all.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_all.log" | tail -12
fi
profile_ways() {   # each argument "name:profile_step.py flags": one profile_step.py run, logs under $OUT
  for v in "$@"; do
    name=${v%%:*}; args=${v#*:}
    timeout "${PS_S:-100}" python3 benchmarks/profile_step.py $args --top 10 --json "$OUT/profile_$name.json" \
      > "$OUT/profile_$name.txt" 2>&1
    echo "rc=$?" >> "$OUT/profile_$name.txt"; grep -E "profile_step|span|all |rc=" "$OUT/profile_$name.txt"
  done
}
if [ "$PART" = all ] || [ "$PART" = profile ]; then
  profile_ways "gathered:--gather-attention" "rows:"
fi
if [ "$PART" = check ]; then
  timeout "${TC_S:-150}" python3 -m pytest -v -p no:cacheprovider -n "${XDIST:-12}" -rfE tests/test_gpu.py \
    tests/test_serving.py tests/test_indexer.py > "$OUT/pytest_check.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_check.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_check.log" | tail -8
  profile_ways "rows:"
  timeout 60 python3 tests/scripts/run_notebook_cells.py notebooks/03_stride_bug.ipynb > "$OUT/notebooks.txt" 2>&1
  echo "rc=$?" >> "$OUT/notebooks.txt"; grep -E "NOTEBOOK|rc=" "$OUT/notebooks.txt"
fi
if [ "$PART" = profile3 ]; then
  profile_ways "shift:--gather-attention --shift-unpack" "gathered:--gather-attention" "rows:"
fi
if [ "$PART" = all ]; then
  timeout "${N_S:-150}" python3 tests/scripts/run_notebook_cells.py ${NOTEBOOKS:-} > "$OUT/notebooks.txt" 2>&1
  echo "rc=$?" >> "$OUT/notebooks.txt"; grep -E "NOTEBOOK|rc=" "$OUT/notebooks.txt"
fi
