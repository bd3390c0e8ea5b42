#!/usr/bin/env bash
# Session 10's device calls, one H200: top-k mode "tail" (run maxima, floor and filter in
# one launch) against filter mode, and the byte view's no-copy check.
#   PART=tests  the read-path top-k tests compiled + test_gpu.py's byte-view and tail tests
#   PART=bench  bench_read.py: decode B = 64 x 128k and the top-k [64, 131072] with the
#               mode sweep (filter vs tail and tail's shapes)
#   PART=ncu    Nsight Compute per kernel of both modes at [64, 131072] and [64, 32768],
#               the [64, 32768] mode sweep, and paged_logits at 4 vs 2 warps (decode)
# Logs under $OUT.   device tool: PART=tests bash benchmarks/gpu_s10.sh   (carry .vectors)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
[ -d .vectors ] && export GLM5_VECTORS=$PWD/.vectors
PART=${PART:-tests}
if [ "$PART" = tests ]; then
  timeout "${T_S:-300}" python3 -m pytest -v -p no:cacheprovider -n 8 -rfE tests/test_read_path.py \
    tests/test_gpu.py -k "topk or select or tail or floor or filter or maxima or byte_view or lower" \
    > "$OUT/pytest_topk.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_topk.log"; grep -E "passed|failed|FAILED|ERROR|rc=" "$OUT/pytest_topk.log" | tail -12
fi
if [ "$PART" = tests ] || [ "$PART" = bench ]; then
  timeout "${B_S:-280}" python3 benchmarks/bench_read.py --skip-prefill --batches 64 --contexts 131072 \
    --topk-cols 131072 --sweep --sweep-only topk --topk-sweep modes > "$OUT/bench_read.txt" 2>&1
  echo "rc=$?" >> "$OUT/bench_read.txt"; grep -v "^W\|^I0" "$OUT/bench_read.txt" | tail -28
fi
if [ "$PART" = ncu ]; then
  SHAPES="64:131072:512 64:32768:512" bash benchmarks/gpu_ncu_topk.sh
  timeout 200 python3 benchmarks/bench_read.py --skip-prefill --skip-decode --topk-cols 32768 --sweep \
    --sweep-only topk --topk-sweep modes > "$OUT/bench_topk_32768.txt" 2>&1
  echo "rc=$?" >> "$OUT/bench_topk_32768.txt"; grep -E "^(topk|sweep)|rc=" "$OUT/bench_topk_32768.txt"
  VARIANTS=4:1:4:n:b,4:1:2:n:b,8:1:4:n:b P_S=150 N_S=150 bash benchmarks/gpu_logits_probe.sh
fi
