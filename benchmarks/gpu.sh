#!/usr/bin/env bash
# GPU checks and measurements, offered as named steps that run in one device call.
#   device tool (from the repo root, carry .vectors and .whl):
#     STEPS="tests notebooks writes" bash benchmarks/gpu.sh             (one H200)
#     STEPS="sharding scaleout" bash benchmarks/gpu.sh                  (nvidia-h200-x2)
# STEPS: the steps to run, in order; the default "tests notebooks writes" is the check of a change:
# the suite compiled, the notebooks and the write table.
# The steps, each with its time-limit variable in seconds and that limit's default:
#   tests         T_S=370   the whole suite compiled (pytest -n $XDIST on tests/ but sharding, notebooks, large cache, interpreter)
#   writes-tests  TD_S=120  tests/test_write_kernels.py compiled
#   notebooks     N_S=100   the notebooks' code cells (tests/scripts/run_notebook_cells.py)
#   writes        TW_S=120  benchmarks/trace_writes.py: the write kernels' device times against XLA
#   writes-triton TT_S=200  benchmarks/bench_writes.py: Pallas, Triton and XLA writes, chained (needs .whl)
#   large-cache   L_S=90    tests/test_triton.py::test_triton_large_cache alone (3 and 9 GiB Triton caches)
#   ncu           NCU_S=150 Nsight Compute per case: SASS opcode mix, issue / occupancy / stall metrics
#   shapes        SHAPES_S=300  benchmarks/trace_writes.py with launch-shape variants, each byte-checked
#   read          TR_S=200 RP_S=400  trace_read.py (decode B = 64 x 128k, top-k), bench_read.py prefill
#   read-sweep    RS_S=300  benchmarks/bench_read.py --sweep: launch shapes of paged_logits and the top-k
#   prefill-tc    PT_S=330  benchmarks/bench_prefill.py: prefill on the tensor cores against the matmul rate (.whl)
#   step-profile  PS_S=100  benchmarks/profile_step.py: a serving step's device time kernel by kernel
#   sharding      SH_S=240  tests/test_sharding.py on the machine's GPUs (2 or more; the 4-device cases need 4)
#   scaleout      SO_S=210 DS_S=120  bench_scaleout.py (1 vs N GPUs), then device_step.py (the step program alone)
# Knobs [defaults] and logs under $OUT, per step:
#   tests: XDIST [12 on a GPU of 100,000 MiB or more, 8 below: 12 workers exceed an H100's 80 GB] -> pytest_all.log. writes-tests -> pytest_writes.log. large-cache -> pytest_large.log.
#   notebooks: NOTEBOOKS [all] -> notebooks.txt. writes: WRITES_ARGS (more trace_writes.py flags) -> writes.txt.
#   writes-triton: WRITES_IMPLS [pallas,triton,xla] -> writes-triton.txt.
#   ncu: CASES [compress decode1 decode4]: compress (TOKENS [131072] tokens), decode1 / decode4 (B = 256,
#     next_n 1 / 4), decode4b1 (B = 1, next_n 4), select (decode select_tokens, B = 64 x 128k), topk
#     ([64, 131072], k = 512); the Triton read path (needs .whl): tc-select (decode select_tokens, B = 1 x
#     32k), tc-topk ([64, 131072], k = 512 and 2048), tc-rows (the row top-k of a 32k prefill's first chunk
#     and of its last chunk's worth of rows), tc-logits (the prefill logits kernel with its maxima on the last
#     chunk of a 32k and a 128k prefill); SAVE_SASS=1 also keeps each whole SASS listing -> ncu_*.
#   shapes: DECODE_VARIANTS [forward:1 forward:2 forward:8] (program:warps), COMPRESS_SHAPES [2x4 4x2 4x8 8x4 8x8]
#     (tile x warps); " " for none -> shapes.*. read: TRACE_READ_ARGS, PREFILLS [32768 131072] -> read_*.
#   read-sweep: SWEEP_ONLY [logits topk] -> read-sweep.txt.
#   prefill-tc: TC_PREFILLS [32768 131072 524288] -> prefill-tc.txt, prefill-tc.json.
#   step-profile: PROFILE_WAYS [shipped:], one run per NAME:FLAGS word, flags joined by "," (an A/B:
#     "gathered:--gather-attention shipped:") -> step-profile_*.
#   sharding: SHARDING_K ["not 4"] (pytest -k) -> pytest_sharding.log.
#   scaleout: SCALEOUT_ARGS (more bench_scaleout.py flags) -> scaleout.txt, device-step.txt.
# Every log ends "rc=N" (124: cut by its limit), and each step prints a short summary. Keep the sum of
# the chosen steps' limits under the device call's 600 s. The last lines: "step NAME: rc=N" per step,
# then "GPU RUN: passed" (every rc 0) or "GPU RUN: failed". The device tool brings back 8 files: past
# 7, every log is packed into $OUT/a_logs.tgz, and only the archive, the pytest logs, writes.txt and
# notebooks.txt stay beside it.
ALL_STEPS="tests writes-tests notebooks writes writes-triton large-cache ncu shapes read read-sweep prefill-tc"
ALL_STEPS+=" step-profile sharding scaleout"
STEPS=${STEPS:-tests notebooks writes}

