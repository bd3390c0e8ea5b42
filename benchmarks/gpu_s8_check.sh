#!/usr/bin/env bash
# Session 8, run 5: the whole suite compiled on one H200 (as session 7 run 6), then a
# launch-shape sweep of the compression kernel (probe_compress.py, exact numerics).
# Carry .vectors and .whl. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 GLM5_VECTORS=$PWD/.vectors
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
timeout 330 python3 -m pytest -v -p no:cacheprovider -n 12 -rfE tests --ignore=tests/test_sharding.py --ignore=tests/test_notebooks.py --deselect tests/test_triton.py::test_triton_matches_reference_prefill_then_decode > $OUT/pytest_all.log 2>&1; echo "pytest rc=$?" >> $OUT/pytest_all.log
grep -E "FAILED|ERROR|passed|failed|rc=" $OUT/pytest_all.log | tail -15
timeout 220 python3 benchmarks/probe_compress.py --tokens 32768 --probes exact --shapes 2x1,4x1,4x2,8x2,4x4,8x4,8x8,16x4,16x8,32x8 2>&1 | grep -v Warn > $OUT/sweep32k.txt
timeout 120 python3 benchmarks/probe_compress.py --tokens 131072 --probes exact --shapes 4x2,8x2,4x4,8x4,16x8,32x8 2>&1 | grep -v Warn > $OUT/sweep128k.txt
cat $OUT/sweep32k.txt $OUT/sweep128k.txt | grep -E "exact|copy bandwidth"
