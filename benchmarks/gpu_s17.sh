#!/usr/bin/env bash
# Session 17's device calls, one H200.
#   PART=check   the kernel-only forms (bf16 rounding by cvt.rn.bf16x2, -0 -> +0 by add.rn, no clip
#                before the saturating fp8 conversion; in runs 1 and 4 also a trial exp, dropped:
#                docs/results/2026-12-01_s17_exp256.patch), compiled: the numerics, write-kernel, launch-shape,
#                reference, Triton-port and GPU write tests (the new GPU tests of the PTX forms
#                included); then probe_compress.py A/B against session 16's forms, compression
#                ($PROBES_C at 32k / 128k tokens, $REPEAT times) and the decode update ($PROBES_D
#                at B = $BATCHES, next_n 1 / 4)
#   PART=decode  the GPU tests of the PTX forms, then the decode probe alone ($PROBES_D at B = $BATCHES,
#                next_n 1 / 4, $REPEAT times)
#   PART=final   the whole suite compiled (gpu_s13.sh's list), trace_writes.py at the default shapes
#                (the benchmarks.md table), the decode probe (the apes-in-branch default against the
#                loads at the start) and the compression probe (against session 16's kernel ops),
#                the notebooks' cells
# Logs under $OUT.   device tool: PART=check bash benchmarks/gpu_s17.sh   (carry .vectors and .whl)
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
  timeout "${PC_S:-150}" python3 benchmarks/probe_compress.py --shapes dx2 --repeat "${REPEAT:-2}" \
    --probes "${PROBES_C:-exact,session-16 kernel ops}" \
    > "$OUT/probe_compress.txt" 2>&1
  echo "rc=$?" >> "$OUT/probe_compress.txt"; grep -v "^W\|^I0" "$OUT/probe_compress.txt" | tail -24
  timeout "${PD_S:-170}" python3 benchmarks/probe_compress.py --decode --batches ${BATCHES:-256 132 1} \
    --probes "${PROBES_D:-exact,session-16 kernel ops,apes at start,no pool arithmetic}" \
    > "$OUT/probe_decode.txt" 2>&1
  echo "rc=$?" >> "$OUT/probe_decode.txt"; grep -v "^W\|^I0" "$OUT/probe_decode.txt" | tail -42
fi
if [ "$PART" = decode ]; then
  timeout "${T_S:-120}" python3 -m pytest -v -p no:cacheprovider -n 4 -rfE tests/test_gpu.py \
    -k "bf16_round or saturates or mul_rn" > "$OUT/pytest_ptx.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_ptx.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_ptx.log" | tail -8
  timeout "${PD_S:-300}" python3 benchmarks/probe_compress.py --decode --batches ${BATCHES:-256 132 1} \
    --repeat "${REPEAT:-2}" --probes "${PROBES_D:-exact,apes at start,apes in branch,no pool arithmetic}" \
    > "$OUT/probe_decode.txt" 2>&1
  echo "rc=$?" >> "$OUT/probe_decode.txt"; grep -v "^W\|^I0" "$OUT/probe_decode.txt" | tail -60
fi
if [ "$PART" = final ]; then
  timeout "${T_S:-260}" python3 -m pytest -v -p no:cacheprovider -n "${XDIST:-12}" -rfE tests \
    --ignore=tests/test_sharding.py --ignore=tests/test_notebooks.py \
    --deselect tests/test_triton.py::test_triton_large_cache > "$OUT/pytest_all.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_all.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_all.log" | tail -12
  timeout "${TW_S:-130}" python3 benchmarks/trace_writes.py --json "$OUT/trace_writes.json" > "$OUT/trace_writes.txt" 2>&1
  echo "rc=$?" >> "$OUT/trace_writes.txt"; grep -v "^W\|^I0\|^measured" "$OUT/trace_writes.txt" | tail -22
  timeout "${PF_S:-110}" python3 benchmarks/probe_compress.py --decode --batches ${BATCHES:-256 64 1} \
    --probes "${PROBES_D:-exact,apes at start}" > "$OUT/probe_decode.txt" 2>&1
  echo "rc=$?" >> "$OUT/probe_decode.txt"; grep -v "^W\|^I0" "$OUT/probe_decode.txt" | tail -20
  timeout "${PC_S:-60}" python3 benchmarks/probe_compress.py --shapes dx2 \
    --probes "${PROBES_C:-exact,session-16 kernel ops}" > "$OUT/probe_compress.txt" 2>&1
  echo "rc=$?" >> "$OUT/probe_compress.txt"; grep -v "^W\|^I0" "$OUT/probe_compress.txt" | tail -8
  timeout "${N_S:-90}" python3 tests/scripts/run_notebook_cells.py ${NOTEBOOKS:-} > "$OUT/notebooks.txt" 2>&1
  echo "rc=$?" >> "$OUT/notebooks.txt"; grep -E "NOTEBOOK|rc=" "$OUT/notebooks.txt"
fi
