#!/usr/bin/env bash
# GPU checks and measurements on one H200, offered as named steps that run in one device call.
#   device tool (from the repo root, carry .vectors and .whl):
#     STEPS="tests notebooks writes" bash benchmarks/gpu.sh
# STEPS: the steps to run, in order; the default "tests notebooks writes" is the session check.
# The steps, each with its time-limit variable in seconds and that limit's default:
#   tests         T_S=200   the whole suite compiled (pytest -n $XDIST on tests/ but sharding, notebooks, large cache)
#   writes-tests  TD_S=120  tests/test_write_kernels.py compiled
#   notebooks     N_S=100   the notebooks' code cells (tests/scripts/run_notebook_cells.py)
#   writes        TW_S=120  benchmarks/trace_writes.py: issue 3's table of the write kernels' device times
#   decode-probe  P_S=150   benchmarks/probe_compress.py --decode: the decode update under A/B probes
#   compress-probe CP_S=150 benchmarks/probe_compress.py: the compression kernel under A/B probes
#   large-cache   L_S=90    tests/test_triton.py::test_triton_large_cache alone (3 and 9 GiB Triton caches)
#   ncu           NCU_S=150 Nsight Compute on the write kernels: SASS opcode mix, issue / occupancy / stall metrics
#   pipes         PIPES_S=150  Nsight Compute's per-pipe counts of the compression and decode-update kernels
#   floor         PD_S=80   the decode probe beside empty kernels of its grids and a "no pool arithmetic" stand-in
#   shapes        SHAPES_S=300  benchmarks/trace_writes.py with launch-shape variants, each byte-checked
#   read          TR_S=200 PL_S=100 RP_S=400  trace_read.py, probe_logits.py at 4 rows, bench_read.py prefill
#   step-profile  PS_S=100  benchmarks/profile_step.py: a serving step's device time kernel by kernel
#   olprobe       OL_S=300  benchmarks/probe_ordered_linear.py: launch shapes of the ordered contraction kernels
# Knobs [defaults] and logs under $OUT, per step:
#   tests: XDIST [12] -> pytest_all.log. writes-tests -> pytest_writes.log. large-cache -> pytest_large.log.
#   notebooks: NOTEBOOKS [all] -> notebooks.txt. writes: WRITES_ARGS (more trace_writes.py flags) -> writes.txt.
#   decode-probe: PROBES [exact], BATCHES [256 64 1], NEXT_N [1 2 4], REPEAT [2] -> decode-probe.txt.
#   compress-probe: CPROBES [exact], CTOKENS [32768 131072], CSHAPES [4x2] (tile x warps, ","), REPEAT [2]
#     -> compress-probe.txt.
#   ncu (per case in CASES [compress decode1 decode4]; decode1 / decode4: B = 256, next_n 1 / 4; decode4b1: B = 1,
#     next_n 4; compress: TOKENS [131072] tokens, COMPRESS_SHAPE [dx2] tile x warps, d = the default tile):
#     SAVE_SASS=1 also keeps each whole SASS listing -> ncu_*. pipes (compression 4 x 2 at 128k tokens, decode
#     B = 256, next_n 1) -> pipes_*. floor: FLOOR_PROBES [exact,no pool arithmetic] -> floor.txt.
#   shapes: DECODE_VARIANTS [forward:1 forward:2 forward:8] (program:warps), COMPRESS_SHAPES [2x4 4x2 4x8 8x4 8x8]
#     (tile x warps); " " for none -> shapes.*. read: TRACE_READ_ARGS, PREFILLS [32768 131072] -> read_*.
#   step-profile: PROFILE_WAYS [shipped:], one run per NAME:FLAGS word, flags joined by "," (an A/B:
#     "gathered:--gather-attention shipped:") -> step-profile_*.
#   olprobe: OL_SHAPES (shape names joined by ","), OL_VARIANTS (unroll:tile:warps, ",") -> olprobe.txt.
# Every log ends "rc=N" (124: cut by its limit), and each step prints a short summary. Keep the sum of
# the chosen steps' limits under the device call's 600 s. The last lines: "step NAME: rc=N" per step,
# then "GPU RUN: passed" (every rc 0) or "GPU RUN: failed". The device tool brings back 8 files: past
# 7, every log is packed into $OUT/a_logs.tgz, and only the archive, the pytest logs, writes.txt and
# notebooks.txt stay beside it. Sharding and scale-out: bash benchmarks/gpu_session.sh on nvidia-h200-x2.
ALL_STEPS="tests writes-tests notebooks writes decode-probe compress-probe large-cache ncu pipes floor shapes read"
ALL_STEPS+=" step-profile olprobe"
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
  timed "${T_S:-200}" pytest_all.log python3 -m pytest -v -p no:cacheprovider -n "${XDIST:-12}" -rfE tests \
    --ignore=tests/test_sharding.py --ignore=tests/test_notebooks.py \
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
step_decode_probe() {
  timed "${P_S:-150}" decode-probe.txt python3 benchmarks/probe_compress.py --decode --batches ${BATCHES:-256 64 1} \
    --next-n ${NEXT_N:-1 2 4} --probes "${PROBES:-exact}" --repeat "${REPEAT:-2}"
  local rc=$?; quiet_tail decode-probe.txt 40; return $rc
}
step_compress_probe() {
  timed "${CP_S:-150}" compress-probe.txt python3 benchmarks/probe_compress.py --tokens ${CTOKENS:-32768 131072} \
    --shapes "${CSHAPES:-4x2}" --probes "${CPROBES:-exact}" --repeat "${REPEAT:-2}"
  local rc=$?; quiet_tail compress-probe.txt 30; return $rc
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
  M+=,lts__t_bytes.sum,sm__cycles_elapsed.max,smsp__cycles_active.max
  for CASE in ${CASES:-compress decode1 decode4}; do
    case $CASE in
      compress) ARGS="--profile --tokens ${TOKENS:-131072} --shapes ${COMPRESS_SHAPE:-dx2} --probes exact" ;;
      decode1) ARGS="--decode --profile --batches 256 --next-n 1 --probes exact" ;;
      decode4) ARGS="--decode --profile --batches 256 --next-n 4 --probes exact" ;;
      decode4b1) ARGS="--decode --profile --batches 1 --next-n 4 --probes exact" ;;
      *) echo "ncu: unknown case $CASE (compress decode1 decode4 decode4b1)"; rc=2; continue ;;
    esac
    timed "${NCU_S:-150}" "ncu_$CASE.log" "$NCU" --profile-from-start off --cache-control none \
      --clock-control none --kernel-name regex:kpool --section SourceCounters --metrics "$M" -f -o "/tmp/ncu_$CASE" \
      env PYTHONPATH="$PYTHONPATH" python3 benchmarks/probe_compress.py $ARGS || rc=$?
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
step_pipes() {
  local NCU CASE ARGS rc=0
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  for CASE in compress decode1; do
    case $CASE in
      compress) ARGS="--profile --tokens 131072 --shapes dx2 --probes exact" ;;
      decode1) ARGS="--decode --profile --batches 256 --next-n 1 --probes exact" ;;
    esac
    timed "${PIPES_S:-150}" "pipes_$CASE.log" "$NCU" --profile-from-start off --cache-control none \
      --clock-control none --kernel-name regex:kpool --section ComputeWorkloadAnalysis --section InstructionStats \
      --section SchedulerStats --section WarpStateStats -f -o "/tmp/pipes_$CASE" \
      env PYTHONPATH="$PYTHONPATH" python3 benchmarks/probe_compress.py $ARGS || rc=$?
    grep -E "profiled|rc=|ERR" "$OUT/pipes_$CASE.log" | tail -3
    "$NCU" --import "/tmp/pipes_$CASE.ncu-rep" --page raw --csv > "/tmp/pipes_$CASE.csv" 2>&1
    python3 - "/tmp/pipes_$CASE.csv" > "$OUT/pipes_$CASE.txt" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 5]
