# Sourced by the device-call scripts (benchmarks/gpu_*.sh): the repository root as the
# working directory, $OUT (the device tool's output folder, or gpu_out), the Python
# path and allocator setting every run uses, vLLM's vectors when carried (.vectors), the
# jax-triton wheel when carried (.whl), and the jax version and devices printed. Source it
# from a script in benchmarks/ only: it cds relative to $0 (session 12, run 6).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
[ -d .vectors ] && export GLM5_VECTORS=$PWD/.vectors
if ls .whl/*.whl > /dev/null 2>&1; then     # jax-triton 0.3.1 for tests/test_triton.py, when carried
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl > /dev/null 2>&1 && export PYTHONPATH=$PWD:/tmp/site
fi
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
