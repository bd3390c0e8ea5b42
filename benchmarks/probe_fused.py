"""Same-run A/B of the fused logits -> top-k kernel's shapes at prefill (one layer).

Usage (on the H200):  PYTHONPATH=$PWD python benchmarks/probe_fused.py [--context 32768]
                      [--rows 8192] [--variants fp8:1:4,f16:1:4,fp8:2:4]

One request of --context tokens; its last --rows query rows (each sees up to the
whole context) go through ``paged_topk`` once per variant dot:pages:num_warps (the
dot form, ``paged_logits.DOT_FORMS``; page-table columns per selection step; warps).
Every variant's pool ids must equal the first one's before timing (chained calls,
``bench_read.time_read``); reported: time per call and the first variant's time
over it.
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
from glm5_jax.config import IndexerConfig  # noqa: E402
from pallas_kernels.read.paged_topk import paged_topk  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--variants", default="fp8:1:4,f16:1:4,fp8:2:4,f16:2:4,fp8:4:8,f16:4:8")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--trials", type=int, default=3)
    a = ap.parse_args(argv)
    cfg = IndexerConfig()
    layout, cache, table, key, heads = br.read_case(cfg, 1, a.context)
    q8, w = br.queries(key, 1, a.rows, heads)
    pos = a.context - a.rows + jnp.arange(a.rows, dtype=jnp.int32)[None, :]
    ctx_pools = (pos + 1) // cfg.kpool
    s, k = layout.strides(0), cfg.topk_pools
    forms = a.variants.split(",")

    def variant(spec):
        dot, pages, warps = spec.split(":")
        return lambda c, q, w_, t, x: paged_topk(c, s, q, w_, t, x, k, dot=dot, pages=int(pages),
                                                 num_warps=int(warps))
    fns = {f: variant(f) for f in forms}
    first = None
    for f, fn in fns.items():
        ids = np.asarray(jax.block_until_ready(fn(cache, q8, w, table, ctx_pools)))
        first = ids if first is None else first
        same = np.array_equal(np.sort(ids, axis=-1), np.sort(first, axis=-1))
        print(f"check {f:<10} same id sets as {forms[0]}: {same}", flush=True)
        if not same:
            raise SystemExit(f"variant {f} selects other pools than {forms[0]}")
    res = {f: br.time_read(fn, (cache, q8, w, table, ctx_pools), a.reps, a.trials, fixed=1) for f, fn in fns.items()}
    print(f"\nfused paged_topk, 1 request x {a.context // 1024}k tokens, its last {a.rows} rows")
    for f, t in res.items():
        print(f"  {f:<12} {t * 1e3:9.2f} ms/call   {res[forms[0]] / t:5.2f}x {forms[0]}")


if __name__ == "__main__":
    main()
