#!/usr/bin/env bash
# The read path on one H200 in one device call: its tests compiled (test_read_path,
# the benchmark harness), the per-kernel device times of filter-mode top-k under
# Nsight Compute (profile_topk.py; L2 kept warm, clocks not locked), then
# bench_read.py (decode B = 64 x 128k, top-k [64, 131072], its stages, the top-k
# launch-shape sweep; $READ_ARGS overrides). TESTS=0 skips the tests; TESTS="..."
# names other test files. Logs under $OUT.
#   device tool: bash benchmarks/gpu_read_check.sh   (carry .vectors)
source "$(dirname "$0")/_gpu_env.sh"
if [ "${TESTS:-}" != 0 ]; then
  timeout "${T_S:-200}" python3 -m pytest -v -p no:cacheprovider -n 8 -rfE \
    ${TESTS:-tests/test_read_path.py tests/test_bench_harness.py} > "$OUT/pytest_read.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_read.log"
  grep -E "passed|failed|FAILED|ERROR|rc=" "$OUT/pytest_read.log" | tail -12
fi
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
timeout 120 "$NCU" --profile-from-start off --cache-control none --clock-control none \
  --metrics gpu__time_duration.sum --csv env PYTHONPATH=$PWD python3 benchmarks/profile_topk.py \
  > "$OUT/ncu_topk.csv" 2> "$OUT/ncu_topk.err"
python3 - "$OUT/ncu_topk.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if rows:
    hdr = rows[0]; ki = hdr.index("Kernel Name"); vi = hdr.index("Metric Value"); ui = hdr.index("Metric Unit")
    for r in rows[1:]:
        print(f"{r[ki][:70]:<72}{r[vi]:>12} {r[ui]}")
else:
    print("ncu wrote no kernel rows (see ncu_topk.err)")
PY
timeout "${B_S:-240}" python3 benchmarks/bench_read.py ${READ_ARGS:---skip-prefill --batches 64 --contexts 131072 \
  --sweep --sweep-only topk} --json "$OUT/bench_read.json" > "$OUT/bench_read.txt" 2>&1
echo "rc=$?" >> "$OUT/bench_read.txt"
cat "$OUT/bench_read.txt"
