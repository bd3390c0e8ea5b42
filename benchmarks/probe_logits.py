"""Same-run A/B of paged_logits launch shapes and forms (decode, one layer).

Usage (on the H200):
  PYTHONPATH=$PWD python benchmarks/probe_logits.py [--batch 64] [--context 131072]
      [--rows 1] [--variants 8:1:4:w,4:1:2:b,...] [--profile]

A variant is pages_per_step:steps:num_warps:keys[:dot], keys = b (through the
byte view) or w (as u32 words, unpacked in the kernel), dot = one of
``paged_logits.DOT_FORMS`` (default fp8); see ``paged_logits.Tuning``.
--rows: query rows per request (next_n; 4 rows of 32 heads fill the 128-row dot
of a prefill program). Each variant is timed as a 50-call chain
(``bench_read.time_read``) and reported as the ratio to the decode bandwidth
floor (35 bytes per context token at the copy bandwidth measured in this run)
and to the first variant. Every variant's logits are checked against the first
variant's (finite pattern equal, values within 1e-5 relative) before timing.

--profile: after compiling, one call of each variant runs between
cudaProfilerStart/Stop, for ``ncu --profile-from-start off``.
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import bench_read as br  # noqa: E402
from _timing import copy_bandwidth  # noqa: E402
from profile_kernels import cudart  # noqa: E402
from glm5_jax.config import IndexerConfig  # noqa: E402
from pallas_kernels.read import paged_logits as pk  # noqa: E402

DEFAULT = "8:1:4:w,4:1:2:b,8:1:2:b,4:2:2:b,4:1:4:b,8:1:4:b,4:4:4:b"


def parse(spec: str) -> pk.Tuning:
    g, steps, w, keys, *dot = spec.split(":")
    return pk.Tuning(pages_per_step=int(g), steps=int(steps), num_warps=int(w), byte_view=keys == "b",
                     dot=dot[0] if dot else "fp8")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--variants", default=DEFAULT)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args(argv)
    cfg = IndexerConfig()
    layout, cache, table, key, heads = br.read_case(cfg, a.batch, a.context)
    q8, w = br.queries(key, a.batch, a.rows, heads)
    ctx = jnp.full((a.batch, a.rows), a.context // cfg.kpool, jnp.int32)
    s = layout.strides(0)
    specs = a.variants.split(",")
    fns = {sp: (lambda t: lambda c, q, w_, tb, x: pk.paged_logits(c, s, q, w_, tb, x, tune=t))(parse(sp))
           for sp in specs}
    args = (cache, q8, w, table, ctx)
    first = None
    for sp, f in fns.items():
        out = np.asarray(jax.block_until_ready(f(*args)))
        if first is None:
            first = out
        fin = np.isfinite(first)
        same_inf = bool((np.isfinite(out) == fin).all())
        err = float(np.abs(out[fin] - first[fin]).max() / max(np.abs(first[fin]).max(), 1e-30))
        print(f"check {sp:<22} finite pattern equal: {same_inf}  max rel diff vs first: {err:.2e}", flush=True)
        if not same_inf or err > 1e-5:
            raise SystemExit(f"variant {sp} disagrees with {specs[0]}")
    if a.profile:
        lib = cudart()
        if lib is not None:
            lib.cudaProfilerStart()
        for sp, f in fns.items():
            jax.block_until_ready(f(*args))
        if lib is not None:
            lib.cudaProfilerStop()
        print("profiled one call of each variant, in order:", ", ".join(specs))
        return
    bw = copy_bandwidth(1 << 30)
    floor = br.FLOOR_BYTES_PER_TOKEN * a.context * a.batch / bw
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s; floor {floor * 1e6:.1f} us "
          f"(B={a.batch} x {a.rows} rows, context {a.context} tokens)")
    print(f"{'variant (G:steps:warps:keys)':<30}{'us/call':>10}{'x floor':>9}{'vs first':>10}")
    t0 = None
    for sp, f in fns.items():
        t = br.time_read(f, args, a.reps, a.trials, fixed=1)
        t0 = t0 or t
        print(f"{sp:<30}{t * 1e6:>10.1f}{t / floor:>9.2f}{t0 / t:>9.2f}x", flush=True)


if __name__ == "__main__":
    main()
