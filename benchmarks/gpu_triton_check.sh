#!/usr/bin/env bash
# One device call for the Triton (jax_triton) write kernels: install the carried
# jax_triton wheel, print versions and whether the Triton path can run, run
# tests/test_triton.py compiled on the GPU, then the write benchmark with Pallas,
# Triton and XLA rows. Logs go under $OUT (or ./gpu_out); the last line is
# "TRITON CHECK: passed" or "TRITON CHECK: failed".
#   device tool:  bash benchmarks/gpu_triton_check.sh
#   carry:        .whl   (the jax_triton 0.3.1 wheel, ignored by git)   [.vectors for the vLLM vectors]
#   env:          SKIP_BENCH=1 to run the tests only; PYTEST_ARGS to pick tests
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
[ -d .vectors ] && export GLM5_VECTORS=$PWD/.vectors

rc_install=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  2>&1 | tee "$OUT/install.log" || rc_install=1
[ "${PIPESTATUS[0]}" = 0 ] || rc_install=1
export PYTHONPATH=/tmp/site:$PWD

python3 - <<'EOF' 2>&1 | tee "$OUT/versions.txt"
import sys
import jax, jaxlib
print("jax", jax.__version__, "jaxlib", jaxlib.__version__, jax.devices())
for m in ("triton", "jax_triton"):
    try:
        mod = __import__(m)
        print(m, getattr(mod, "__version__", "?"), mod.__file__)
    except Exception as e:
        print(m, "NOT IMPORTABLE:", type(e).__name__, e)
from pallas_kernels.triton_lang import _call
print("triton path:", _call.unavailable_reason() or "available")
from glm5_jax import ops
print("implementation=None:", {op: ops.default_implementation(op) for op in ops.TRITON_OPS})
sys.exit(0 if _call.available() else 1)       # the check means nothing where Triton cannot run
EOF
rc_avail=${PIPESTATUS[0]}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tee -a "$OUT/versions.txt"

python3 -m pytest -q -p no:cacheprovider -rfE ${PYTEST_ARGS:-tests/test_triton.py} 2>&1 | tee "$OUT/pytest_triton.log"
rc_tests=${PIPESTATUS[0]}

rc_bench=0
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 benchmarks/bench_writes.py --impls pallas,triton,xla --json "$OUT/bench_writes.json" 2>&1 \
    | tee "$OUT/bench_writes.txt"
  rc_bench=${PIPESTATUS[0]}
fi

echo "gpu_triton_check: install rc=$rc_install triton available rc=$rc_avail tests rc=$rc_tests bench rc=$rc_bench"
if [ "$rc_install" = 0 ] && [ "$rc_avail" = 0 ] && [ "$rc_tests" = 0 ] && [ "$rc_bench" = 0 ]; then
  echo "TRITON CHECK: passed"
else
  echo "TRITON CHECK: failed"
fi
