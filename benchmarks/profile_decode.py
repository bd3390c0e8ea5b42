"""Per-kernel device time of one decode select_tokens call, for Nsight Compute.

Usage (on the H200; --cache-control none keeps L2 warm as in a serving step):
  ncu --profile-from-start off --cache-control none --clock-control none \\
      --metrics gpu__time_duration.sum --csv \\
      env PYTHONPATH=$PWD python benchmarks/profile_decode.py [batch context_tokens] > ncu.csv

The call (the default Pallas path, B requests of one query row each, all at the
same context) is compiled and run first; the CUDA profiler is on around one more
call, so ncu sees exactly its kernels in launch order: paged_logits (with the
run maxima), the top-k's floor, filter, select and fallback, the expansion.
"""
from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
import bench_read as br  # noqa: E402
from profile_kernels import cudart  # noqa: E402
from glm5_jax.config import IndexerConfig  # noqa: E402


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    batch, ctx = (int(a) for a in argv[:2]) if len(argv) >= 2 else (64, 131072)
    cfg = IndexerConfig()
    layout, cache, table, key, heads = br.read_case(cfg, batch, ctx)
    q8, w = br.queries(key, batch, 1, heads)
    pos = jnp.full((batch, 1), ctx - 1, jnp.int32)
    f = jax.jit(br.selectors(layout, False)["pallas unfused"])
    jax.block_until_ready(f(cache, q8, w, table, pos))
    lib = cudart()
    if lib is not None:
        lib.cudaProfilerStart()
    jax.block_until_ready(f(cache, q8, w, table, pos))
    if lib is not None:
        lib.cudaProfilerStop()
    print(f"profiled: select_tokens B={batch} x {ctx} tokens, pallas unfused")


if __name__ == "__main__":
    main()
