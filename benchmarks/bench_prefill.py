"""Prefill token selection on the tensor cores: a table of ratios measured in one run.

  * select_tokens of one request of 32k / 128k / 512k tokens (every prompt row
    scored against every pool before it): the Triton tensor-core path, today's
    Pallas path and the XLA reference, as TFLOP/s and as a fraction of the bf16
    matmul rate XLA reaches in the same run (an 8192^3 jnp.dot, measured before and
    after the prefills: the higher of the two);
  * the Triton path split into its logits and its top-k (the logits alone: the same
    chunks with the top-k left out);
  * the implementations in --chained (default triton) also as 4 dependent calls in
    one jit, per call: one call's wall time includes the host's dispatch of the
    program and the wait for its end, which a jitted serving step pays once for
    all its layers;
  * top-k of [64, 131072] scores, k = 512 and 2048, against reading the scores once;
  * with --mosaic, JAX's Mosaic GPU Hopper matmul example on the same product (f16);
  * with --shapes, the row top-k's shapes (with or without the register form for
    rows of up to 4096 pools; the maxima's floor taken from the maxima in registers,
    or placed by histograms; 1, 2 or 8 warps per row program against the default 4):
    the whole select_tokens per shape, and on the longest chunk of each prefill the
    logits kernel with and without its group maxima and the row top-k alone (ids
    checked equal).
  * with --logits-pages P ..., the prefill logits kernel's page-table columns per
    program: the whole select_tokens per value (ids checked equal) and the logits
    kernel on the first and last chunk, all timed interleaved, three rounds.

With --profile it prints no table: inside the CUDA profiler's window, for Nsight
Compute (gpu.sh's ncu step), each kernel call runs once: with "rows" (case tc-rows)
the row top-k of each prefill's first chunk and of its last chunk's worth of rows,
with "logits" (case tc-logits) the logits kernel with its group maxima on each
prefill's last chunk, as select_tokens runs it.

FLOPs count 2 * 32 heads * 128 * (visible (row, pool) pairs). GPU:
    PYTHONPATH=$PWD python3 benchmarks/bench_prefill.py [--prefills 32768 131072 524288]
CPU smoke run (tiny sizes, no Triton): --quick.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import ops
from glm5_jax import reference as ref
from glm5_jax.config import IndexerConfig
from pallas_kernels.core import addressing as addr
from pallas_kernels.read import workspace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import profile_calls  # noqa: E402
from bench_read import queries, read_case, time_read  # noqa: E402


def wall(f, *args, trials=3):
    """Median seconds of f(*args) (one call per trial, after a compile + warm-up call)."""
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def matmul_rate(n=8192):
    """bf16 [n, n] x [n, n] jnp.dot with f32 accumulation on random data: FLOP/s."""
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32).astype(jnp.bfloat16)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    wall(f, a, b, trials=20)                           # clocks up
    return 2 * n ** 3 / wall(f, a, b, trials=30)


def mosaic_matmul_rates(n=8192):
    """JAX's own Mosaic GPU Hopper matmul (``jax.experimental.pallas.ops.gpu.
    hopper_matmul_mgpu``, f16 operands, f16 out) on [n, n] x [n, n], in the tile shapes
    that fit the shared memory: {shape: FLOP/s}, or {shape: the error's first line}.
    The rate the supported Pallas GPU backend reaches on a plain matmul here."""
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float16)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float16)
    out = {}
    for tm, tn, wg in ((128, 128, hm.MatmulDimension.N), (128, 128, hm.MatmulDimension.M)):
        name = f"{tm}x{tn}, warpgroups along {wg.name}"
        try:
            cfg = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=4, epi_tile_n=64,
                                  epi_tile_m=64, grid_minor_dim=hm.MatmulDimension.N, grid_tile_width=8,
                                  wg_dimension=wg)
            f = jax.jit(lambda x, y, cfg=cfg: hm.matmul(x, y, None, cfg))
            wall(f, a, b, trials=20)
            out[name] = 2 * n ** 3 / wall(f, a, b, trials=30)
        except Exception as e:          # noqa: BLE001 - reported in the table, not raised
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return out


def triton_logits_only(s, q8, table, k):
    """f(cache, q8, w, ctx): the Triton path's chunks with the logits kernel alone
    (a sliver of each chunk's logits kept, so nothing is removed as unused)."""
    from pallas_kernels.triton_lang import prefill_logits as tc
    n_cols = addr.pools_in_pages(s, table.shape[1])
    chunk = workspace.rows_per_chunk(q8.shape[1], n_cols, k)

    def f(cache, q, ww, cx):
        def rows(first, c_):
            return tc.paged_logits(cache, s, q, ww, table, c_, fill=False, tune=tc.PREFILL, first_row=first)[..., :1]
        return ref.map_query_rows(rows, chunk, cx, window_start=True)
    return jax.jit(f)


CHAINED_CALLS = 4


def bench_prefill(cfg, tokens, impls, mm, quick, chained=()):
    layout, cache, table, key, heads = read_case(cfg, 1, tokens)
    s = layout.strides(0)
    q8, w = queries(key, 1, tokens, heads)
    pos = jnp.arange(tokens, dtype=jnp.int32)[None, :]
    pairs = float(np.sum((np.arange(tokens) + 1) // cfg.kpool))
    flops = 2.0 * 32 * 128 * pairs
    big = tokens > 131072
    rows, res = [], {}
    for impl in impls:
        if impl == "xla" and big:
            continue
        sel = functools.partial(lambda c, q, ww, t, p, impl: ops.select_tokens(
            c, layout, 0, q, ww, t, p, short_context=False, implementation=impl), impl=impl)
        res[impl] = wall(jax.jit(sel), cache, q8, w, table, pos, trials=1 if (big or quick) else 3)
        if impl in chained:                                  # the host's per-call dispatch shared by the chain
            res[f"{impl}, {CHAINED_CALLS} calls chained in one jit"] = time_read(
                sel, (cache, q8, w, table, pos), reps=CHAINED_CALLS, trials=1 if (big or quick) else 3, fixed=1,
                perturb=(4,))
    if "triton" in impls:                                     # the same tokens by pool id: no final sort by score
        by_pool = jax.jit(lambda c, q, ww, t, p: ops.select_tokens(c, layout, 0, q, ww, t, p, short_context=False,
                                                                   implementation="triton", order="pool"))
        by_score = jax.jit(lambda c, q, ww, t, p: ops.select_tokens(c, layout, 0, q, ww, t, p, short_context=False,
                                                                    implementation="triton"))
        k_tokens = cfg.topk_pools * cfg.kpool
        want = by_score(cache, q8, w, table, pos)
        want = jnp.concatenate([ref.pool_order(want[:, :k_tokens]), want[:, k_tokens:]], axis=1)
        if not bool(jnp.array_equal(by_pool(cache, q8, w, table, pos), want)):
            raise SystemExit(f"1 x {tokens}: order='pool' is not the score order's tokens by pool id")
        del want
        res["triton, order='pool'"] = wall(by_pool, cache, q8, w, table, pos, trials=1 if (big or quick) else 3)
        lg = triton_logits_only(s, q8, table, cfg.topk_pools)
        res["triton: logits only"] = wall(lg, cache, q8, w, (pos + 1) // cfg.kpool, trials=1 if big else 3)
    for name, t in res.items():
        rows.append(dict(kind="prefill", case=f"1 x {tokens // 1024}k", impl=name, ms=t * 1e3,
                         tflops=flops / t / 1e12, x_matmul=flops / t / mm,
                         vs_xla=res["xla"] / t if "xla" in res and "chained" not in name else None,
                         vs_pallas=res["pallas"] / t if "pallas" in res and "chained" not in name else None))
    return rows


def shapes():
    """The row top-k's shapes timed by --shapes: (label, Tuning)."""
    from pallas_kernels.triton_lang import topk_rows as tct
    T = tct.Tuning
    return (("register form, floor from registers", T()),
            ("no register form, floor from registers (default)", T(reg_pools=0)),
            ("no register form, floor from histograms", T(reg_pools=0, floor_maxima=0)),
            ("no register form, 2 warps", T(reg_pools=0, num_warps=2)),
            ("no register form, 2 warps, 256 per step", T(reg_pools=0, num_warps=2, block=256)),
            ("no register form, 1 warp, 256 per step", T(reg_pools=0, num_warps=1, block=256)),
            ("no register form, 8 warps", T(reg_pools=0, num_warps=8)))


def select_tokens_per_setting(module, name, settings, layout, args):
    """[(label, f)]: select_tokens on the Triton path, compiled once per (label, value)
    of `settings` with ``module.<name>`` set to the value (the attribute is read when
    select_tokens is traced; restored after), so f keeps the value it was compiled
    with; their ids checked equal to the first entry's. args: (cache, q8, w, table,
    positions)."""
    default, first, fns = getattr(module, name), None, []
    try:
        for label, value in settings:
            setattr(module, name, value)
            f = jax.jit(lambda c, q, ww, t, p: ops.select_tokens(c, layout, 0, q, ww, t, p, short_context=False,
                                                                  implementation="triton")).lower(*args).compile()
            got = np.asarray(f(*args))
            if first is not None and not np.array_equal(got, first[1]):
                raise AssertionError(f"select_tokens with {name} = {label} differs from {first[0]}")
            first = (label, got) if first is None else first
            fns.append((label, f))
    finally:
        setattr(module, name, default)
    return fns


def bench_shapes(cfg, tokens, mm):
    """The Triton path per ``shapes()`` entry: the whole select_tokens of a prefill of
    `tokens` with that row top-k shape (ids equal across shapes), and on the longest
    chunk the logits kernel with and without maxima and the row top-k alone (ids
    equal)."""
    from pallas_kernels.triton_lang import prefill_logits as tcl
    from pallas_kernels.triton_lang import topk_rows as tct
    layout, cache, table, key, heads = read_case(cfg, 1, tokens)
    s = layout.strides(0)
    q8, w = queries(key, 1, tokens, heads)
    k = cfg.topk_pools
    out = []
    pos = jnp.arange(tokens, dtype=jnp.int32)[None, :]
    flops = 2.0 * 32 * 128 * float(np.sum((np.arange(tokens) + 1) // cfg.kpool))
    args = (cache, q8, w, table, pos)
    for label, f in select_tokens_per_setting(tct, "DEFAULT", shapes(), layout, args):
        t = wall(f, *args)
        out.append(dict(kind="shapes", case=f"1 x {tokens // 1024}k", impl=f"select_tokens, {label}", ms=t * 1e3,
                        tflops=flops / t / 1e12, x_matmul=flops / t / mm))
    rows, q, ww, ctx = chunk_rows(cfg, layout, table, q8, w, last=True)
    case = f"{tokens // 1024}k, {rows} rows"
    for name, mx in (("logits + maxima", True), ("logits", False)):
        f = jax.jit(lambda c, q_, w_, cx, mx=mx: tcl.paged_logits(c, s, q_, w_, table, cx, fill=False, maxima=mx,
                                                                   tune=tcl.PREFILL))
        out.append(dict(kind="shapes", case=case, impl=name, ms=wall(f, cache, q, ww, ctx, trials=5) * 1e3))
    lg, mx, lens = chunk_scores(layout, cache, table, q, ww, ctx)
    want = None
    for label, tune in shapes():
        f = jax.jit(lambda a, l, m, tune=tune: tct.topk_pools(a, l, k, m, tune=tune))
        got = np.asarray(f(lg, lens, mx))
        if want is not None and not np.array_equal(got, want):
            raise AssertionError(f"top-k {label} differs")
        want = got if want is None else want
        out.append(dict(kind="shapes", case=case, impl=f"top-k, {label}", ms=wall(f, lg, lens, mx, trials=5) * 1e3))
    return out


def bench_logits_pages(cfg, tokens, mm, pages):
    """The prefill logits' page-table columns per program (``prefill_logits.PREFILL.pages``)
    per entry of `pages`: the whole select_tokens of a prefill of `tokens` (ids equal
    across entries) and the logits kernel as select_tokens runs it (with maxima where
    the row top-k takes them), on the first and the last chunk's worth of rows. Entries
    are timed interleaved, three rounds."""
    from pallas_kernels.triton_lang import prefill_logits as tcl
    from pallas_kernels.triton_lang import topk_rows as tct
    layout, cache, table, key, heads = read_case(cfg, 1, tokens)
    s = layout.strides(0)
    q8, w = queries(key, 1, tokens, heads)
    pos = jnp.arange(tokens, dtype=jnp.int32)[None, :]
    flops = 2.0 * 32 * 128 * float(np.sum((np.arange(tokens) + 1) // cfg.kpool))
    tunes = [dataclasses.replace(tcl.PREFILL, pages=p) for p in pages]
    args = (cache, q8, w, table, pos)
    calls = [(f"select_tokens, {label}", f, args, flops) for label, f in select_tokens_per_setting(
        tcl, "PREFILL", [(f"logits pages {t.pages}", t) for t in tunes], layout, args)]
    maxima = tct.needs_maxima(addr.pools_in_pages(s, table.shape[1]), tct.DEFAULT)   # as select_tokens runs it
    what = "logits + maxima" if maxima else "logits"
    for last in (False, True):
        rows, q, ww, ctx = chunk_rows(cfg, layout, table, q8, w, last)
        for tune in tunes:
            f = jax.jit(lambda c, q_, w_, cx, t=tune: tcl.paged_logits(c, s, q_, w_, table, cx, fill=False,
                                                                        maxima=maxima, tune=t))
            calls.append((f"{'last' if last else 'first'} {rows} rows: {what}, pages {tune.pages}", f,
                          (cache, q, ww, ctx), None))
    times = {name: [] for name, _, _, _ in calls}
    for _ in range(3):
        for name, f, call_args, _ in calls:
            times[name].append(wall(f, *call_args))
    out = []
    for name, _, _, fl in calls:
        t = float(np.median(times[name]))
        row = dict(kind="logits-pages", case=f"1 x {tokens // 1024}k", impl=name, ms=t * 1e3)
        if fl is not None:
            row.update(tflops=fl / t / 1e12, x_matmul=fl / t / mm)
        out.append(row)
    return out


def chunk_rows(cfg, layout, table, q8, w, last: bool):
    """A chunk's worth of a prefill's query rows on the Triton path
    (``workspace.rows_per_chunk``): its first chunk, or with `last` as many rows from
    its end (the longest contexts; the path's own last chunk may be shorter). Returns
    (rows, q8 [1, rows, Hp, 128], w [1, rows, Hp], ctx_pools [1, rows] i32)."""
    tokens = q8.shape[1]
    pools = addr.pools_in_pages(layout.strides(0), table.shape[1])
    rows = min(tokens, workspace.rows_per_chunk(tokens, pools, cfg.topk_pools))
    lo = tokens - rows if last else 0
    ctx_pools = ((jnp.arange(lo, lo + rows, dtype=jnp.int32) + 1) // cfg.kpool)[None, :]
    return rows, q8[:, lo:lo + rows], w[:, lo:lo + rows], ctx_pools


def chunk_scores(layout, cache, table, q, w, ctx_pools):
    """The rows' logits [rows, n] f32, group maxima [rows, groups] u32 and lengths
    [rows] i32 pools from the Triton logits kernel, as select_tokens hands them to the
    row top-k."""
    from pallas_kernels.triton_lang import prefill_logits as tcl
    s = layout.strides(0)
    lg, mx = jax.jit(lambda c, q_, w_, cx: tcl.paged_logits(c, s, q_, w_, table, cx, fill=False, maxima=True,
                                                            tune=tcl.PREFILL))(cache, q, w, ctx_pools)
    rows = ctx_pools.shape[1]
    return lg.reshape(rows, -1), mx.reshape(rows, -1), ctx_pools.reshape(-1)


def profile(cfg, prefills, kernel="rows"):
    """--profile: one call each inside the CUDA profiler's window
    (``_timing.profile_calls``; gpu.sh's ncu step). kernel "rows": the row top-k
    (``topk_rows.topk_pools`` with the rows' maxima, its default shape) of the first chunk
    and of the last chunk's worth of rows of each prefill (``chunk_rows``); "logits": the
    logits kernel with its group maxima (``prefill_logits.PREFILL``) on the last chunk."""
    from pallas_kernels.triton_lang import prefill_logits as tcl, topk_rows as tct
    calls = []
    for tokens in prefills:
        layout, cache, table, key, heads = read_case(cfg, 1, tokens)
        q8, w = queries(key, 1, tokens, heads)
        for last in ((True,) if kernel == "logits" else (False, True)):
            rows, q, ww, ctx = chunk_rows(cfg, layout, table, q8, w, last)
            where = f"{tokens // 1024}k {'last' if last else 'first'} {rows} rows"
            if kernel == "logits":
                s = layout.strides(0)
                f = jax.jit(lambda c, q_, w_, cx, s=s, table=table: tcl.paged_logits(
                    c, s, q_, w_, table, cx, fill=False, maxima=True, tune=tcl.PREFILL))
                calls.append((f"logits {where}", lambda f=f, args=(cache, q, ww, ctx): f(*args)))
                continue
            lg, mx, lens = chunk_scores(layout, cache, table, q, ww, ctx)
            f = jax.jit(lambda a, l, m: tct.topk_pools(a, l, cfg.topk_pools, m))
            calls.append((f"row top-k {where}", lambda f=f, args=(lg, lens, mx): f(*args)))
    return profile_calls(calls)


def bench_topk(rows_, n, k, impls, reps, trials):
    x = jax.random.normal(jax.random.PRNGKey(7), (rows_, n), jnp.float32)
    lengths = jnp.full((rows_,), n, jnp.int32)
    fns = {impl: (lambda a, l, impl=impl: ops.topk_pools(a, l, k, implementation=impl))
           for impl in impls if impl != "xla"}
    fns["read the scores once (XLA max)"] = lambda a, l: jnp.max(jnp.where(
        jnp.arange(n)[None, :] < l[:, None], a, -jnp.inf), axis=1)
    res = {name: time_read(f, (x, lengths), reps, trials, perturb=(1,)) for name, f in fns.items()}
    once = res["read the scores once (XLA max)"]
    return [dict(kind="topk", case=f"[{rows_}, {n}] k={k}", impl=name, us=t * 1e6, x_read=t / once)
            for name, t in res.items()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefills", type=int, nargs="+", default=[32768, 131072, 524288])
    ap.add_argument("--impls", default="triton,pallas,xla")
    ap.add_argument("--skip-topk", action="store_true")
    ap.add_argument("--shapes", action="store_true", help="the Triton chunk's logits and top-k shapes")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny sizes, pallas and xla")
    ap.add_argument("--mosaic", action="store_true",
                    help="also JAX's Mosaic GPU Hopper matmul example on the same 8192^3 product (GPU)")
    ap.add_argument("--profile", nargs="?", const="rows", choices=("rows", "logits"),
                    help="no table: the row top-k of each prefill's first chunk and last chunk's worth of rows "
                         "(rows), or the logits kernel on the last chunk (logits), inside the CUDA profiler's "
                         "window, for ncu --profile-from-start off (GPU)")
    ap.add_argument("--logits-pages", type=int, nargs="+", metavar="PAGES",
                    help="the prefill logits' page-table columns per program to compare, powers of two "
                         "from 2 (GPU; e.g. 64 128 256)")
    ap.add_argument("--chained", default="triton",
                    help=f"implementations also timed as {CHAINED_CALLS} dependent calls in one jit (per call), "
                         "as a jitted serving step runs them: the host's dispatch of one call shared; '' for none")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    known = ("triton", "pallas", "xla")
    unknown = [i for i in a.impls.split(",") + a.chained.split(",") if i and i not in known]
    if unknown:
        ap.error(f"--impls / --chained: implementations among {', '.join(known)}, got {unknown}")
    if a.logits_pages and (len(set(a.logits_pages)) != len(a.logits_pages)
                           or any(p < 2 or p & (p - 1) for p in a.logits_pages)):
        ap.error(f"--logits-pages: distinct powers of two from 2, got {a.logits_pages}")
    if a.profile:
        return profile(IndexerConfig(), a.prefills, a.profile)
    impls = a.impls.split(",")
    prefills = a.prefills
    if a.quick:
        impls, prefills = [i for i in impls if i != "triton"], [3000]
    cfg = IndexerConfig()
    print("jax", jax.__version__, jax.devices())
    mm_first = matmul_rate(512 if a.quick else 8192)
    out = []
    for tokens in prefills:
        out += bench_prefill(cfg, tokens, impls, mm_first, a.quick, [c for c in a.chained.split(",") if c])
    # the rate again with the clocks as the prefills left them; ratios against the higher
    mm = max(mm_first, matmul_rate(512 if a.quick else 8192))
    print(f"bf16 matmul (XLA jnp.dot): {mm_first / 1e12:.0f} TFLOP/s first, {mm / 1e12:.0f} the higher")
    if a.mosaic and not a.quick:
        for name, r in mosaic_matmul_rates().items():
            rate = f"{r / 1e12:.0f} TFLOP/s, {r / mm:.2f}x XLA's" if isinstance(r, float) else r
            print(f"f16 matmul (Mosaic GPU hopper_matmul_mgpu, {name}): {rate}")
    for r in out:
        if r.get("x_matmul") is not None:
            r["x_matmul"] = r["tflops"] * 1e12 / mm
    if a.shapes and not a.quick:
        for tokens in prefills:
            out += bench_shapes(cfg, tokens, mm)
    if a.logits_pages and not a.quick:
        for tokens in prefills:
            out += bench_logits_pages(cfg, tokens, mm, a.logits_pages)
    if not a.skip_topk:
        for k in (512, 2048):
            out += bench_topk(4 if a.quick else 64, 8192 if a.quick else 131072, k, impls,
                              2 if a.quick else 10, 2 if a.quick else 5)
    print(f"\n{'case':18s} {'implementation':56s} {'time':>12s} {'TFLOP/s':>8s} {'x matmul':>8s} "
          f"{'vs xla':>7s} {'vs pallas':>9s} {'x read':>7s}")
    for r in out:
        t = f"{r['ms']:.2f} ms" if "ms" in r else f"{r['us']:.1f} us"
        fmt = lambda v, f: (f % v) if v is not None else ""      # noqa: E731
        print(f"{r['case']:18s} {r['impl']:56s} {t:>12s} {fmt(r.get('tflops'), '%.0f'):>8s} "
              f"{fmt(r.get('x_matmul'), '%.3f'):>8s} {fmt(r.get('vs_xla'), '%.1f'):>7s} "
              f"{fmt(r.get('vs_pallas'), '%.2f'):>9s} {fmt(r.get('x_read'), '%.2f'):>7s}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(matmul_flops=mm, rows=out), fh, indent=1)


if __name__ == "__main__":
    main()
