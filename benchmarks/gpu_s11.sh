#!/usr/bin/env bash
# Session 11's device calls, one H200.
#   PART=suite    the whole suite compiled (all files but the sharding and notebook ones, and the
#                 slow Triton prefill-then-decode parity test), -n 12 workers; then Nsight Compute
#                 of one decode select_tokens (B = 64 x 128k, benchmarks/profile_decode.py); then
#                 bench_read.py: decode B = 64 x 128k and the top-k [64, 131072]
#   PART=prefill  bench_read.py prefill of one 32k and one 128k request: fused, unfused, XLA
#   PART=trace    trace_read.py (device span of one decode select_tokens and of one top-k, from a
#                 profiler trace: no harness kernels), the notebooks' code cells, then PART=prefill
#   PART=read     the read-path tests compiled (test_read_path, test_bench_harness, test_gpu's read
#                 tests), then trace_read.py (device span of one decode select_tokens and one top-k,
#                 no harness kernels), ncu of the decode select_tokens and bench_read decode + top-k
#   PART=dots     the logits dot forms (paged_logits.DOT_FORMS): their tests compiled, probe_logits.py
#                 + ncu at decode B = 64 x 128k ($VARIANTS), probe_fused.py at 32k and 128k prefill rows
#                 (run 3 probed a form "f16-pools" at decode, since removed: 1.45-1.76x slower)
#   PART=fused    the fused kernel's tests compiled, then probe_fused.py's variants ($FUSED_VARIANTS:
#                 dot form, pages per selection step, warps) at 32k and 128k prefill rows
#   PART=final    the read-path tests compiled (test_read_path, test_bench_harness, test_gpu's read
#                 tests) and test_serving, then trace_read.py (with torch.topk where PyTorch is
#                 importable), probe_logits.py at 4 rows (fp8 vs f16 dot), then PART=prefill
#   PART=writes   bench_writes.py --impls pallas,xla (the write kernels, unchanged since session 8)
#   PART=matrix   trace_read.py over the decode matrix B in {1, 16, 64} x {32k, 128k, 1M} tokens,
#                 Pallas and the XLA reference traced the same way (no top-k rows); then Nsight
#                 Compute of one call of each op (profile_kernels.py: the write kernels' device time)
#   PART=decode   the write tests compiled (test_write_kernels, test_gpu's write tests: in place, 3 / 5
#                 GiB caches, out-of-range slots) and bench_writes.py --decode-only --impls pallas,xla
# Logs under $OUT.   device tool: PART=suite bash benchmarks/gpu_s11.sh   (carry .vectors and .whl)
source "$(dirname "$0")/_gpu_env.sh"            # also installs a carried jax-triton wheel
PART=${PART:-suite}
ncu_decode() {
  local m=gpu__time_duration.sum,launch__registers_per_thread,launch__grid_size,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum
  timeout 150 "$(command -v ncu || echo /usr/local/cuda/bin/ncu)" --profile-from-start off --cache-control none \
    --clock-control none --metrics "$m" --csv env PYTHONPATH="$PYTHONPATH" python3 benchmarks/profile_decode.py \
    > "$OUT/ncu_decode.csv" 2> "$OUT/ncu_err.txt"
  python3 benchmarks/_ncu_table.py "$OUT/ncu_decode.csv" | tee "$OUT/ncu_decode.txt"
}
bench_decode_topk() {
  timeout "${B_S:-200}" python3 benchmarks/bench_read.py --skip-prefill --batches 64 --contexts 131072 \
    --topk-cols 131072 > "$OUT/bench_read.txt" 2>&1
  echo "rc=$?" >> "$OUT/bench_read.txt"; grep -v "^W\|^I0" "$OUT/bench_read.txt" | tail -24
}
if [ "$PART" = suite ]; then
  timeout "${T_S:-300}" python3 -m pytest -v -p no:cacheprovider -n "${XDIST:-12}" -rfE tests \
    --ignore=tests/test_sharding.py --ignore=tests/test_notebooks.py \
    --deselect tests/test_triton.py::test_triton_matches_reference_prefill_then_decode > "$OUT/pytest_all.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_all.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_all.log" | tail -15
  ncu_decode; bench_decode_topk
fi
if [ "$PART" = read ]; then
  timeout "${T_S:-200}" python3 -m pytest -v -p no:cacheprovider -n 8 -rfE tests/test_read_path.py \
    tests/test_bench_harness.py tests/test_gpu.py -k "${T_K:-not writes and not compress and not slots and not in_place}" \
    > "$OUT/pytest_read.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_read.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_read.log" | tail -12
  timeout "${TR_S:-150}" python3 benchmarks/trace_read.py > "$OUT/trace_read.txt" 2>&1
  echo "rc=$?" >> "$OUT/trace_read.txt"; grep -v "^W\|^I0" "$OUT/trace_read.txt" | tail -14
  ncu_decode; bench_decode_topk
fi
if [ "$PART" = trace ]; then
  TRACE_READ_LINES=1 timeout "${TR_S:-150}" python3 benchmarks/trace_read.py > "$OUT/trace_read.txt" 2>&1
  echo "rc=$?" >> "$OUT/trace_read.txt"; grep -v "^W\|^I0" "$OUT/trace_read.txt" | tail -16
  timeout "${NB_S:-120}" python3 tests/scripts/run_notebook_cells.py > "$OUT/notebooks.txt" 2>&1
  echo "rc=$?" >> "$OUT/notebooks.txt"; grep -E "NOTEBOOK|Error|rc=|us|ms" "$OUT/notebooks.txt" | tail -20
