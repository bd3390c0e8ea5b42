#!/usr/bin/env bash
# Session 9's device call for the read path (the byte view), one H200:
#   1. the read-path tests compiled, with the 3 and 5 GiB read tests of test_gpu.py;
#   2. probe_logits.py at 4 query rows per request (the 128-row dot of prefill programs);
#   3. bench_read.py: decode B = 64 x 128k (fused, unfused, XLA, the parts), the
#      paged_logits launch-shape sweep, prefill of one 32k request.
# PART=tests|probe|bench runs one part; PART=topk (not in "all") the top-k tests, benchmarks and ncu. Logs under $OUT.
#   device tool: bash benchmarks/gpu_s9.sh   (carry .vectors)
source "$(dirname "$0")/_gpu_env.sh"
PART=${PART:-all}
if [ "$PART" = all ] || [ "$PART" = tests ]; then
  timeout "${T_S:-240}" python3 -m pytest -v -p no:cacheprovider -n 8 -rfE tests/test_read_path.py \
    tests/test_bench_harness.py "tests/test_gpu.py::test_large_cache_reads_past_2gib" > "$OUT/pytest_read.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_read.log"
  grep -E "passed|failed|FAILED|ERROR|rc=" "$OUT/pytest_read.log" | tail -12
fi
if [ "$PART" = all ] || [ "$PART" = probe ]; then
  timeout "${P_S:-120}" python3 benchmarks/probe_logits.py --rows 4 --context 32768 \
    --variants "${VARIANTS:-8:1:4:w,4:1:2:b,4:1:4:b,8:1:4:b,4:1:8:b,8:1:8:b}" > "$OUT/probe_rows4.txt" 2>&1
  echo "rc=$?" >> "$OUT/probe_rows4.txt"; grep -v "^W\|^I0\|^check" "$OUT/probe_rows4.txt"
fi
if [ "$PART" = all ] || [ "$PART" = bench ]; then
  timeout "${B_S:-300}" python3 benchmarks/bench_read.py ${READ_ARGS:---batches 64 --contexts 131072 \
    --prefills 32768 --skip-topk --sweep --sweep-only logits} --json "$OUT/bench_read.json" > "$OUT/bench_read.txt" 2>&1
  echo "rc=$?" >> "$OUT/bench_read.txt"
  grep -v "^W\|^I0" "$OUT/bench_read.txt" | tail -30
fi
if [ "$PART" = topk ]; then   # the top-k: tests, then [64, 131072] and [64, 32768] with their sweeps, ncu at 32768
  timeout "${T_S:-200}" python3 -m pytest -v -p no:cacheprovider -n 8 -rfE tests/test_read_path.py -k "topk or select" \
    > "$OUT/pytest_topk.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_topk.log"; grep -E "passed|failed|FAILED|ERROR|rc=" "$OUT/pytest_topk.log" | tail -6
  for cols in 131072 32768; do
    timeout 200 python3 benchmarks/bench_read.py --skip-prefill --batches 64 --contexts 131072 --topk-cols $cols \
      --sweep --sweep-only topk $( [ $cols = 32768 ] && echo --skip-decode ) > "$OUT/bench_topk_$cols.txt" 2>&1
    echo "rc=$?" >> "$OUT/bench_topk_$cols.txt"; grep -E "^(decode|topk|parts|sweep)|rc=" "$OUT/bench_topk_$cols.txt"
  done
  SHAPES=64:32768:512 bash benchmarks/gpu_ncu_topk.sh
fi
