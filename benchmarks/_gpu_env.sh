# Sourced by the device-call scripts (benchmarks/gpu_*.sh): the repository root as the
# working directory, $OUT (the device tool's output folder, or gpu_out), the Python
# path and allocator setting every run uses, and vLLM's vectors when carried (.vectors).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
[ -d .vectors ] && export GLM5_VECTORS=$PWD/.vectors
