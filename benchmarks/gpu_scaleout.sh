#!/usr/bin/env bash
# Scale-out check on one host with 2 GPUs (device kind nvidia-h200-x2), one device call:
#   1. the multi-device tests (tests/test_sharding.py) on the real GPUs: the Engine and the
#      write ops on a 2-device mesh (compiled Pallas kernels) against one-device runs, the
#      compiled step's HLO (no collective, no cache copy), the probe on every shard;
#      the 4-device cases need 4 devices and are left to CI's forced CPU devices;
#   2. benchmarks/bench_scaleout.py: simulate's tokens/s on 1 GPU vs 2 GPUs with the
#      same per-device workload (weak scaling), goal >= 1.8x.
# Logs under $OUT (or ./gpu_out); the last line says SCALEOUT CHECK: passed / failed.
#   device tool:  PYTHONPATH=$PWD bash benchmarks/gpu_scaleout.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0                 # no NVLink multicast (the device notes ask for it off)
python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())" \
  | tee "$OUT/versions.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/versions.txt"

# the test subprocesses share the GPUs with pytest itself: no up-front 75 % grab per process
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${TEST_TIMEOUT_S:-240}" \
  python3 -m pytest -q -p no:cacheprovider -rfE --durations=0 -k "${PYTEST_K:-not 4}" tests/test_sharding.py \
  2>&1 | tee "$OUT/pytest_sharding.log"
rc_tests=${PIPESTATUS[0]}

timeout "${BENCH_TIMEOUT_S:-210}" python3 benchmarks/bench_scaleout.py --json "$OUT/bench_scaleout.json" \
  ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_scaleout.txt"
rc_bench=${PIPESTATUS[0]}

echo "gpu_scaleout: tests rc=$rc_tests bench rc=$rc_bench (124 = timed out)"
[ "$rc_tests" = 0 ] && [ "$rc_bench" = 0 ] && echo "SCALEOUT CHECK: passed" || echo "SCALEOUT CHECK: failed"
