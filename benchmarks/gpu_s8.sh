#!/usr/bin/env bash
# Session 8's device calls (the compression numerics), one script, two parts.
#   PART=suite (run 5): the whole suite compiled on one H200 (as session 7 run 6), then
#                       a launch-shape sweep of the compression kernel (probe_compress.py);
#   PART=bench (run 6): the numerics tests on the GPU (XLA GPU against the numpy model),
#                       the Triton prefill-then-decode parity tests, then bench_writes.py
#                       with Pallas, Triton and XLA rows.
#   device tool: PART=suite bash benchmarks/gpu_s8.sh   (carry .vectors and .whl). Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 GLM5_VECTORS=$PWD/.vectors
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
if [ "${PART:-suite}" = suite ]; then
  timeout 330 python3 -m pytest -v -p no:cacheprovider -n 12 -rfE tests --ignore=tests/test_sharding.py \
    --ignore=tests/test_notebooks.py --deselect tests/test_triton.py::test_triton_matches_reference_prefill_then_decode \
    > "$OUT/pytest_all.log" 2>&1
  echo "pytest rc=$?" >> "$OUT/pytest_all.log"
  grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_all.log" | tail -15
  timeout 220 python3 benchmarks/probe_compress.py --tokens 32768 --probes exact \
    --shapes 2x1,4x1,4x2,8x2,4x4,8x4,8x8,16x4,16x8,32x8 2>&1 | grep -v Warn > "$OUT/sweep32k.txt"
  timeout 120 python3 benchmarks/probe_compress.py --tokens 131072 --probes exact \
    --shapes 4x2,8x2,4x4,8x4,16x8,32x8 2>&1 | grep -v Warn > "$OUT/sweep128k.txt"
  cat "$OUT/sweep32k.txt" "$OUT/sweep128k.txt" | grep -E "exact|copy bandwidth"
else
  timeout 200 python3 -m pytest -v -p no:cacheprovider -n 8 -rfE tests/test_numerics.py tests/test_reference.py \
    "tests/test_triton.py::test_triton_matches_reference_prefill_then_decode" > "$OUT/pytest_s8.log" 2>&1
  echo "pytest rc=$?" >> "$OUT/pytest_s8.log"
  grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_s8.log" | tail -8
  timeout 330 python3 benchmarks/bench_writes.py --impls pallas,triton,xla --json "$OUT/bench_writes.json" \
    > "$OUT/bench_writes.txt" 2>&1
  echo "bench rc=$?" >> "$OUT/bench_writes.txt"
  grep -v Warn "$OUT/bench_writes.txt"
fi