hdr, units = rows[0], rows[1]
for r in rows[2:]:
    print("--- " + r[hdr.index("Kernel Name")][:60])
    for i, h in enumerate(hdr):
        if ("pipe" in h or "inst_executed.sum" in h or "issue_active" in h
                or "warps_issue_stalled" in h and "pct" not in h):
            print(f"  {h:<100}{r[i]:>16} {units[i]}")
PY
    grep -E "pipe_(alu|fma|fmaheavy|fmalite|xu|lsu|adu|cbu|uniform)[a-z_]*\.(sum|avg\.pct)" "$OUT/pipes_$CASE.txt" \
      | head -40
  done
  return $rc
}
step_floor() {
  timed "${PD_S:-80}" floor.txt python3 benchmarks/probe_compress.py --decode \
    --probes "${FLOOR_PROBES:-exact,no pool arithmetic}"
  local rc=$?; quiet_tail floor.txt 16; return $rc
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
  # paged_logits at prefill-sized dots (4 rows x 32 heads: the unfused prefill path), fp8 against f16
  timed "${PL_S:-100}" read_logits.txt python3 benchmarks/probe_logits.py --rows 4 --context 32768 \
    --variants 4:1:4:b,4:1:4:b:f16,2:1:4:b:f16 || rc=$?
  quiet_tail read_logits.txt 8
  timed "${RP_S:-400}" read_prefill.txt python3 benchmarks/bench_read.py --skip-decode --skip-topk \
    --prefills ${PREFILLS:-32768 131072} || rc=$?
  quiet_tail read_prefill.txt 16
  return $rc
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
step_olprobe() {
  local args=()             # shape names hold spaces ("rows p.v"), so each flag's value stays one word
  [ -n "${OL_SHAPES:-}" ] && args+=(--shapes "$OL_SHAPES")
  [ -n "${OL_VARIANTS:-}" ] && args+=(--variants "$OL_VARIANTS")
  timed "${OL_S:-300}" olprobe.txt python3 benchmarks/probe_ordered_linear.py "${args[@]}"
  local rc=$?; quiet_tail olprobe.txt 40; return $rc
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