# timed LIMIT LOG CMD...: CMD under `timeout LIMIT`, its output to $OUT/LOG with "rc=N" appended; returns N
timed() {
  local limit=$1 log=$OUT/$2 rc
  shift 2
  timeout "$limit" "$@" > "$log" 2>&1
  rc=$?
  echo "rc=$rc" >> "$log"
  return "$rc"
}
pytest_summary() { grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/$1" | tail -"$2"; }
quiet_tail() { grep -v "^W\|^I0\|^measured" "$OUT/$1" | tail -"$2"; }     # without absl's log lines

# The step functions: step_NAME, "-" in NAME as "_". Each returns its rc (the last non-zero one of its runs).
step_tests() {
  local mem_mib workers=12
  mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  [[ "$mem_mib" =~ ^[0-9]+$ ]] && (( mem_mib < 100000 )) && workers=8
  timed "${T_S:-370}" pytest_all.log python3 -m pytest -v -p no:cacheprovider -n "${XDIST:-$workers}" -rfE tests \
    --ignore=tests/test_sharding.py --ignore=tests/test_notebooks.py --ignore=tests/test_triton_interpret.py \
    --deselect tests/test_triton.py::test_triton_large_cache
  local rc=$?; pytest_summary pytest_all.log 12; return $rc
}
step_writes_tests() {
  timed "${TD_S:-120}" pytest_writes.log python3 -m pytest -v -p no:cacheprovider -n 6 -rfE \
    tests/test_write_kernels.py
  local rc=$?; pytest_summary pytest_writes.log 8; return $rc
}
step_notebooks() {
  timed "${N_S:-100}" notebooks.txt python3 tests/scripts/run_notebook_cells.py ${NOTEBOOKS:-}
  local rc=$?; grep -E "NOTEBOOK|rc=" "$OUT/notebooks.txt"; return $rc
}
step_writes() {
  timed "${TW_S:-120}" writes.txt python3 benchmarks/trace_writes.py ${WRITES_ARGS:-}
  local rc=$?; quiet_tail writes.txt 30; return $rc
}
step_writes_triton() {
  timed "${TT_S:-200}" writes-triton.txt python3 benchmarks/bench_writes.py --impls "${WRITES_IMPLS:-pallas,triton,xla}"
  local rc=$?; quiet_tail writes-triton.txt 30; return $rc
}
step_large_cache() {
  timed "${L_S:-90}" pytest_large.log python3 -m pytest -v -p no:cacheprovider -rfE \
    tests/test_triton.py::test_triton_large_cache
  local rc=$?; grep -E "FAILED|ERROR|PASSED|SKIPPED|passed|failed|rc=" "$OUT/pytest_large.log" | tail -6; return $rc
}
step_ncu() {
  local NCU M CASE ARGS stall rc=0
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  M=gpu__time_duration.sum,launch__registers_per_thread,launch__grid_size,launch__block_size
  M+=,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum
  M+=,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed
  M+=,dram__bytes.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum
  for stall in long_scoreboard short_scoreboard barrier wait math_pipe_throttle mio_throttle drain lg_throttle; do
    M+=,smsp__average_warps_issue_stalled_${stall}_per_issue_active.ratio
  done
  M+=,lts__t_bytes.sum,sm__cycles_elapsed.max,smsp__cycles_active.max,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active
  for CASE in ${CASES:-compress decode1 decode4}; do
    case $CASE in
      compress) ARGS="benchmarks/trace_writes.py --profile compress:${TOKENS:-131072}" ;;
      decode1) ARGS="benchmarks/trace_writes.py --profile decode:256:1" ;;
      decode4) ARGS="benchmarks/trace_writes.py --profile decode:256:4" ;;
      decode4b1) ARGS="benchmarks/trace_writes.py --profile decode:1:4" ;;
      select) ARGS="benchmarks/trace_read.py --profile --skip-topk --batches 64 --contexts 131072" ;;
      topk) ARGS="benchmarks/trace_read.py --profile --skip-decode" ;;
      tc-select) ARGS="benchmarks/trace_read.py --profile --impls triton --skip-topk --batches 1 --contexts 32768" ;;
      tc-topk) ARGS="benchmarks/trace_read.py --profile --impls triton --skip-decode --topk-ks 512 2048" ;;
      tc-rows) ARGS="benchmarks/bench_prefill.py --profile rows --prefills 32768" ;;
      tc-logits) ARGS="benchmarks/bench_prefill.py --profile logits --prefills 32768 131072" ;;
      *) echo "ncu: unknown case $CASE (compress decode1 decode4 decode4b1 select topk tc-select tc-topk tc-rows"\
              "tc-logits)"
         rc=2; continue ;;
    esac
    # the Pallas kernels are named kpool_*, the Triton ones by their function (..._kernel)
    timed "${NCU_S:-150}" "ncu_$CASE.log" "$NCU" --profile-from-start off --cache-control none \
      --clock-control none --kernel-name "regex:kpool|_kernel$" --section SourceCounters --metrics "$M" \
      -f -o "/tmp/ncu_$CASE" \
      env PYTHONPATH="$PYTHONPATH" python3 $ARGS || rc=$?
    grep -E "profiled|rc=|ERR" "$OUT/ncu_$CASE.log" | tail -3
    "$NCU" --import "/tmp/ncu_$CASE.ncu-rep" --page source --print-source sass --csv > "/tmp/sass_$CASE.csv" 2>&1
    python3 benchmarks/_sass_summary.py "/tmp/sass_$CASE.csv" > "$OUT/ncu_sass_$CASE.txt" 2>&1
    head -20 "$OUT/ncu_sass_$CASE.txt"
    if [ -n "${SAVE_SASS:-}" ]; then gzip -c "/tmp/sass_$CASE.csv" > "$OUT/ncu_sass_$CASE.csv.gz"; fi
    "$NCU" --import "/tmp/ncu_$CASE.ncu-rep" --page raw --csv --metrics "$M" > "$OUT/ncu_metrics_$CASE.csv" 2>&1
    python3 - "$OUT/ncu_metrics_$CASE.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
