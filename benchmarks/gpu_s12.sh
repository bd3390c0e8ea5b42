#!/usr/bin/env bash
# Session 12's device calls, one H200.
#   PART=writes   the write tests compiled (test_write_kernels: the decode update's new register
#                 forwarding against the reference walk, odd batches included; test_gpu's write tests:
#                 in place, 3 / 5 GiB caches, out-of-range slots), then trace_writes.py: every write
#                 kernel's device span from a profiler trace against an empty kernel, a 1 GiB copy
#                 and the XLA reference traced the same way, with variants ($DECODE_VARIANTS:
#                 program:warps, the old "walk" program among them; $COMPRESS_SHAPES: tile x warps)
#   PART=suite    the whole suite compiled (all files but the sharding and notebook ones), the slow
#                 Triton prefill-then-decode parity test included, -n 12 workers; then trace_writes.py
#                 again (a second run of the same numbers; compression shapes 4x2 and 4x8 as variants)
#   PART=rerun    run 3's two failures again, one worker: the trace_writes harness test (it built
#                 its busy kernel in interpret mode, which a GPU trace cannot tell apart) and the
#                 9 GiB Triton cache test (out of memory beside 11 other workers' caches), with the
#                 other large-cache tests
# Logs under $OUT.   device tool: PART=writes bash benchmarks/gpu_s12.sh   (carry .vectors and .whl)
source "$(dirname "$0")/_gpu_env.sh"            # also installs a carried jax-triton wheel
PART=${PART:-writes}
if [ "$PART" = writes ]; then
  timeout "${T_S:-240}" python3 -m pytest -v -p no:cacheprovider -n 8 -rfE tests/test_write_kernels.py \
    tests/test_write_launch_shapes.py \
    tests/test_gpu.py -k "not reads and not read_path and not byte_view and not ordered and not attention" \
    > "$OUT/pytest_writes.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_writes.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_writes.log" | tail -10
  timeout "${TW_S:-300}" python3 benchmarks/trace_writes.py --decode-variants ${DECODE_VARIANTS:-walk:4 forward:1 forward:2} \
    --compress-shapes ${COMPRESS_SHAPES:-8x4 2x4} --json "$OUT/trace_writes.json" > "$OUT/trace_writes.txt" 2>&1
  echo "rc=$?" >> "$OUT/trace_writes.txt"; grep -v "^W\|^I0\|^measured" "$OUT/trace_writes.txt" | tail -50
fi
if [ "$PART" = suite ]; then
  timeout "${T_S:-330}" python3 -m pytest -v -p no:cacheprovider -n "${XDIST:-12}" -rfE tests \
    --ignore=tests/test_sharding.py --ignore=tests/test_notebooks.py > "$OUT/pytest_all.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_all.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_all.log" | tail -15
  timeout "${TW_S:-180}" python3 benchmarks/trace_writes.py --compress-shapes ${COMPRESS_SHAPES:-4x2 4x8} \
    --json "$OUT/trace_writes.json" > "$OUT/trace_writes.txt" 2>&1
  echo "rc=$?" >> "$OUT/trace_writes.txt"; grep -v "^W\|^I0\|^measured" "$OUT/trace_writes.txt" | tail -40
fi
if [ "$PART" = rerun ]; then
  timeout "${T_S:-240}" python3 -m pytest -v -p no:cacheprovider -rfE tests/test_bench_harness.py \
    "tests/test_triton.py::test_triton_large_cache" tests/test_gpu.py::test_large_cache_writes_past_2gib \
    tests/test_gpu.py::test_large_cache_reads_past_2gib > "$OUT/pytest_rerun.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_rerun.log"; grep -E "FAILED|ERROR|PASSED|passed|failed|rc=" "$OUT/pytest_rerun.log" | tail -20
fi
