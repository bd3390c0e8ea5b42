#!/usr/bin/env bash
# Session 15's device calls, one H200.
#   PART=probe   Nsight Compute on the shipped write kernels with each case's whole SASS listing kept
#                (gpu_s14.sh PART=ncu SAVE_SASS=1), then probe_compress.py: the shipped numerics against
#                $PROBES (SAME_BITS candidates are byte-checked against the reference first), compression
#                at 32k / 128k tokens and the decode update at B = 256 / 1, next_n 1 / 4, $REPEAT times
#                (run 1 ran it with the then probe "exp d <= 0", now numerics.exp_nonpositive_f32; it writes
#                14 files and the device tool returns 8: for the listings use CASES="decode1 compress")
#   PART=check   session 15's same-bytes changes compiled: the numerics, write-kernel, launch-shape,
#                reference, Triton-port and GPU write tests; then probe_compress.py A/B of each change
#                against its session-14 form at the shipped launch shapes ($PROBES, $REPEAT times; run 3
#                also had "ape rows by gather", dropped with that form after it)
#   PART=decode  probe_compress.py --decode ($PROBES; run 4 had "exp table computed", dropped with that
#                form after it), then PART=table
#   PART=table   trace_writes.py at the default shapes (the benchmarks.md table; $DECODE_VARIANTS: also
#                decode launch variants, e.g. "forward:1 forward:2 forward:4", byte-checked)
#   PART=final   the decode probe A/B of the one-token stash order ($PROBES), then the whole suite
#                compiled (gpu_s13.sh's list), trace_writes.py at the default shapes, the notebooks' cells
#   PART=floor   the decode probe with empty kernels of the decode grids (B programs x 2 / 4 warps) and
#                "no pool arithmetic", then the notebooks' cells ($NOTEBOOKS, default all)
# Logs under $OUT.   device tool: PART=probe bash benchmarks/gpu_s15.sh   (carry .vectors and .whl)
PART=${PART:-check}
HERE="$(cd "$(dirname "$0")" && pwd)"
if [ "$PART" = probe ]; then
  PART=ncu SAVE_SASS=1 bash "$HERE/gpu_s14.sh"
  source "$HERE/_gpu_env.sh"
  P=${PROBES:-exact,exp no table}
  timeout "${PC_S:-200}" python3 benchmarks/probe_compress.py --probes "$P" --repeat "${REPEAT:-2}" \
    > "$OUT/probe_compress.txt" 2>&1
  echo "rc=$?" >> "$OUT/probe_compress.txt"; grep -v "^W\|^I0" "$OUT/probe_compress.txt" | tail -14
  timeout "${PD_S:-150}" python3 benchmarks/probe_compress.py --decode --probes "$P" --repeat "${REPEAT:-2}" \
    > "$OUT/probe_decode.txt" 2>&1
  echo "rc=$?" >> "$OUT/probe_decode.txt"; grep -v "^W\|^I0" "$OUT/probe_decode.txt" | tail -20
fi
if [ "$PART" = check ]; then
  source "$HERE/_gpu_env.sh"
  timeout "${T_S:-250}" python3 -m pytest -v -p no:cacheprovider -n 8 -rfE tests/test_numerics.py \
    tests/test_write_kernels.py tests/test_write_launch_shapes.py tests/test_reference.py \
    tests/test_triton.py --deselect tests/test_triton.py::test_triton_large_cache \
    tests/test_gpu.py -k "not reads and not read_path and not byte_view and not ordered and not attention" \
    > "$OUT/pytest_check.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_check.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_check.log" | tail -12
  P=${PROBES:-exact,session-14 pooling,ring keys unguarded,all session-14}
  timeout "${PC_S:-150}" python3 benchmarks/probe_compress.py --shapes dx2 --probes "$P" --repeat "${REPEAT:-2}" \
    > "$OUT/probe_compress.txt" 2>&1
  echo "rc=$?" >> "$OUT/probe_compress.txt"; grep -v "^W\|^I0" "$OUT/probe_compress.txt" | tail -24
  timeout "${PD_S:-150}" python3 benchmarks/probe_compress.py --decode --probes "$P" --repeat "${REPEAT:-2}" \
    > "$OUT/probe_decode.txt" 2>&1
  echo "rc=$?" >> "$OUT/probe_decode.txt"; grep -v "^W\|^I0" "$OUT/probe_decode.txt" | tail -42
fi
if [ "$PART" = decode ]; then
  source "$HERE/_gpu_env.sh"
  timeout "${PD_S:-150}" python3 benchmarks/probe_compress.py --decode --probes "${PROBES:-exact,exp no table}" \
    --repeat "${REPEAT:-2}" > "$OUT/probe_decode.txt" 2>&1
  echo "rc=$?" >> "$OUT/probe_decode.txt"; grep -v "^W\|^I0" "$OUT/probe_decode.txt" | tail -26
  PART=table
fi
if [ "$PART" = table ]; then
  source "$HERE/_gpu_env.sh"
  DV=${DECODE_VARIANTS:-}
  timeout "${TW_S:-250}" python3 benchmarks/trace_writes.py ${DV:+--decode-variants $DV} --json "$OUT/trace_writes.json" \
    > "$OUT/trace_writes.txt" 2>&1
  echo "rc=$?" >> "$OUT/trace_writes.txt"; grep -v "^W\|^I0\|^measured" "$OUT/trace_writes.txt" | tail -30
fi
if [ "$PART" = final ]; then
  source "$HERE/_gpu_env.sh"
  timeout "${PD_S:-90}" python3 benchmarks/probe_compress.py --decode --probes "${PROBES:-exact,stash last}" \
    --repeat "${REPEAT:-2}" > "$OUT/probe_decode.txt" 2>&1
  echo "rc=$?" >> "$OUT/probe_decode.txt"; grep -v "^W\|^I0" "$OUT/probe_decode.txt" | tail -18
  timeout "${T_S:-260}" python3 -m pytest -v -p no:cacheprovider -n "${XDIST:-12}" -rfE tests \
    --ignore=tests/test_sharding.py --ignore=tests/test_notebooks.py \
    --deselect tests/test_triton.py::test_triton_large_cache > "$OUT/pytest_all.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_all.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_all.log" | tail -12
  timeout "${TW_S:-130}" python3 benchmarks/trace_writes.py --json "$OUT/trace_writes.json" > "$OUT/trace_writes.txt" 2>&1
  echo "rc=$?" >> "$OUT/trace_writes.txt"; grep -v "^W\|^I0\|^measured" "$OUT/trace_writes.txt" | tail -22
  timeout "${N_S:-50}" python3 tests/scripts/run_notebook_cells.py > "$OUT/notebooks.txt" 2>&1
  echo "rc=$?" >> "$OUT/notebooks.txt"; grep -E "NOTEBOOK|rc=" "$OUT/notebooks.txt"
fi
if [ "$PART" = floor ]; then
  source "$HERE/_gpu_env.sh"
  timeout "${PD_S:-80}" python3 benchmarks/probe_compress.py --decode --probes "${PROBES:-exact,no pool arithmetic}" \
    > "$OUT/probe_decode.txt" 2>&1
  echo "rc=$?" >> "$OUT/probe_decode.txt"; grep -v "^W\|^I0" "$OUT/probe_decode.txt" | tail -16
  timeout "${N_S:-90}" python3 tests/scripts/run_notebook_cells.py ${NOTEBOOKS:-} > "$OUT/notebooks.txt" 2>&1
  echo "rc=$?" >> "$OUT/notebooks.txt"; grep -E "NOTEBOOK|rc=" "$OUT/notebooks.txt"
fi
