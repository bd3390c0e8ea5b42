"""Per-kernel device time of filter-mode top-k, for Nsight Compute.

Usage (on the H200; --cache-control none keeps L2 warm as in a serving step):
  ncu --profile-from-start off --cache-control none --clock-control none \
      --metrics gpu__time_duration.sum --csv \
      env PYTHONPATH=$PWD python benchmarks/profile_topk.py [rows n k] > ncu.csv

Every call is compiled and run first; the CUDA profiler is on around one more
call of each, so ncu sees the kernels of exactly those calls, in order: XLA's
masked max of the scores (one read, the bandwidth reference), XLA's run maxima
(the reference of the Pallas ones),
then the whole ``topk_pools`` (its kernels in launch order); with --select-sweep
also at each of ``bench_read.TOPK_SELECT_SWEEP``'s tunings, in that order.
"""
from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
import bench_read as br  # noqa: E402
from profile_kernels import cudart  # noqa: E402
from pallas_kernels.topk import common as tk  # noqa: E402
from pallas_kernels.topk import driver  # noqa: E402


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    sweep = "--select-sweep" in argv                  # also topk_pools at bench_read.TOPK_SELECT_SWEEP
    argv = [a for a in argv if a != "--select-sweep"]
    rows, n, k = (int(a) for a in argv[:3]) if len(argv) >= 3 else (64, 131072, 512)
    x = jax.random.normal(jax.random.PRNGKey(7), (rows, n), jnp.float32)
    lens = jnp.full((rows,), n, jnp.int32)
    t = tk.Tuning()
    calls = [("xla masked max", jax.jit(lambda x, l: jnp.max(br.masked(x, l), axis=1))),
             ("xla run maxima", jax.jit(lambda x, l: tk.run_maxima(x, l, t.buckets_per_k * k))),
             ("topk_pools", jax.jit(lambda x, l: driver.topk_pools(x, l, k, tune=t)))]
    for v in (br.TOPK_SELECT_SWEEP[1:] if sweep else []):
        calls.append((f"topk_pools {v}", jax.jit(lambda x, l, tv=tk.Tuning(**v): driver.topk_pools(x, l, k, tune=tv))))
    for _, f in calls:
        jax.block_until_ready(f(x, lens))
    lib = cudart()
    if lib is not None:
        lib.cudaProfilerStart()
    for _, f in calls:
        jax.block_until_ready(f(x, lens))
    if lib is not None:
        lib.cudaProfilerStop()
    print("profiled, in order:", ", ".join(n_ for n_, _ in calls))


if __name__ == "__main__":
    main()
