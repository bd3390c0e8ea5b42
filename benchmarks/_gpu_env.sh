# Sourced by benchmarks/gpu.sh: the repository root as the
# working directory, $OUT (the device tool's output folder, or gpu_out), the Python
# path and allocator setting every run uses, NVLink multicast off for NCCL (the device
# notes ask for it on the multi-GPU machines), vLLM's vectors when carried (.vectors), the
# jax-triton wheel when carried (.whl), and the jax version, devices and GPUs printed. Source it
# from a script in benchmarks/ only: it cds relative to $0.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0
[ -d .vectors ] && export GLM5_VECTORS=$PWD/.vectors
if ls .whl/*.whl > /dev/null 2>&1; then     # jax-triton 0.3.1 for tests/test_triton.py, when carried
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl > /dev/null 2>&1 && export PYTHONPATH=$PWD:/tmp/site
fi
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
