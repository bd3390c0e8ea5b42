#!/usr/bin/env bash
# Session 15's device calls, one H200.
#   PART=probe   Nsight Compute on the shipped write kernels with each case's whole SASS listing kept
#                (gpu_s14.sh PART=ncu SAVE_SASS=1), then probe_compress.py: the shipped numerics against
#                $PROBES (SAME_BITS candidates are byte-checked against the reference first), compression
#                at 32k / 128k tokens and the decode update at B = 256 / 1, next_n 1 / 4, $REPEAT times
# Logs under $OUT.   device tool: PART=probe bash benchmarks/gpu_s15.sh   (carry .vectors and .whl)
PART=${PART:-probe}
HERE="$(cd "$(dirname "$0")" && pwd)"
if [ "$PART" = probe ]; then
  PART=ncu SAVE_SASS=1 bash "$HERE/gpu_s14.sh"
  source "$HERE/_gpu_env.sh"
  P=${PROBES:-exact,exp d <= 0}
  timeout "${PC_S:-200}" python3 benchmarks/probe_compress.py --probes "$P" --repeat "${REPEAT:-2}" \
    > "$OUT/probe_compress.txt" 2>&1
  echo "rc=$?" >> "$OUT/probe_compress.txt"; grep -v "^W\|^I0" "$OUT/probe_compress.txt" | tail -14
  timeout "${PD_S:-150}" python3 benchmarks/probe_compress.py --decode --probes "$P" --repeat "${REPEAT:-2}" \
    > "$OUT/probe_decode.txt" 2>&1
  echo "rc=$?" >> "$OUT/probe_decode.txt"; grep -v "^W\|^I0" "$OUT/probe_decode.txt" | tail -20
fi
