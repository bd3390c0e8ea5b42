"""Launch shapes of the Pallas write kernels on this device, as ratios.

Usage (on the H200):  PYTHONPATH=$PWD python benchmarks/tune_writes.py [--quick] [--json out.json]

Every variant first writes a sentinel-filled cache and is compared byte for byte
with the XLA reference (a variant that differs is reported WRONG and not timed),
then timed inside one jitted chain of calls with the cache donated
(``_timing.time_chain``). Reported per case: microseconds per call, the speed-up
over the case's first variant (the default launch shape) and, for the
latency-bound kernels, the ratio to an empty Pallas launch measured in this run.

Cases: compression of 32k prefill tokens (64 requests) over tile sizes and
warps; the tail seed of 32k tokens / 64 requests with and without the
request ends (grid over all rows vs over each request's last kpool rows); the
decode update at B = 256, next_n 1 and 4, over warps.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import ops
from glm5_jax.config import IndexerConfig
from glm5_jax.layout import CacheLayout
from glm5_jax.testing import Scenario
from pallas_kernels.writes.decode_update import decode_update as decode_kernel
from pallas_kernels.writes.pool_compress import compress_prefill as compress_kernel
from pallas_kernels.writes.tail_seed import seed_tail as seed_kernel

sys.path.insert(0, os.path.dirname(__file__))
from _timing import chain_cache_copies, empty_launch_seconds, time_chain  # noqa: E402

SENTINEL = 0xA5
COMPRESS_SHAPES = [(8, 4), (4, 4), (16, 4), (16, 8)]     # (tile_pools, num_warps)
DECODE_WARPS = [1, 2, 4]


def prefill(rng, total_tokens, n_requests):
    cfg = IndexerConfig()
    per = total_tokens // n_requests
    per -= per % cfg.kpool
    layout = CacheLayout(cfg, num_layers=1, num_blocks=n_requests * (-(-per // cfg.block_size) + 1) + 2)
    sc = Scenario.random(rng, layout, [per] * n_requests)
    pre = {k: jnp.asarray(v) for k, v in sc.prefill([per] * n_requests).items()}
    ends = jnp.asarray(np.arange(1, n_requests + 1, dtype=np.int32) * per)
    return layout, sc, pre, ends


def variant(name, case, step, ref_step, layout, args, reps, trials):
    """Check `step` against `ref_step` on a sentinel cache, then time it."""
    got = np.asarray(step(layout.allocate(SENTINEL), *args)).view(np.uint8)
    want = np.asarray(ref_step(layout.allocate(SENTINEL), *args)).view(np.uint8)
    ok = bool((got == want).all() and (want != SENTINEL).any())
    t = time_chain(step, layout.allocate(0), *args, reps=reps, trials=trials)[0] if ok else float("nan")
    copies = chain_cache_copies(step, layout.allocate(0), *args)
    return dict(case=case, variant=name + ("" if ok else " WRONG"), s=t, ok=ok, copies_per_3_calls=copies)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run)")
    ap.add_argument("--json", help="write the rows as JSON here")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    reps, trials = (2, 1) if a.quick else (10, 5)
    interp = None
    empty = empty_launch_seconds()
    rows = []
    for total in ((512,) if a.quick else (32768,)):
        layout, sc, pre, ends = prefill(rng, total, 4 if a.quick else 64)
        s, ape = layout.strides(0), jnp.asarray(sc.ape)
        cargs = (pre["key"], pre["gate"], ape, pre["slot_mapping"])
        ref_c = lambda c, *x: ops.compress_prefill(c, layout, 0, *x, implementation="xla")
        for tp, nw in (COMPRESS_SHAPES[:2] if a.quick else COMPRESS_SHAPES):
            f = lambda c, *x, tp=tp, nw=nw: compress_kernel(c, s, *x, interpret=interp, tile_pools=tp, num_warps=nw)
            rows.append(variant(f"tile_pools={tp} warps={nw}", f"compress {total} tok", f, ref_c, layout,
                                cargs, reps, trials))
        sargs = (pre["key"], pre["gate"], pre["tslot"])
        ref_s = lambda c, *x: ops.seed_tail(c, layout, 0, *x, implementation="xla")
        rows.append(variant("all rows", f"seed {total} tok", lambda c, *x: seed_kernel(c, s, *x), ref_s,
                            layout, sargs, reps, trials))
        rows.append(variant("request_ends_tokens", f"seed {total} tok",
                            lambda c, *x: seed_kernel(c, s, *x, ends), ref_s, layout, sargs, reps, trials))
    for nn in (1, 4):
        b = 4 if a.quick else 256
        cfg = IndexerConfig(num_spec_tokens=nn - 1)
        ctx = 4 * 1152 - 8
        layout = CacheLayout(cfg, num_layers=1, num_blocks=b * 6 + 2)
        sc = Scenario.random(rng, layout, [ctx] * b)
        st = sc.decode([ctx - nn - (i % cfg.kpool) for i in range(b)], [nn] * b, nn)
        s = layout.strides(0)
        dargs = tuple(jnp.asarray(st[k]) for k in ("key", "gate")) + (jnp.asarray(sc.ape),) + tuple(
            jnp.asarray(st[k]) for k in ("slot_mapping", "tslot", "positions"))
        ref_d = lambda c, *x: ops.decode_update(c, layout, 0, *x, implementation="xla")
        for nw in (DECODE_WARPS[:1] if a.quick else DECODE_WARPS):
            f = lambda c, *x, nw=nw: decode_kernel(c, s, *x, num_warps=nw)
            rows.append(variant(f"warps={nw}", f"decode B={b} next_n={nn}", f, ref_d, layout, dargs, reps, trials))

    for r in rows:
        first = next(x for x in rows if x["case"] == r["case"])
        r["vs_first"] = first["s"] / r["s"]
        r["x_empty"] = r["s"] / empty
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}; "
          f"empty Pallas launch {empty * 1e6:.2f} us")
    hdr = f"{'case':<26}{'variant':<26}{'us/call':>10}{'vs first':>10}{'x empty':>9}{'copies':>8}"
    print(hdr + "\n" + "-" * len(hdr))
    for r in rows:
        print(f"{r['case']:<26}{r['variant']:<26}{r['s'] * 1e6:>10.2f}{r['vs_first']:>9.2f}x{r['x_empty']:>9.2f}"
              f"{r['copies_per_3_calls']:>8}")
    print("\nvs first: time of the case's first variant (the default launch shape) / this time; "
          "copies: full cache copies XLA put into a chain of 3 calls (0 = in place).")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(backend=jax.default_backend(), jax=jax.__version__, empty_launch_s=empty, rows=rows),
                      f, indent=1)


if __name__ == "__main__":
    main()
