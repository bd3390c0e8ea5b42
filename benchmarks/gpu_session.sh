#!/usr/bin/env bash
# Everything GPU-side of a session in ONE device call on a 2-GPU host (kind
# nvidia-h200-x2), in three timed phases so the call ends inside its 600 s limit:
#   1. in parallel: the test suite compiled (Pallas + Triton kernels, reference,
#      serving, CLI: every file but the sharding and notebook ones) on GPU 0 with
#      pytest-xdist; the scale-out tests on both GPUs; on GPU 1 the command in
#      $P1_GPU1, by default the write benchmark (Pallas vs Triton vs XLA; its
#      output goes to bench_writes.txt whatever the command);
#   2. alone: the 1-GPU vs 2-GPU serving throughput (bench_scaleout.py);
#   3. in parallel: the read benchmark on GPU 0 (decode B=64 x 128k, top-k, the
#      launch-shape sweep; $READ_ARGS overrides those arguments); on GPU 1 the
#      command in $P3_GPU1, by default the notebooks' code cells
#      (tests/scripts/run_notebook_cells.py: the machine has no Jupyter kernel for
#      tests/test_notebooks.py).
# The suite runs with -v so that a log cut by its time limit still names every
# result (with -q, xdist names failures only in the final summary).
# Logs under $OUT; the last line says GPU SESSION: passed / failed (tests only:
# benchmarks that time out are reported, not failed).
#   device tool: bash benchmarks/gpu_session.sh   (carry .vectors and .whl)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
[ -d .vectors ] && export GLM5_VECTORS=$PWD/.vectors
export PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site
fi
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())" | tee "$OUT/versions.txt"
KERNEL_TESTS=${KERNEL_TESTS:-"tests --ignore=tests/test_sharding.py --ignore=tests/test_notebooks.py"}

# phase 1
( CUDA_VISIBLE_DEVICES=0 timeout "${P1_S:-330}" python3 -m pytest -v -p no:cacheprovider -n "${XDIST:-12}" -rfE --durations=15 \
    $KERNEL_TESTS > "$OUT/pytest_kernels.log" 2>&1; echo "rc=$?" > "$OUT/rc_kernels" ) &
( timeout "${P1_S:-330}" python3 -m pytest -q -p no:cacheprovider -rfE -k "not 4" tests/test_sharding.py \
    > "$OUT/pytest_sharding.log" 2>&1; echo "rc=$?" > "$OUT/rc_sharding" ) &
( CUDA_VISIBLE_DEVICES=1 timeout "${P1_S:-330}" bash -c \
    "${P1_GPU1:-python3 benchmarks/bench_writes.py --impls pallas,triton,xla --json $OUT/bench_writes.json}" \
    > "$OUT/bench_writes.txt" 2>&1 ) &
wait
# phase 2
timeout "${P2_S:-160}" python3 benchmarks/bench_scaleout.py --json "$OUT/bench_scaleout.json" ${SCALEOUT_ARGS:-} \
  > "$OUT/bench_scaleout.txt" 2>&1
echo "bench_scaleout rc=$?" >> "$OUT/bench_scaleout.txt"
# optional second scale-out run in the same call (e.g. SCALEOUT2_ARGS="--contractions pallas")
if [ -n "${SCALEOUT2_ARGS:-}" ]; then
  timeout "${P2_S:-160}" python3 benchmarks/bench_scaleout.py --json "$OUT/bench_scaleout2.json" $SCALEOUT2_ARGS \
    > "$OUT/bench_scaleout2.txt" 2>&1
  echo "bench_scaleout2 rc=$?" >> "$OUT/bench_scaleout2.txt"
fi
# phase 3 (P3_S=0 skips it)
if [ "${P3_S:-100}" != 0 ]; then
( CUDA_VISIBLE_DEVICES=0 timeout "${P3_S:-100}" python3 benchmarks/bench_read.py ${READ_ARGS:---skip-prefill --batches 64 \
    --contexts 131072 --sweep} --json "$OUT/bench_read.json" > "$OUT/bench_read.txt" 2>&1 ) &
( CUDA_VISIBLE_DEVICES=1 timeout "${P3_S:-100}" bash -c "${P3_GPU1:-python3 tests/scripts/run_notebook_cells.py}" \
    > "$OUT/gpu1_phase3.txt" 2>&1; echo "rc=$?" >> "$OUT/gpu1_phase3.txt" ) &
wait
fi

for f in pytest_kernels pytest_sharding; do echo "== $f: $(cat "$OUT/rc_${f#pytest_}")"; grep -E "passed|failed|FAILED|ERROR" "$OUT/$f.log" | tail -12; done
for f in bench_writes bench_scaleout bench_scaleout2 bench_read gpu1_phase3; do [ -f "$OUT/$f.txt" ] && { echo "== $f"; tail -30 "$OUT/$f.txt"; }; done
grep -q "rc=0" "$OUT/rc_kernels" && grep -q "rc=0" "$OUT/rc_sharding" && echo "GPU SESSION: passed" || echo "GPU SESSION: failed"
# the device tool returns at most 8 files: every log also goes into one archive
# whose name sorts first
tar czf "$OUT/a_session_logs.tgz" -C "$OUT" --exclude=a_session_logs.tgz . 2>/dev/null || true
