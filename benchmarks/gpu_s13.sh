#!/usr/bin/env bash
# Session 13's device calls, one H200.
#   PART=decode    the numerics and write-kernel tests compiled (run 1: the decode update's odd
#                  batches at kpool 16 for the first time on the GPU), then probe_compress.py
#                  --decode: where the decode update's latency goes (device spans against an
#                  empty kernel; $PROBES_DECODE)
#   PART=probes    the decode probes, then the compression probes (no tests)
#   PART=numerics  session 13's numerics (products rounded on their own through numerics.rounded,
#                  in exp_f32, recip_f32, mac_bf16 and their Triton-language port): the numerics,
#                  reference (vLLM vectors), write-kernel, Triton and GPU write tests compiled, then
#                  the same-run A/B against session 12's exact-product numerics (probe_compress.py,
#                  "exact" against "session-12 numerics", decode twice over and compression)
#   PART=suite     the whole suite compiled (the large Triton caches alone after it), trace_writes.py,
#                  the notebooks' cells
#   PART=x2        on nvidia-h200-x2: the sharding tests (both GPUs) and the notebooks' cells (GPU 1)
#   PART=compress  probe_compress.py on the compression at 32k and 128k tokens (device spans
#                  against a 1 GiB copy): the candidate forms with the shipped bits, and the
#                  timing probes that bound what each part of the numerics costs
# Logs under $OUT.   device tool: PART=decode bash benchmarks/gpu_s13.sh   (carry .vectors and .whl)
source "$(dirname "$0")/_gpu_env.sh"            # also installs a carried jax-triton wheel
PART=${PART:-decode}
PROBES_DECODE=${PROBES_DECODE:-"exact,session-12 numerics"}
PROBES_COMPRESS=${PROBES_COMPRESS:-"exact,session-12 numerics"}
if [ "$PART" = decode ]; then
  timeout "${T_S:-240}" python3 -m pytest -v -p no:cacheprovider -n 8 -rfE tests/test_numerics.py \
    tests/test_write_kernels.py > "$OUT/pytest_writes.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_writes.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_writes.log" | tail -10
fi
if [ "$PART" = numerics ]; then
  timeout "${T_S:-300}" python3 -m pytest -v -p no:cacheprovider -n 8 -rfE tests/test_numerics.py \
    tests/test_reference.py tests/test_write_kernels.py tests/test_triton.py \
    --deselect tests/test_triton.py::test_triton_matches_reference_prefill_then_decode \
    tests/test_gpu.py -k "not reads and not read_path and not byte_view and not ordered and not attention" \
    > "$OUT/pytest_numerics.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_numerics.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_numerics.log" | tail -12
  PART=probes REPEAT=2
fi
if [ "$PART" = decode ] || [ "$PART" = probes ]; then
  timeout "${P_S:-300}" python3 benchmarks/probe_compress.py --decode --calls 20 --probes "$PROBES_DECODE" \
    --repeat "${REPEAT:-1}" --batches ${BATCHES:-256 1} > "$OUT/probe_decode.txt" 2>&1
  echo "rc=$?" >> "$OUT/probe_decode.txt"; grep -v "^W\|^I0" "$OUT/probe_decode.txt" | tail -40
fi
if [ "$PART" = compress ] || [ "$PART" = probes ]; then
  timeout "${C_S:-520}" python3 benchmarks/probe_compress.py --tokens ${TOKENS:-32768 131072} --calls 20 --repeat "${REPEAT:-1}" \
    --shapes "${SHAPES:-dx4}" --probes "$PROBES_COMPRESS" > "$OUT/probe_compress.txt" 2>&1
  echo "rc=$?" >> "$OUT/probe_compress.txt"; grep -v "^W\|^I0" "$OUT/probe_compress.txt" | tail -40
fi
if [ "$PART" = suite ]; then    # the whole suite compiled (large caches alone after it), trace_writes, notebooks
  timeout "${T_S:-260}" python3 -m pytest -v -p no:cacheprovider -n "${XDIST:-12}" -rfE tests \
    --ignore=tests/test_sharding.py --ignore=tests/test_notebooks.py \
    --deselect tests/test_triton.py::test_triton_large_cache > "$OUT/pytest_all.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_all.log"; grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_all.log" | tail -12
  timeout "${L_S:-90}" python3 -m pytest -v -p no:cacheprovider -rfE tests/test_triton.py::test_triton_large_cache \
    > "$OUT/pytest_large.log" 2>&1
  echo "rc=$?" >> "$OUT/pytest_large.log"; grep -E "FAILED|ERROR|PASSED|passed|failed|rc=" "$OUT/pytest_large.log" | tail -6
  timeout "${TW_S:-170}" python3 benchmarks/trace_writes.py --json "$OUT/trace_writes.json" > "$OUT/trace_writes.txt" 2>&1
  echo "rc=$?" >> "$OUT/trace_writes.txt"; grep -v "^W\|^I0\|^measured" "$OUT/trace_writes.txt" | tail -30
  timeout "${N_S:-50}" python3 tests/scripts/run_notebook_cells.py > "$OUT/notebooks.txt" 2>&1
  echo "rc=$?" >> "$OUT/notebooks.txt"; tail -8 "$OUT/notebooks.txt"
fi
if [ "$PART" = x2 ]; then       # on nvidia-h200-x2: the sharding tests on both GPUs, the notebooks' cells beside them
  export NCCL_NVLS_ENABLE=0
  ( timeout "${S_S:-200}" python3 -m pytest -v -p no:cacheprovider -rfE -k "not 4" tests/test_sharding.py \
      > "$OUT/pytest_sharding.log" 2>&1; echo "rc=$?" >> "$OUT/pytest_sharding.log" ) &
  ( CUDA_VISIBLE_DEVICES=1 timeout "${N_S:-200}" python3 tests/scripts/run_notebook_cells.py > "$OUT/notebooks.txt" 2>&1; \
      echo "rc=$?" >> "$OUT/notebooks.txt" ) &
  wait
  grep -E "FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_sharding.log" | tail -6; grep -E "NOTEBOOK|rc=" "$OUT/notebooks.txt"
fi
