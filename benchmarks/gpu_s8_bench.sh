#!/usr/bin/env bash
# Session 8, last device call: the numerics tests on the GPU (XLA GPU against the
# numpy model), the Triton prefill-then-decode parity tests, then bench_writes.py
# with Pallas, Triton and XLA rows. Carry .vectors and .whl. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 GLM5_VECTORS=$PWD/.vectors
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
timeout 200 python3 -m pytest -v -p no:cacheprovider -n 8 -rfE tests/test_numerics.py tests/test_reference.py \
  "tests/test_triton.py::test_triton_matches_reference_prefill_then_decode" > "$OUT/pytest_s8.log" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest_s8.log"
grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_s8.log" | tail -8
timeout 330 python3 benchmarks/bench_writes.py --impls pallas,triton,xla --json "$OUT/bench_writes.json" \
  > "$OUT/bench_writes.txt" 2>&1
echo "bench rc=$?" >> "$OUT/bench_writes.txt"
grep -v Warn "$OUT/bench_writes.txt"
