#!/usr/bin/env bash
# Session 18's device calls, one H200.
#   PART=check   the pooling's weights by a knockout (three exps for four scores, the same bytes),
#                compiled: the numerics, write-kernel, launch-shape, reference and GPU write tests; then
#                probe_compress.py A/B against session 17's four exps ("four exps"): compression
#                ($PROBES_C at 32k / 128k tokens, $REPEAT times) and the decode update ($PROBES_D at
#                B = $BATCHES, next_n 1 / 4)
#   PART=probe   the two probes of PART=check alone (run 2: PROBES_C="exact,words in parent",
#                PROBES_D="exact,four exps,words in parent,stash in parent,ring by element": same-bytes
#                forms of the key-word and stash stores and the ring-row loads, against the knockout at
#                next_n 1 only, the rule that run 1 gave)
#                Run 3: PART=check PROBES_C=none BATCHES="256 64 1" PROBES_D="exact,stores by words,
#                session-17 decode": next_n 1 with both (the knockout, the stores from the packing's
#                shape) against the knockout alone and against neither (the compression kernel's
#                Triton IR is session 17's, hashes compared)
#   PART=ncu     Nsight Compute's whole SASS listings with counts of the shipped compression (4 x 2 at
#                128k tokens) and decode update (B = 256, next_n 1) kernels (gpu_s14.sh PART=ncu)
#   PART=final   the whole suite compiled (gpu_s13.sh's list), trace_writes.py at the default shapes
#                (the benchmarks.md table), the decode probe (exact against session 17's decode forms),
#                the compression probe (PROBES_C=none: skipped), the notebooks' cells
# Logs under $OUT.   device tool: PART=check bash benchmarks/gpu_s18.sh   (carry .vectors and .whl)
PART=${PART:-check}
HERE="$(cd "$(dirname "$0")" && pwd)"
if [ "$PART" = ncu ]; then
  exec env CASES="${CASES:-compress decode1}" COMPRESS_SHAPE=dx2 SAVE_SASS=1 PART=ncu bash "$HERE/gpu_s14.sh"
fi
source "$HERE/_gpu_env.sh"
if [ "$PART" = check ]; then
  timeout "${T_S:-200}" python3 -m pytest -v -p no:cacheprovider -n 8 -rfE tests/test_numerics.py \
    tests/test_write_kernels.py tests/test_write_launch_shapes.py tests/test_reference.py \
    tests/test_gpu.py -k "not reads and not read_path and not byte_view and not ordered and not attention" \
    > "$OUT/pytest_check.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_check.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_check.log" | tail -12
  PART=probe
fi
if [ "$PART" = probe ]; then
  if [ "${PROBES_C:-}" != none ]; then
    timeout "${PC_S:-130}" python3 benchmarks/probe_compress.py --shapes dx2 --repeat "${REPEAT:-2}" \
      --probes "${PROBES_C:-exact,four exps}" > "$OUT/probe_compress.txt" 2>&1
    echo "rc=$?" >> "$OUT/probe_compress.txt"; grep -v "^W\|^I0" "$OUT/probe_compress.txt" | tail -14
  fi
  timeout "${PD_S:-170}" python3 benchmarks/probe_compress.py --decode --batches ${BATCHES:-256 1} \
    --repeat "${REPEAT:-2}" --probes "${PROBES_D:-exact,four exps}" > "$OUT/probe_decode.txt" 2>&1
  echo "rc=$?" >> "$OUT/probe_decode.txt"; grep -v "^W\|^I0" "$OUT/probe_decode.txt" | tail -30
fi
if [ "$PART" = final ]; then
  timeout "${T_S:-260}" python3 -m pytest -v -p no:cacheprovider -n "${XDIST:-12}" -rfE tests \
    --ignore=tests/test_sharding.py --ignore=tests/test_notebooks.py \
    --deselect tests/test_triton.py::test_triton_large_cache > "$OUT/pytest_all.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_all.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_all.log" | tail -12
  timeout "${TW_S:-130}" python3 benchmarks/trace_writes.py --json "$OUT/trace_writes.json" > "$OUT/trace_writes.txt" 2>&1
  echo "rc=$?" >> "$OUT/trace_writes.txt"; grep -v "^W\|^I0\|^measured" "$OUT/trace_writes.txt" | tail -22
  timeout "${PF_S:-110}" python3 benchmarks/probe_compress.py --decode --batches ${BATCHES:-256 64 1} \
    --probes "${PROBES_D:-exact,session-17 decode}" > "$OUT/probe_decode.txt" 2>&1
  echo "rc=$?" >> "$OUT/probe_decode.txt"; grep -v "^W\|^I0" "$OUT/probe_decode.txt" | tail -20
  if [ "${PROBES_C:-}" != none ]; then
    timeout "${PC_S:-60}" python3 benchmarks/probe_compress.py --shapes dx2 \
      --probes "${PROBES_C:-exact,knockout}" > "$OUT/probe_compress.txt" 2>&1
    echo "rc=$?" >> "$OUT/probe_compress.txt"; grep -v "^W\|^I0" "$OUT/probe_compress.txt" | tail -8
  fi
  timeout "${N_S:-90}" python3 tests/scripts/run_notebook_cells.py ${NOTEBOOKS:-} > "$OUT/notebooks.txt" 2>&1
  echo "rc=$?" >> "$OUT/notebooks.txt"; grep -E "NOTEBOOK|rc=" "$OUT/notebooks.txt"
fi
