"""Benchmark of the read path (token selection): Pallas vs XLA, as ratios.

Usage (on the H200):  PYTHONPATH=$PWD python benchmarks/bench_read.py [--quick] [--json out.json]
  subsets: --skip-decode / --skip-prefill / --skip-topk, --batches 1 64, --contexts 131072,
  --prefills 32768 (the full run compiles ~50 programs; split it if a call has a time limit)

Cases (one indexer layer, 32 padded heads, GLM-5.3-Flash geometry: kpool 4,
top-2048 tokens = 512 pools, 1152-token blocks = 32-row pages):

  * decode, next_n = 1, B in {1, 16, 64} x context {32k, 128k, 1M} tokens;
  * prefill of one request of 32k and of 128k tokens (every prompt row scored);
  * top-k micro-benchmark: f32 [64, 131072], k = 512, Pallas kernel vs lax.top_k.

For each case it times, in the same run, the whole selection
``ops.select_tokens`` with the fused Pallas kernel (logits never written), the
unfused Pallas kernels (paged logits, then top-k) and the XLA reference (XLA
logits + lax.top_k + expansion). Reported: microseconds per call, speed-up over
XLA, and for decode the ratio to the bandwidth floor: ~35 bytes per context
token per layer (132 B per pool read, 4 B logits written and read back;
docs/semantics.md 7.3) at the device-to-device copy bandwidth measured in this run.
Prefill rows report the fp8 dot rate achieved (2 * Hp * 128 FLOP per visible
(row, pool) pair).

Calls are chained inside one jit (``time_read``); each call's inputs (not the
cache) pass through an optimization barrier together with the previous call's
output, so XLA can neither merge the calls nor overlap them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from glm5_jax import metadata as md
from glm5_jax import ops
from glm5_jax.config import IndexerConfig
from glm5_jax.layout import CacheLayout

sys.path.insert(0, os.path.dirname(__file__))
from _timing import copy_bandwidth  # noqa: E402

FLOOR_BYTES_PER_TOKEN = 35          # docs/semantics.md 7.3: decode, per context token per layer
LOGIT_RTOL_GPU = 5e-4               # fp8 tensor-core dots accumulate with ~14 bits (tests/test_read_path.py)


def time_read(f, args, reps=10, trials=5, fixed=0, perturb=None):
    """Median seconds per call of f(*args), `reps` dependent calls chained in one jit.

    The first `fixed` args (the cache) go to every call unchanged. The args at the
    positions in `perturb` (default: every int / float arg after the fixed ones) of
    each later call get a 0 added that XLA cannot prove is 0 (a compare of the
    previous output's first element with an unlikely value), so every call depends
    on the last and none can be merged, hoisted or removed. (XLA deduplicates identical
    calls and deletes calls whose output nobody reads, so without the chain a harness
    would time 1 call and divide by 10; perturbing an argument that f ignores, such as
    k of lax.top_k(x, k), lets the calls merge just the same: tests/test_bench_harness.py.)
    Perturb only small arguments that f reads when a big one feeds a kernel: XLA cannot
    fuse `x + 0` into a Pallas call, so perturbing the [64, 131072] scores of a top-k
    would write them out again on every call (~17 us of each timed call).
    """
    n_fixed = fixed

    def perturbable(x):
        d = jnp.asarray(x).dtype
        return jnp.issubdtype(d, jnp.integer) or d in (jnp.float32, jnp.bfloat16)

    if perturb is None:
        perturb = tuple(i for i in range(fixed, len(args)) if perturbable(args[i]))
    perturb = tuple(perturb)
    if not perturb or any(i < fixed or i >= len(args) or not perturbable(args[i]) for i in perturb):
        raise ValueError(f"time_read needs int or float args after the fixed ones to perturb, got {perturb}")
    hit = [i in perturb for i in range(fixed, len(args))]

    @jax.jit
    def chain(*all_args):
        c, a = all_args[:n_fixed], list(all_args[n_fixed:])
        outs = [f(*c, *a)]
        for _ in range(reps - 1):
            first = jnp.ravel(outs[-1])[0].astype(jnp.float32)
            dep = first == jnp.float32(-12345.678)                               # False in practice
            a = [x + dep.astype(x.dtype) if h else x for x, h in zip(a, hit)]
            outs.append(f(*c, *a))
        return outs

    jax.block_until_ready(chain(*args))                 # compile + warm up
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(chain(*args))
        times.append((time.perf_counter() - t0) / reps)
    return float(np.median(times))


def random_cache(layout: CacheLayout, seed: int):
    """Random words on the device; bit 6 of every byte cleared, so no fp8 byte is NaN
    and every scale word is a finite float."""
    w = jax.random.bits(jax.random.PRNGKey(seed), (layout.total_words,), jnp.uint32)
    return w & jnp.uint32(0xBFBFBFBF)


def read_case(cfg: IndexerConfig, batch: int, ctx_tokens: int, seed: int = 0, heads: int = 32):
    """Layout with `batch` requests of `ctx_tokens` each; consecutive blocks per request."""
    blocks = -(-ctx_tokens // cfg.block_size)
    layout = CacheLayout(cfg, num_layers=1, num_blocks=batch * blocks + 1)
    bt = 1 + np.arange(batch * blocks).reshape(batch, blocks)
    table = jnp.asarray(md.page_table_pages(bt, cfg))
    key = jax.random.PRNGKey(seed + 1)
    return layout, random_cache(layout, seed), table, key, heads


def queries(key, b, n, heads):
    k1, k2 = jax.random.split(key)
    q = jax.random.normal(k1, (b, n, heads, 128), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(k2, (b, n, heads), jnp.float32)
    return jax.jit(lambda q, w: ops.prepare_queries(q, w, implementation="xla"))(q, w)


def selectors(layout, quick, triton: bool = False):
    """name -> f(cache, q8, w, table, positions) for the implementations (the Triton
    tensor-core path with ``triton``)."""
    def sel(impl, path):
        return lambda c, q, w, t, p: ops.select_tokens(c, layout, 0, q, w, t, p, short_context=False,
                                                        implementation=impl, path=path)
    out = {"pallas fused": sel("pallas", "fused"), "pallas unfused": sel("pallas", "unfused"),
           "xla": sel("xla", None)}
    if triton:
        out["triton"] = sel("triton", None)
    return out


def bench_decode(cfg, batch, ctx_tokens, bw, reps, trials, quick):
    layout, cache, table, key, heads = read_case(cfg, batch, ctx_tokens)
    q8, w = queries(key, batch, 1, heads)
    pos = jnp.full((batch, 1), ctx_tokens - 1, jnp.int32)
    floor = FLOOR_BYTES_PER_TOKEN * ctx_tokens * batch / bw
    res = {name: time_read(f, (cache, q8, w, table, pos), reps, trials, fixed=1)
           for name, f in selectors(layout, quick).items()}
    if not quick:                                       # where the unfused time goes
        ctx = jnp.full((batch, 1), ctx_tokens // cfg.kpool, jnp.int32)
        lg = ops.paged_logits(cache, layout, 0, q8, w, table, ctx, implementation="pallas")
        res["  (pallas paged_logits only)"] = time_read(
            lambda c, q, w_, t, x: ops.paged_logits(c, layout, 0, q, w_, t, x, implementation="pallas"),
            (cache, q8, w, table, ctx), reps, trials, fixed=1)
        res["  (pallas topk_pools only)"] = time_read(
            lambda x, l: ops.topk_pools(x, l, cfg.topk_pools, implementation="pallas"),
            (lg.reshape(batch, -1), ctx.reshape(-1)), reps, trials, perturb=(1,))
        del lg
    case = f"B={batch} ctx={ctx_tokens // 1024}k"
    return [dict(kind="decode", case=case, impl=name, s=t, vs_xla=res["xla"] / t, x_floor=t / floor,
                 floor_s=floor) for name, t in res.items()]


def bench_prefill(cfg, ctx_tokens, reps, trials, quick):
    layout, cache, table, key, heads = read_case(cfg, 1, ctx_tokens)
    q8, w = queries(key, 1, ctx_tokens, heads)
    pos = jnp.arange(ctx_tokens, dtype=jnp.int32)[None, :]
    pairs = sum(((np.arange(ctx_tokens) + 1) // cfg.kpool).tolist())   # visible (row, pool) pairs
    flops = 2.0 * 32 * 128 * pairs
    res = {name: time_read(f, (cache, q8, w, table, pos), reps, trials, fixed=1)
           for name, f in selectors(layout, quick).items()}
    case = f"1 x {ctx_tokens // 1024}k" if ctx_tokens >= 1024 else f"1 x {ctx_tokens}"
    return [dict(kind="prefill", case=case, impl=name, s=t, vs_xla=res["xla"] / t, tflops=flops / t / 1e12)
            for name, t in res.items()]


def bench_topk(rows, n, k, reps, trials):
    x = jax.random.normal(jax.random.PRNGKey(7), (rows, n), jnp.float32)
    lengths = jnp.full((rows,), n, jnp.int32)
    fns = {
        "pallas topk_pools": lambda x, l: ops.topk_pools(x, l, k, implementation="pallas"),
        "xla topk_pools (exact keys)": lambda x, l: ops.topk_pools(x, l, k, implementation="xla"),
        "lax.top_k": lambda x, l: lax.top_k(masked(x, l), k)[1],
        "read the scores once (XLA max)": lambda x, l: jnp.max(masked(x, l), axis=1),
        "harness only (lengths + 1)": lambda x, l: l + 1,
    }
    res = {name: time_read(f, (x, lengths), reps, trials, perturb=(1,)) for name, f in fns.items()}
    base, once = res["lax.top_k"], res["read the scores once (XLA max)"]
    return [dict(kind="topk", case=f"[{rows}, {n}] k={k}", impl=name, s=t, vs_lax_top_k=base / t,
                 x_read=t / once) for name, t in res.items()]


def masked(x, lengths):
    """x with the columns >= the row's length at -inf: what lax.top_k must see to honour
    the lengths (and what makes it read the perturbed lengths)."""
    cols = jnp.arange(x.shape[1], dtype=jnp.int32)[None, :]
    return jnp.where(cols < lengths[:, None], x, -jnp.inf)


def bench_topk_parts(rows, n, k, reps, trials):
    """Where filter-mode top-k spends its time: the stages cumulatively (run maxima;
    + floor; + filter; + select, which is the whole topk_pools), each as a fraction
    of the whole."""
    from pallas_kernels.topk import common as tk
    from pallas_kernels.topk import driver
    from pallas_kernels.topk import filter as topk_filter
    from pallas_kernels.topk import maxima as topk_maxima
    t = tk.Tuning()
    x = jax.random.normal(jax.random.PRNGKey(7), (rows, n), jnp.float32)
    lengths = jnp.full((rows,), n, jnp.int32)
    cap = tk.filter_cap(n, k, t)

    def maxima(x, l):
        return topk_maxima.run_maxima(x, l, t.buckets_per_k * k)

    def floor(x, l):
        return driver.key_floor(x, l, k, t.buckets_per_k * k, bits=t.floor_bits,
                                radix_bits=t.radix_bits, num_warps=t.row_warps)

    def lists(x, l):
        return topk_filter.filter_candidates(x, l, *floor(x, l), t.buckets_per_k * k, cap=cap,
                                             num_warps=t.filter_warps)

    fns = {"run maxima": maxima, "+ floor": lambda x, l: floor(x, l)[0],
           "+ filter": lambda x, l: lists(x, l)[1],
           "+ select (all of topk_pools)": lambda x, l: driver.topk_pools(x, l, k, tune=t)}
    res = {name: time_read(f, (x, lengths), reps, trials, perturb=(1,)) for name, f in fns.items()}
    whole = res["+ select (all of topk_pools)"]
    return [dict(kind="topk", case=f"parts [{rows}, {n}] k={k}", impl=name, s=sec, vs_base=sec / whole)
            for name, sec in res.items()]


# (pages_per_step, steps, num_warps, byte_view): paged_logits.Tuning
LOGITS_SWEEP = [(4, 1, 2), (8, 1, 2), (4, 2, 2), (2, 2, 2), (4, 1, 4), (8, 1, 4), (4, 4, 4), (8, 1, 4, False)]
# (score_chunk, target_programs, buckets_per_k, num_warps) of the streaming mode: the
# pre-filter against none and the two program counts; larger chunks and 8 warps are
# slower on the H200
TOPK_SWEEP = [(1024, 264, 0, 4), (1024, 264, 4, 4), (1024, 528, 4, 4), (512, 528, 4, 4)]
# filter mode (topk.Tuning keyword arguments): Pallas floor, one filter pass into a
# per-row candidate list (one atomic reservation per program), a select that ranks
# the candidates pairwise. These bracket the defaults.
TOPK_FILTER_SWEEP = [
    dict(),                          # default: 8 k runs, cap auto, filter 8 warps, select 32 x 64, radix 2
    dict(buckets_per_k=4),
    dict(buckets_per_k=16),
    dict(filter_warps=4),
    dict(radix_bits=4),
    dict(row_warps=4),
    dict(select_stages=2),
    dict(select_stages=3),
    dict(select_ti=32, select_tj=128),
    dict(select_ti=16, select_tj=256),
    dict(select_tj=32, select_warps=8),
]
TOPK_FILTER_QUICK = [dict(), dict(select_ti=16, select_tj=16)]
# the select's tiles and warps (the fallback runs in a launch of its own, so the select
# kernel takes 148 registers, not 255); `--topk-sweep select` runs only these
TOPK_SELECT_SWEEP = [
    dict(),
    dict(select_warps=8),
    dict(select_ti=128, select_tj=32),
    dict(select_ti=128, select_tj=64, select_warps=8),
    dict(select_ti=32, select_tj=64),
    dict(select_ti=32, select_tj=128),
    dict(select_stages=2),
    dict(filter_warps=4),
    dict(row_warps=4),
]


def topk_tuning(v):
    """A TOPK_SWEEP tuple (positional Tuning fields) or a dict of Tuning keywords."""
    from pallas_kernels import topk as tk
    return tk.Tuning(**v) if isinstance(v, dict) else tk.Tuning(*v, mode="stream")


def topk_label(t) -> str:
    if t.mode == "filter":
        return (f"filter bpk={t.buckets_per_k} cap={t.filter_cap or 'auto'} sel={t.select_ti}x{t.select_tj} "
                f"radix={t.radix_bits} floor={t.floor_bits}b warps={t.filter_warps}/{t.row_warps}/{t.select_warps} "
                f"st={t.select_stages}")
    return f"chunk={t.score_chunk} progs={t.target_programs} bpk={t.buckets_per_k} warps={t.num_warps}"


def bench_sweep(cfg, batch, ctx_tokens, topk_case, reps, trials, quick, which=("logits", "topk"),
                topk_variants=None):
    """Launch shapes of the paged-logits and top-k kernels (those in `which`), each
    checked against the XLA reference before it is timed (a wrong variant is
    reported, not timed)."""
    from pallas_kernels.read import paged_logits as plg
    from pallas_kernels import topk as tk
    rows = []
    for v in (() if "logits" not in which else LOGITS_SWEEP[:2] if quick else LOGITS_SWEEP):
        if not rows:                                    # the logits case, built once
            layout, cache, table, key, heads = read_case(cfg, batch, ctx_tokens)
            s = layout.strides(0)
            q8, w = queries(key, batch, 1, heads)
            ctx = jnp.full((batch, 1), ctx_tokens // cfg.kpool, jnp.int32)
            want = np.asarray(ops.paged_logits(cache, layout, 0, q8, w, table, ctx, implementation="xla"))
            fin = np.isfinite(want)
        t = plg.Tuning(*v)
        f = jax.jit(lambda c, q, w_, tb, x, t=t: plg.paged_logits(c, s, q, w_, tb, x, tune=t))
        got = np.asarray(f(cache, q8, w, table, ctx))
        tol = LOGIT_RTOL_GPU if jax.default_backend() == "gpu" else 1e-5
        ok = bool((np.isfinite(got) == fin).all() and np.allclose(got[fin], want[fin], rtol=tol,
                                                                 atol=tol * np.abs(want[fin]).max()))
        sec = time_read(f, (cache, q8, w, table, ctx), reps, trials, fixed=1) if ok else float("nan")
        rows.append(dict(kind="sweep", case=f"logits B={batch} ctx={ctx_tokens // 1024}k",
                         impl=f"G={v[0]} steps={v[1]} warps={v[2]}" + (" words" if v[3:] == (False,) else "")
                         + ("" if ok else " WRONG"), s=sec, ok=ok))
    r_, n_, k_ = topk_case
    x = jax.random.normal(jax.random.PRNGKey(7), (r_, n_), jnp.float32)
    cases = [(f"topk [{r_}, {n_}] k={k_}", x, jnp.full((r_,), n_, jnp.int32), k_)] if "topk" in which else []
    for name, sc, ln, k in cases:
        ref_ids = np.asarray(ops.topk_pools(sc, ln, k, implementation="xla"))
        variants = topk_variants or ((TOPK_SWEEP[:2] + TOPK_FILTER_QUICK) if quick
                                     else (TOPK_SWEEP + TOPK_FILTER_SWEEP))
        for v in variants:
            t = topk_tuning(v)
            f = jax.jit(lambda x_, l_, t=t, k=k: tk.topk_pools(x_, l_, k, tune=t))
            ok = bool((np.asarray(f(sc, ln)) == ref_ids).all())
            # filter mode: an overflowed row runs the streaming path inside the select (timed as such)
            fell_back = t.mode == "filter" and bool(tk.filter_overflowed(sc, ln, k, tune=t))
            sec = time_read(f, (sc, ln), reps, trials, perturb=(1,)) if ok else float("nan")
            rows.append(dict(kind="sweep", case=name, impl=topk_label(t) + (" FALLBACK" if fell_back else "")
                             + ("" if ok else " WRONG"), s=sec, ok=ok, fallback=fell_back))
    for r in rows:                                      # speed-up over the case's first variant
        first = next(x for x in rows if x["case"] == r["case"])
        r["vs_base"] = first["s"] / r["s"]
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
    ap.add_argument("--json", help="write the rows as JSON here")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--skip-topk", action="store_true")
    ap.add_argument("--sweep-only", choices=["logits", "topk"], nargs="+",
                    help="with --sweep: sweep only these kernels' launch shapes")
    ap.add_argument("--batches", type=int, nargs="+", help="decode batch sizes (default 1 16 64)")
    ap.add_argument("--contexts", type=int, nargs="+",
                    help="decode contexts in tokens (default 32768 131072 1048576)")
    ap.add_argument("--prefills", type=int, nargs="+", help="prefill lengths in tokens (default 32768 131072)")
    ap.add_argument("--topk-cols", type=int, default=131072,
                    help="columns of the top-k micro-benchmark and its sweep (rows 64, k = 512)")
    ap.add_argument("--topk-sweep", choices=["all", "select"], default="all",
                    help="with --sweep: every top-k shape, or only TOPK_SELECT_SWEEP (filter mode)")
    ap.add_argument("--sweep", action="store_true",
                    help="also time the launch shapes of the logits and top-k kernels (B=64 x 128k)")
    a = ap.parse_args(argv)
    if a.quick:
        cfg = IndexerConfig(block_size=512, topk=64)          # 64-row pages, 16 pools selected
        decode = [(2, 1024)]
        prefill = [256]
        topk_case = (4, 2048, 64)
        reps, trials = 1, 1
    else:
        cfg = IndexerConfig()
        decode = [(b, c) for c in (a.contexts or (32768, 131072, 1048576)) for b in (a.batches or (1, 16, 64))]
        prefill = list(a.prefills or (32768, 131072))
        topk_case = (64, a.topk_cols, 512)
        reps, trials = 10, 5
    bw = copy_bandwidth(1 << 24 if a.quick else 1 << 30)
    rows = []
    t_reps = reps if a.quick else 50                    # 50 chained calls: the chain's own cost per
    if not a.skip_decode:                               # call (dispatch, sync) shrinks to ~1/50
        for b, c in decode:
            rows += bench_decode(cfg, b, c, bw, t_reps, trials, a.quick)
    if not a.skip_prefill:
        for c in prefill:
            rows += bench_prefill(cfg, c, 1 if not a.quick else reps, min(trials, 3), a.quick)
    if not a.skip_topk:
        rows += bench_topk(*topk_case, t_reps, trials)
        rows += bench_topk_parts(*topk_case, t_reps, trials)
    if a.sweep:
        rows += bench_sweep(cfg, *(decode[0] if a.quick else (64, 131072)), topk_case, reps if a.quick else 50,
                            trials, a.quick,
                            which=a.sweep_only or ("logits", "topk"),
                            topk_variants=TOPK_SELECT_SWEEP if a.topk_sweep == "select" else None)

    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}")
    print(f"copy bandwidth measured now: {bw / 1e12:.3f} TB/s; decode floor = "
          f"{FLOOR_BYTES_PER_TOKEN} B per context token per layer at that bandwidth")
    print(f"geometry: kpool {cfg.kpool}, top-{cfg.topk} tokens ({cfg.topk_pools} pools), "
          f"{cfg.page_rows}-row pages, 32 heads\n")
    hdr = f"{'kind':<8}{'case':<22}{'implementation':<30}{'us/call':>12}{'vs XLA':>9}{'x floor':>9}{'TFLOP/s':>9}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        vs = r.get("vs_xla", r.get("vs_lax_top_k", r.get("vs_base")))
        xf = r.get("x_floor", r.get("x_read"))
        fl = f"{xf:>9.2f}" if xf is not None else f"{'':>9}"
        tf = f"{r['tflops']:>9.2f}" if "tflops" in r else f"{'':>9}"
        print(f"{r['kind']:<8}{r['case']:<22}{r['impl']:<30}{r['s'] * 1e6:>12.1f}{vs:>8.2f}x{fl}{tf}")
    print("\nvs XLA: XLA time / this time (topk rows: lax.top_k time / this time); "
          "x floor: this time / bandwidth-floor time (1.00 = at the floor; topk rows: / the time of "
          "reading the scores once, the XLA max row); sweep rows: time of the "
          "case's first variant (one page per step; no top-k pre-filter) / this time; top-k parts rows: "
          "the stages up to this one as a fraction of the whole top-k (cumulative).")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(backend=jax.default_backend(), device=str(jax.devices()[0].device_kind),
                           jax=jax.__version__, copy_bw_Bps=bw, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