fi
if [ "$PART" = final ]; then
  timeout "${T_S:-240}" python3 -m pytest -v -p no:cacheprovider -n 8 -rfE tests/test_read_path.py \
    tests/test_bench_harness.py tests/test_serving.py tests/test_gpu.py::test_large_cache_reads_past_2gib \
    tests/test_gpu.py::test_read_path_never_waits_on_the_host tests/test_gpu.py::test_byte_view_adds_no_copy_of_the_cache \
    > "$OUT/pytest_final.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_final.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_final.log" | tail -12
  timeout "${TR_S:-200}" python3 benchmarks/trace_read.py > "$OUT/trace_read.txt" 2>&1
  echo "rc=$?" >> "$OUT/trace_read.txt"; grep -v "^W\|^I0" "$OUT/trace_read.txt" | tail -14
  timeout 100 python3 benchmarks/probe_logits.py --rows 4 --context 32768 --variants 4:1:4:b,4:1:4:b:f16,2:1:4:b:f16 \
    > "$OUT/probe_rows4.txt" 2>&1   # paged_logits at prefill-sized dots (the unfused path), fp8 vs f16
  echo "rc=$?" >> "$OUT/probe_rows4.txt"; grep -v "^W\|^I0" "$OUT/probe_rows4.txt" | tail -8
fi
if [ "$PART" = prefill ] || [ "$PART" = trace ] || [ "$PART" = final ]; then
  timeout "${P_S:-400}" python3 benchmarks/bench_read.py --skip-decode --skip-topk --prefills ${PREFILLS:-32768 131072} \
    > "$OUT/bench_prefill.txt" 2>&1
  echo "rc=$?" >> "$OUT/bench_prefill.txt"; grep -v "^W\|^I0" "$OUT/bench_prefill.txt" | tail -16
fi
if [ "$PART" = dots ]; then
  timeout "${T_S:-150}" python3 -m pytest -v -p no:cacheprovider -n 8 -rfE tests/test_read_path.py \
    -k "f16_dot or paged_logits or fused or select_tokens" > "$OUT/pytest_dots.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_dots.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_dots.log" | tail -8
  VARIANTS=${VARIANTS:-4:1:2:b,4:1:4:b,4:1:4:b:f16} \
    P_S=150 N_S=120 bash benchmarks/gpu_logits_probe.sh
  for c in 32768 131072; do
    timeout "${F_S:-90}" python3 benchmarks/probe_fused.py --context $c --rows 8192 --variants fp8:1:4,f16:1:4 > "$OUT/probe_fused_$c.txt" 2>&1
    echo "rc=$?" >> "$OUT/probe_fused_$c.txt"; grep -v "^W\|^I0" "$OUT/probe_fused_$c.txt" | tail -6
  done
fi
if [ "$PART" = fused ]; then
  timeout "${T_S:-150}" python3 -m pytest -v -p no:cacheprovider -n 8 -rfE tests/test_read_path.py tests/test_gpu.py \
    -k "paged_topk or fused or large_cache_reads" > "$OUT/pytest_fused.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_fused.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_fused.log" | tail -8
  for c in 32768 131072; do
    timeout "${F_S:-200}" python3 benchmarks/probe_fused.py --context $c --rows 8192 \
      --variants "${FUSED_VARIANTS:-fp8:1:4,f16:1:4,fp8:2:4,f16:2:4,fp8:4:8,f16:4:8,fp8:2:8,fp8:4:4}" \
      > "$OUT/probe_fused_$c.txt" 2>&1
    echo "rc=$?" >> "$OUT/probe_fused_$c.txt"; grep -v "^W\|^I0" "$OUT/probe_fused_$c.txt" | tail -12
  done
fi
if [ "$PART" = writes ]; then
  timeout "${W_S:-420}" python3 benchmarks/bench_writes.py --impls pallas,xla --json "$OUT/bench_writes.json" \
    > "$OUT/bench_writes.txt" 2>&1
  echo "rc=$?" >> "$OUT/bench_writes.txt"; grep -v "^W\|^I0" "$OUT/bench_writes.txt" | tail -30
fi
if [ "$PART" = matrix ]; then
  timeout "${M_S:-420}" python3 benchmarks/trace_read.py --batches 1 16 64 --contexts 32768 131072 1048576 --xla \
    --skip-topk > "$OUT/trace_matrix.txt" 2>&1
  echo "rc=$?" >> "$OUT/trace_matrix.txt"; grep -v "^W\|^I0" "$OUT/trace_matrix.txt" | tail -24
  timeout "${N_S:-130}" "$(command -v ncu || echo /usr/local/cuda/bin/ncu)" --profile-from-start off --cache-control none \
    --clock-control none --metrics gpu__time_duration.sum,launch__grid_size,smsp__inst_executed.sum --csv \
    env PYTHONPATH="$PYTHONPATH" python3 benchmarks/profile_kernels.py > "$OUT/ncu_ops.csv" 2> "$OUT/ncu_ops_err.txt"
  python3 benchmarks/_ncu_table.py "$OUT/ncu_ops.csv" | tee "$OUT/ncu_ops.txt"
fi
if [ "$PART" = decode ]; then
  timeout "${T_S:-200}" python3 -m pytest -v -p no:cacheprovider -n 6 -rfE tests/test_write_kernels.py \
    tests/test_gpu.py -k "not reads and not read_path and not byte_view and not ordered and not attention" \
    > "$OUT/pytest_writes.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_writes.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_writes.log" | tail -10
  timeout "${W_S:-120}" python3 benchmarks/bench_writes.py --impls pallas,xla --decode-only > "$OUT/bench_decode.txt" 2>&1
  echo "rc=$?" >> "$OUT/bench_decode.txt"; grep -v "^W\|^I0" "$OUT/bench_decode.txt" | tail -16
fi
