#!/usr/bin/env bash
# Session 10's device calls, one H200 (runs 1-2 measured a top-k "tail" mode, since dropped).
#   PART=tests  the read-path tests compiled + test_gpu.py's read tests (T_K: -k), then bench
#   PART=bench  bench_read.py: decode B = 64 x 128k and the top-k [64, 131072] (no sweep)
#   PART=sweep  bench_read.py's TOPK_SELECT_SWEEP at [64, 131072] and [64, 32768]
#   PART=ncu    Nsight Compute per kernel of the top-k at [64, 131072] and [64, 32768], the
#               [64, 32768] top-k row, the kernels of one decode select_tokens (B = 64 x 128k),
#               and paged_logits at decode: 4 pages x 4 / x 2 warps, 8 x 4 (LOGIT_VARIANTS)
# Logs under $OUT.   device tool: PART=tests bash benchmarks/gpu_s10.sh   (carry .vectors)
source "$(dirname "$0")/_gpu_env.sh"
PART=${PART:-tests}
if [ "$PART" = tests ]; then
  timeout "${T_S:-300}" python3 -m pytest -v -p no:cacheprovider -n 8 -rfE tests/test_read_path.py \
    tests/test_bench_harness.py tests/test_gpu.py -k "${T_K:-not writes and not compress and not slots and not in_place}" \
    > "$OUT/pytest_topk.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_topk.log"; grep -E "passed|failed|FAILED|ERROR|rc=" "$OUT/pytest_topk.log" | tail -12
fi
if [ "$PART" = tests ] || [ "$PART" = bench ]; then
  timeout "${B_S:-280}" python3 benchmarks/bench_read.py --skip-prefill --batches 64 --contexts 131072 \
    --topk-cols 131072 > "$OUT/bench_read.txt" 2>&1
  echo "rc=$?" >> "$OUT/bench_read.txt"; grep -v "^W\|^I0" "$OUT/bench_read.txt" | tail -28
fi
if [ "$PART" = sweep ]; then  # the select / filter / floor shapes without the select's fallback path:
  M=gpu__time_duration.sum,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active
  for cols in 131072 32768; do   # ncu per kernel of each tuning, then the chained sweep
    timeout 150 "$(command -v ncu || echo /usr/local/cuda/bin/ncu)" --profile-from-start off --cache-control none \
      --clock-control none --metrics "$M" --csv env PYTHONPATH=$PWD python3 benchmarks/profile_topk.py 64 $cols 512 \
      --select-sweep > "$OUT/ncu_sweep_$cols.csv" 2> "$OUT/err.txt"
    python3 benchmarks/_ncu_table.py "$OUT/ncu_sweep_$cols.csv" | grep -v "fusion"
    timeout 200 python3 benchmarks/bench_read.py --skip-prefill --skip-decode --skip-topk --topk-cols $cols --sweep \
      --sweep-only topk --topk-sweep select > "$OUT/sweep_topk_$cols.txt" 2>&1
    echo "rc=$?" >> "$OUT/sweep_topk_$cols.txt"; grep -E "^sweep|rc=" "$OUT/sweep_topk_$cols.txt"
  done
fi
if [ "$PART" = ncu ]; then
  SHAPES="64:131072:512 64:32768:512" bash benchmarks/gpu_ncu_topk.sh
  timeout 200 python3 benchmarks/bench_read.py --skip-prefill --skip-decode --topk-cols 32768 \
    > "$OUT/bench_topk_32768.txt" 2>&1
  echo "rc=$?" >> "$OUT/bench_topk_32768.txt"; grep -E "^(topk|sweep)|rc=" "$OUT/bench_topk_32768.txt"
  M=gpu__time_duration.sum,launch__registers_per_thread,launch__grid_size,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum
  timeout 150 "$(command -v ncu || echo /usr/local/cuda/bin/ncu)" --profile-from-start off --cache-control none \
    --clock-control none --metrics "$M" --csv env PYTHONPATH=$PWD python3 benchmarks/profile_decode.py \
    > "$OUT/ncu_decode.csv" 2> "$OUT/err.txt"
  python3 benchmarks/_ncu_table.py "$OUT/ncu_decode.csv"
  VARIANTS=${LOGIT_VARIANTS:-4:1:4:b,4:1:2:b,8:1:4:b} P_S=150 N_S=150 bash benchmarks/gpu_logits_probe.sh
fi
