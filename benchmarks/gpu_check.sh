#!/usr/bin/env bash
# One device call: versions, the whole test suite compiled on the GPU, the write
# benchmark. Writes logs under $OUT (or ./gpu_out) and ends with passed/failed.
#   device tool:  bash benchmarks/gpu_check.sh     (carry .vectors for the conformance tests)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
[ -d .vectors ] && export GLM5_VECTORS=$PWD/.vectors
python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())" | tee "$OUT/versions.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/versions.txt"
python3 -m pytest -q -p no:cacheprovider -x ${PYTEST_ARGS:-tests} 2>&1 | tee "$OUT/pytest.log"
rc_tests=${PIPESTATUS[0]}
rc_bench=0
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 benchmarks/bench_writes.py --json "$OUT/bench_writes.json" 2>&1 | tee "$OUT/bench_writes.txt"
  rc_bench=${PIPESTATUS[0]}
fi
echo "gpu_check: tests rc=$rc_tests bench rc=$rc_bench"
[ "$rc_tests" = 0 ] && [ "$rc_bench" = 0 ] && echo "GPU CHECK: passed" || echo "GPU CHECK: failed"