if len(rows) < 3:
    sys.exit("no metric rows: " + open(sys.argv[1]).read()[:400])
hdr, units = rows[0], rows[1]
for r in rows[2:]:
    print("--- " + r[hdr.index("Kernel Name")][:60])
    for i, h in enumerate(hdr):
        if "__" in h:
            print(f"  {h:<95}{r[i]:>14} {units[i]}")
PY
  done
  return $rc
}
step_shapes() {
  timed "${SHAPES_S:-300}" shapes.txt python3 benchmarks/trace_writes.py \
    --decode-variants ${DECODE_VARIANTS:-forward:1 forward:2 forward:8} \
    --compress-shapes ${COMPRESS_SHAPES:-2x4 4x2 4x8 8x4 8x8} --json "$OUT/shapes.json"
  local rc=$?; quiet_tail shapes.txt 45; return $rc
}
step_read() {
  local rc=0
  timed "${TR_S:-200}" read_trace.txt python3 benchmarks/trace_read.py ${TRACE_READ_ARGS:-} || rc=$?
  quiet_tail read_trace.txt 14
  timed "${RP_S:-400}" read_prefill.txt python3 benchmarks/bench_read.py --skip-decode --skip-topk \
    --prefills ${PREFILLS:-32768 131072} || rc=$?
  quiet_tail read_prefill.txt 16
  return $rc
}
step_read_sweep() {
  timed "${RS_S:-300}" read-sweep.txt python3 benchmarks/bench_read.py --skip-prefill --skip-topk --batches 64 \
    --contexts 131072 --sweep --sweep-only ${SWEEP_ONLY:-logits topk}
  local rc=$?; quiet_tail read-sweep.txt 30; return $rc
}
step_prefill_tc() {
  timed "${PT_S:-330}" prefill-tc.txt python3 benchmarks/bench_prefill.py --prefills ${TC_PREFILLS:-32768 131072 524288} \
    --json "$OUT/prefill-tc.json"
  local rc=$?; quiet_tail prefill-tc.txt 22; return $rc
}
step_step_profile() {
  local v name args rc=0
  for v in ${PROFILE_WAYS:-shipped:}; do       # each NAME:FLAGS one word, its flags joined by ","
    name=${v%%:*}; args=${v#*:}
    timed "${PS_S:-100}" "step-profile_$name.txt" python3 benchmarks/profile_step.py ${args//,/ } --top 10 \
      --json "$OUT/step-profile_$name.json" || rc=$?
    grep -E "profile_step|span|all |rc=" "$OUT/step-profile_$name.txt"
  done
  return $rc
}
step_sharding() {
  timed "${SH_S:-240}" pytest_sharding.log python3 -m pytest -v -p no:cacheprovider -rfE \
    -k "${SHARDING_K:-not 4}" tests/test_sharding.py
  local rc=$?; pytest_summary pytest_sharding.log 8; return $rc
}
step_scaleout() {
  local rc=0
  timed "${SO_S:-210}" scaleout.txt python3 benchmarks/bench_scaleout.py --json "$OUT/scaleout.json" \
    ${SCALEOUT_ARGS:-} || rc=$?
  quiet_tail scaleout.txt 16
  timed "${DS_S:-120}" device-step.txt python3 benchmarks/device_step.py || rc=$?
  quiet_tail device-step.txt 8
  return $rc
}

for s in $STEPS; do
  if ! declare -F "step_${s//-/_}" > /dev/null || [[ " $ALL_STEPS " != *" $s "* ]]; then
    echo "gpu.sh: unknown step '$s'; the steps: $ALL_STEPS" >&2
    exit 2
  fi
done
HERE="$(cd "$(dirname "$0")" && pwd)"
source "$HERE/_gpu_env.sh"            # repo root as cwd, $OUT, PYTHONPATH, carried .vectors and .whl
RESULTS=()
FAILED=0
for s in $STEPS; do
  echo "=== step $s"
  "step_${s//-/_}"
  rc=$?
  RESULTS+=("step $s: rc=$rc")
  [ "$rc" = 0 ] || FAILED=1
done

if [ "$(find "$OUT" -type f | wc -l)" -gt 7 ]; then   # the device tool brings back 8 files
  tmp=$(mktemp)
  if tar czf "$tmp" -C "$OUT" .; then
    mv "$tmp" "$OUT/a_logs.tgz" && chmod 644 "$OUT/a_logs.tgz"
    find "$OUT" -type f ! -name a_logs.tgz ! -name "pytest_*.log" ! -name writes.txt ! -name notebooks.txt -delete
    echo "every log packed into $OUT/a_logs.tgz; kept beside it: $(cd "$OUT" && ls | grep -v '^a_logs.tgz$' | xargs)"
  fi
fi
printf '%s\n' "${RESULTS[@]}"
[ "$FAILED" = 0 ] && echo "GPU RUN: passed" || echo "GPU RUN: failed"
