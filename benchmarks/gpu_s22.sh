#!/usr/bin/env bash
# Session 22's device calls, one H200.
#   PART=all    probe_compress.py --decode with $PROBES (same run, bytes checked first; this
#               session it A/B'd two trial decode programs, whose probes went with them:
#               docs/results/2026-12-02_s22_*.patch); trace_writes.py (issue 3's table); then the
#               whole suite compiled (no sharding; the write-kernel tests with it) and the notebooks
#               (session 22's run 1 also ran tests/test_write_kernels.py alone first: twice, so gone)
#   PART=probe  only the A/B (BATCHES, NEXT_N, PROBES, REPEAT: its lists)
#   PART=writes the write-kernel tests compiled, then the A/B
# Logs under $OUT.   device tool: PART=all bash benchmarks/gpu_s22.sh   (carry .vectors and .whl)
PART=${PART:-all}
HERE="$(cd "$(dirname "$0")" && pwd)"
source "$HERE/_gpu_env.sh"
if [ "$PART" = writes ]; then      # the write-kernel tests compiled, then the A/B probe
  timeout "${TD_S:-120}" python3 -m pytest -v -p no:cacheprovider -n 6 -rfE tests/test_write_kernels.py \
    > "$OUT/pytest_writes.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_writes.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_writes.log" | tail -8
  PART=probe
fi
if [ "$PART" = all ] || [ "$PART" = probe ]; then
  timeout "${P_S:-150}" python3 benchmarks/probe_compress.py --decode --batches ${BATCHES:-256 64 1} \
    --next-n ${NEXT_N:-1 2 4} --probes "${PROBES:-exact}" --repeat "${REPEAT:-2}" \
    > "$OUT/probe_decode.txt" 2>&1
  echo "rc=$?" >> "$OUT/probe_decode.txt"; cat "$OUT/probe_decode.txt"
fi
if [ "$PART" = all ]; then
  timeout "${TW_S:-120}" python3 benchmarks/trace_writes.py > "$OUT/trace_writes.txt" 2>&1
  echo "rc=$?" >> "$OUT/trace_writes.txt"; tail -30 "$OUT/trace_writes.txt"
  timeout "${T_S:-200}" python3 -m pytest -v -p no:cacheprovider -n "${XDIST:-12}" -rfE tests \
    --ignore=tests/test_sharding.py --ignore=tests/test_notebooks.py \
    --deselect tests/test_triton.py::test_triton_large_cache > "$OUT/pytest_all.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_all.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_all.log" | tail -12
  timeout "${N_S:-100}" python3 tests/scripts/run_notebook_cells.py ${NOTEBOOKS:-} > "$OUT/notebooks.txt" 2>&1
  echo "rc=$?" >> "$OUT/notebooks.txt"; grep -E "NOTEBOOK|rc=" "$OUT/notebooks.txt"
fi
