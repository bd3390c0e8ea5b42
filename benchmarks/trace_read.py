"""Device time of one read-path call, read from a profiler trace: no timing harness inside.

Usage (on the H200):  PYTHONPATH=$PWD python benchmarks/trace_read.py [--calls 20] [--batches 64]
                      [--contexts 131072] [--xla] [--impls pallas triton] [--topk-cols 131072]
                      [--topk-ks 512 2048] [--topk-forms]
                      [--skip-topk] [--skip-decode] [--profile] [--split-shapes]
                      [--expand-rows 32768 131072]

bench_read.py times calls chained in one jit, each made to depend on the last by a
small perturbation of its inputs. Those perturbations are kernels too: its
"harness only" row costs ~7 us per call on the H200, inside every
chained number. Here each call is its own jit execution, queued right behind a
long one-program "busy" kernel (``BUSY_ITERS`` dependent multiply-adds, a few
hundred us), so all of the call's kernels are on the stream before the GPU reaches
them, as in a serving step whose host runs ahead of the device. From the GPU
events of a jax profiler trace (``jax.profiler.ProfileData``), per call:

  span      first kernel's start to last kernel's end: the device time of the call,
            launch gaps between its kernels included
  kernels   the sum of its kernels' durations (what Nsight Compute adds up)
  gaps      span - kernels

Reported: the median over --calls calls, the kernels per call, and ratios measured
in the same run: decode span / the bandwidth floor (35 B per context token at the
copy bandwidth measured now) for every --batches x --contexts case (with --xla also
the XLA reference's select_tokens traced the same way, and its span over ours), top-k span / the span of lax.top_k and / the time
to read the scores once (an XLA max, traced the same way), and, where PyTorch
with CUDA is importable (the H200 image has it), torch.topk on the same scores
timed with CUDA events over 50 back-to-back calls (its launches queued ahead the
same way; no profiler).

--profile traces nothing: one call of each case (the decode select_tokens, then
topk_pools at each --topk-ks) per --impls implementation (here the Pallas kernels
unless named) runs between cudaProfilerStart and cudaProfilerStop after a warm-up
call, for ``ncu --profile-from-start off`` (benchmarks/gpu.sh, step ncu): its
kernels in launch order.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

sys.path.insert(0, os.path.dirname(__file__))
import bench_read as br  # noqa: E402
from _timing import copy_bandwidth, profile_calls  # noqa: E402
from glm5_jax import ops  # noqa: E402
from glm5_jax import reference as ref  # noqa: E402
from glm5_jax.config import IndexerConfig  # noqa: E402

BUSY_NAME = "trace_busy"
BUSY_ITERS = 200_000        # dependent f32 multiply-adds in one thread: ~0.4 ms on the H200
DECODE_SELECTORS = {"pallas": "pallas unfused", "triton": "triton"}   # --impls -> bench_read.selectors' names
DERIVED_LINES = ("XLA Ops", "XLA Modules", "Steps", "Framework Name Scope", "Framework Ops",
                 "Source code", "TensorFlow Ops", "XLA TraceMe", "Launch Stats")


def busy_kernel(iters: int = BUSY_ITERS, interpret: bool = False):
    """A jitted one-program Pallas kernel named BUSY_NAME that runs `iters` dependent
    multiply-adds: it keeps the GPU busy while the host queues the next call."""
    def kern(x_ref, o_ref):
        o_ref[...] = lax.fori_loop(0, iters, lambda i, v: v * 0.999999 + 1e-6, x_ref[...])

    call = pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32), interpret=interpret,
                          name=BUSY_NAME)
    return jax.jit(call)


def device_events(xspace_path: str):
    """[(start_ns, duration_ns, name)] of every kernel / memory event on the GPU
    planes' stream lines (the derived per-op and per-module lines left out)."""
    from jax.profiler import ProfileData
    pd = ProfileData.from_file(xspace_path)
    out, lines_seen = [], []
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            lines_seen.append(f"{plane.name}: {line.name}")
            if line.name in DERIVED_LINES:
                continue
            out += [(float(e.start_ns), float(e.duration_ns), e.name) for e in line.events]
    if not out:
        raise RuntimeError(f"no GPU events in the trace (lines: {lines_seen or 'none'})")
    if os.environ.get("TRACE_READ_LINES"):
        print("trace lines:", "; ".join(lines_seen))
    return sorted(out)


def group_calls(events, busy_name: str = BUSY_NAME):
    """Events sorted by start -> one dict per call: the events after a busy kernel and
    before the next one. Keys: span_ns, kernels_ns, n, names. Events before the first
    busy kernel (warm-up, the busy kernel's own input) are dropped."""
    calls, cur = [], None
    for start, dur, name in events:
        if busy_name in name:
            if cur:
                calls.append(cur)
            cur = []
        elif cur is not None:
            cur.append((start, dur, name))
    if cur:
        calls.append(cur)
    res = []
    for c in calls:
        t0, t1 = min(s for s, _, _ in c), max(s + d for s, d, _ in c)
        res.append(dict(span_ns=t1 - t0, kernels_ns=sum(d for _, d, _ in c), n=len(c),
                        names=[nm for _, _, nm in c], durs_ns=[d for _, d, _ in c]))
    return res


def summarize(calls):
    """Medians over the calls: span, kernels and gaps (us), the kernel count, and each
    kernel's duration (us, in launch order, over the calls that ran the most common
    sequence of kernels)."""
    if not calls:
        raise RuntimeError("the trace holds no call after a busy kernel")
    names = [tuple(c["names"]) for c in calls]
    order = max(set(names), key=names.count)
    same = [c["durs_ns"] for c in calls if tuple(c["names"]) == order]
    span = float(np.median([c["span_ns"] for c in calls])) / 1e3
    kern = float(np.median([c["kernels_ns"] for c in calls])) / 1e3
    return dict(span_us=span, kernels_us=kern, gaps_us=span - kern, n=len(order), calls=len(calls),
                order=list(order), per_kernel_us=list(np.median(np.asarray(same), axis=0) / 1e3))


def trace_calls(f, args, calls: int, busy, busy_arg):
    """Trace `calls` executions of jitted f(*args), each queued behind the busy kernel
    and waited for; return group_calls' dicts."""
    return trace_many({"f": (f, args)}, calls, busy, busy_arg)["f"]


def trace_many(fns, calls: int, busy, busy_arg):
    """trace_calls for every name -> (jitted f, args) of `fns` in one profiler session
    (starting and reading a trace takes seconds): `calls` executions of each, in order;
    returns name -> group_calls' dicts (of one function: every call the trace holds;
    of several: `calls` each, their count checked)."""
    for f, args in fns.values():
        jax.block_until_ready(f(*args))                              # compile + warm up
    jax.block_until_ready(busy(busy_arg))
    d = tempfile.mkdtemp(prefix="trace_read_")
    with jax.profiler.trace(d):
        for f, args in fns.values():
            for _ in range(calls):
                busy(busy_arg)
                jax.block_until_ready(f(*args))
    paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise RuntimeError(f"jax.profiler wrote no xplane.pb under {d}")
    grouped = group_calls(device_events(paths[0]))
    if len(fns) == 1:
        return {name: grouped for name in fns}
    if len(grouped) != calls * len(fns):
        raise RuntimeError(f"the trace holds {len(grouped)} calls, not {calls} x {len(fns)}")
    return {name: grouped[i * calls:(i + 1) * calls] for i, name in enumerate(fns)}


def torch_topk_us(x, k: int, calls: int = 50, trials: int = 5):
    """Median us per call of torch.topk(x, k, dim=1) (sorted, as our ids are) over
    `calls` back-to-back calls between two CUDA events; None without torch + CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    xt = torch.from_numpy(np.array(x)).cuda()                  # a writable copy
    for _ in range(3):
        torch.topk(xt, k, dim=1)
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(calls):
            torch.topk(xt, k, dim=1)
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / calls)
    return float(np.median(times))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--batches", type=int, nargs="+", default=[64], help="decode requests")
    ap.add_argument("--contexts", type=int, nargs="+", default=[131072], help="decode context tokens")
    ap.add_argument("--xla", action="store_true", help="also trace the XLA reference's decode select_tokens")
    ap.add_argument("--impls", nargs="+", choices=sorted(DECODE_SELECTORS),
                    help="decode select_tokens and topk_pools implementations to trace (ratios against the "
                         "first; default pallas triton, with --profile pallas)")
    ap.add_argument("--topk-rows", type=int, default=64)
    ap.add_argument("--topk-cols", type=int, default=131072)
    ap.add_argument("--topk-ks", type=int, nargs="+", help="top-k sizes (default: the config's topk_pools)")
    ap.add_argument("--topk-forms", action="store_true",
                    help="trace nothing else: the top-k's forms (sampled, one program per row, Pallas) per "
                         "--topk-form-rows x --topk-form-cols x --topk-ks")
    ap.add_argument("--topk-form-rows", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    ap.add_argument("--topk-form-cols", type=int, nargs="+", default=[8192, 32768, 131072, 262144])
    ap.add_argument("--skip-topk", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="no trace: one call of each case inside the CUDA profiler's window, for ncu "
                         "--profile-from-start off")
    ap.add_argument("--expand-rows", type=int, nargs="+", metavar="ROWS",
                    help="trace nothing else: the expansion kernel on [ROWS, topk_pools] pool ids against a copy "
                         "of the bytes it moves (e.g. 32768 131072, the rows of a 32k and a 128k prefill)")
    ap.add_argument("--split-shapes", action="store_true",
                    help="no table: the split top-k's launches (decode, implementation='triton') under their "
                         "tuning variants, per kernel, for every --batches x --contexts case")
    a = ap.parse_args(argv)
    a.impls = a.impls or (["pallas"] if a.profile else ["pallas", "triton"])
    cfg = IndexerConfig()
    if a.profile:
        return profile(cfg, a)
    if a.split_shapes:
        return split_shapes(cfg, a)
    if a.topk_forms:
        return topk_forms(cfg, a)
    if a.expand_rows:
        return expansion(cfg, a)
    bw = copy_bandwidth()
    busy, busy_arg = busy_kernel(), jnp.ones((16,), jnp.float32)
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}")
    print(f"copy bandwidth measured now: {bw / 1e12:.3f} TB/s; {a.calls} calls per row, each behind a busy kernel")
    rows = []

    for batch in ([] if a.skip_decode else a.batches):
        for ctx_tokens in a.contexts:
            layout, cache, table, key, heads = br.read_case(cfg, batch, ctx_tokens)
            q8, w = br.queries(key, batch, 1, heads)
            pos = jnp.full((batch, 1), ctx_tokens - 1, jnp.int32)
            floor_us = br.FLOOR_BYTES_PER_TOKEN * ctx_tokens * batch / bw * 1e6
            sels = br.selectors(layout, False, triton="triton" in a.impls)
            case = f"decode B={batch} ctx={ctx_tokens // 1024}k"
            x_s = None
            if a.xla:
                x_s = summarize(trace_calls(jax.jit(sels["xla"]), (cache, q8, w, table, pos), a.calls, busy,
                                            busy_arg))
                rows.append((case, "select_tokens (XLA reference)", x_s, f"{x_s['span_us'] / floor_us:.2f}x floor"))
            base = None
            for impl in a.impls:
                s = summarize(trace_calls(jax.jit(sels[DECODE_SELECTORS[impl]]), (cache, q8, w, table, pos),
                                          a.calls, busy, busy_arg))
                ratio = f"{s['span_us'] / floor_us:.2f}x floor ({floor_us:.1f} us)"
                if x_s is not None:
                    ratio += f", {x_s['span_us'] / s['span_us']:.2f}x XLA"
                if base is not None:
                    ratio += f", {base / s['span_us']:.2f}x {a.impls[0]}"
                base = s["span_us"] if base is None else base
                rows.append((case, f"select_tokens ({DECODE_SELECTORS[impl]})", s, ratio))
            del cache
    if a.skip_topk:
        return print_rows(rows)

    n = a.topk_cols
    x = jax.random.normal(jax.random.PRNGKey(7), (a.topk_rows, n), jnp.float32)
    lengths = jnp.full((a.topk_rows,), n, jnp.int32)
    once_f = jax.jit(lambda x, l: jnp.max(br.masked(x, l), axis=1))
    for k in a.topk_ks or [cfg.topk_pools]:
        fns = {f"{impl} topk_pools": jax.jit(lambda x, l, impl=impl: ops.topk_pools(x, l, k, implementation=impl))
               for impl in a.impls}
        fns["lax.top_k"] = jax.jit(lambda x, l: lax.top_k(br.masked(x, l), k)[1])
        fns["read the scores once (XLA max)"] = once_f
        ids = {name: np.asarray(f(x, lengths)) for name, f in fns.items() if name.endswith("topk_pools")}
        if any((v != next(iter(ids.values()))).any() for v in ids.values()):
            raise SystemExit(f"topk_pools k={k}: the implementations disagree")
        res = {name: summarize(trace_calls(f, (x, lengths), a.calls, busy, busy_arg)) for name, f in fns.items()}
        base, once = res["lax.top_k"]["span_us"], res["read the scores once (XLA max)"]["span_us"]
        t_us = torch_topk_us(x, k)
        if t_us is not None:
            res["torch.topk (CUDA events)"] = dict(span_us=t_us, kernels_us=float("nan"), gaps_us=float("nan"), n=0,
                                                   calls=50, order=[], per_kernel_us=[])
        for name, s in res.items():
            vs_torch = f", {t_us / s['span_us']:.2f}x torch.topk" if t_us is not None else ""
            rows.append((f"topk [{a.topk_rows}, {n}] k={k}", name, s,
                         f"{base / s['span_us']:.2f}x lax.top_k{vs_torch}, {s['span_us'] / once:.2f}x one read"))
    print_rows(rows)


def profile(cfg, a):
    """One call of each decode case's select_tokens and of topk_pools at each --topk-ks
    (unless skipped), per --impls implementation, inside the CUDA profiler's window
    (``_timing.profile_calls``)."""
    calls = []
    for batch in ([] if a.skip_decode else a.batches):
        for ctx_tokens in a.contexts:
            layout, cache, table, key, heads = br.read_case(cfg, batch, ctx_tokens)
            q8, w = br.queries(key, batch, 1, heads)
            pos = jnp.full((batch, 1), ctx_tokens - 1, jnp.int32)
            sels = br.selectors(layout, False, triton="triton" in a.impls)
            for impl in a.impls:
                f = jax.jit(sels[DECODE_SELECTORS[impl]])
                calls.append((f"select_tokens {impl} B={batch} ctx={ctx_tokens}",
                              lambda f=f, args=(cache, q8, w, table, pos): f(*args)))
    if not a.skip_topk:
        n = a.topk_cols
        x = jax.random.normal(jax.random.PRNGKey(7), (a.topk_rows, n), jnp.float32)
        lengths = jnp.full((a.topk_rows,), n, jnp.int32)
        for k in a.topk_ks or [cfg.topk_pools]:
            for impl in a.impls:
                f = jax.jit(lambda x, l, k=k, impl=impl: ops.topk_pools(x, l, k, implementation=impl))
                calls.append((f"topk_pools {impl} [{a.topk_rows}, {n}] k={k}", lambda f=f: f(x, lengths)))
    return profile_calls(calls)


# the decode rows' logits launch shape (prefill_logits.DECODE) and variants of it, as
# overrides of its fields (pages per program at most, pipeline stages, programs at least)
SPLIT_LOGITS_VARIANTS = ({}, {"pages": 64}, {"pages": 8}, {"pages": 32}, {"stages": 3}, {"stages": 4},
                         {"min_programs": 264}, {"min_programs": 1056})
SPLIT_PROGRAM_VARIANTS = (528, 264, 132)  # the candidate launch's programs (workspace.split_spans)


def split_shapes(cfg, a):
    """The split top-k's launches on the logits of real decode calls (bench_read's random
    cache and queries, one query row per request), each variant's kernels traced the way
    the table is: the logits kernel's launch shape, the candidate launch's programs
    and the count of candidates (with maxima of 8 and of 64 pools where both fit), then
    candidates + rank; the ids equal the reference's."""
    from pallas_kernels.read import workspace
    from pallas_kernels.triton_lang import prefill_logits, split_topk
    busy, busy_arg = busy_kernel(), jnp.ones((16,), jnp.float32)
    k = cfg.topk_pools

    def kernels(f, args):
        s = summarize(trace_calls(jax.jit(f), args, a.calls, busy, busy_arg))
        return ", ".join(f"{nm} {t:.1f}" for nm, t in zip(s["order"], s["per_kernel_us"]))

    for batch in a.batches:
        for ctx_tokens in a.contexts:
            layout, cache, table, key, heads = br.read_case(cfg, batch, ctx_tokens)
            q8, w = br.queries(key, batch, 1, heads)
            s = layout.strides(0)
            ctx = jnp.full((batch, 1), ctx_tokens // cfg.kpool, jnp.int32)
            n_cols = table.shape[1] * s.page_rows
            default_pools = workspace.split_maxima_pools(n_cols)
            print(f"\nsplit top-k, decode B={batch} ctx={ctx_tokens // 1024}k ({n_cols} columns, k = {k}; "
                  f"maxima of {default_pools} pools by default); kernels in us")
            for over in SPLIT_LOGITS_VARIANTS:
                tune = dataclasses.replace(prefill_logits.DECODE, **over)
                print(f"  logits, {tune.pages} pages per program at most, {tune.stages} stages, "
                      f"{tune.min_programs} programs at least{'' if over else ' (default)'}: " + kernels(
                    lambda c, q, w_, t, x, tune=tune: prefill_logits.paged_logits(
                        c, s, q, w_, t, x, fill=False, maxima=True, maxima_pools=default_pools, tune=tune),
                    (cache, q8, w, table, ctx)))
            for pools in (8, 64):
                if workspace.maxima_cols(n_cols, pools) > workspace.FLOOR_MAXIMA:
                    continue
                lg, mx = jax.jit(lambda c, q, w_, t, x, pools=pools: prefill_logits.paged_logits(
                    c, s, q, w_, t, x, fill=False, maxima=True, maxima_pools=pools))(cache, q8, w, table, ctx)
                lg, mx, ln = lg.reshape(batch, -1), mx.reshape(batch, -1), ctx.reshape(-1)
                want = np.asarray(jax.jit(ref.topk_pools, static_argnums=2)(lg, ln, k))
                for programs in SPLIT_PROGRAM_VARIANTS:
                    f = lambda x, l, m, pools=pools, programs=programs: split_topk.split_candidates(  # noqa: E731
                        x, l, k, m, pools, programs)
                    cnt = np.asarray(jax.jit(f)(lg, ln, mx)[2])
                    print(f"  candidates, maxima of {pools}, {programs} programs: {kernels(f, (lg, ln, mx))}; "
                          f"candidates per row min {cnt.min()} median {int(np.median(cnt))} max {cnt.max()}, "
                          f"{(cnt > workspace.candidate_cap(k)).sum()} rows past the buffer")
                f = lambda x, l, m, pools=pools: split_topk.topk_pools_split(x, l, k, m, pools)  # noqa: E731
                same = np.array_equal(np.asarray(jax.jit(f)(lg, ln, mx)), want)
                print(f"  candidates + rank, maxima of {pools}: {kernels(f, (lg, ln, mx))}; "
                      f"ids {'equal' if same else 'DIFFER from'} the reference")
                if not same:
                    raise SystemExit("the split top-k's ids differ from the reference")
            del cache


def topk_forms(cfg, a):
    """--topk-forms: per --topk-form-rows x --topk-form-cols x --topk-ks, the span of
    the Triton top-k's sampled form, of one program per row (where it finishes in
    time: many rows or at most 32,768 pools), and of the Pallas kernels, beside one
    read of the scores, with each form's ids checked equal to the Pallas kernels'
    (random normal scores, every row full): the table behind ops.tc_topk_by_default
    and workspace.dense_topk_takes."""
    from pallas_kernels.triton_lang import dense_topk, topk_rows
    busy, busy_arg = busy_kernel(), jnp.ones((16,), jnp.float32)
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}; "
          f"{a.calls} calls per span, us")
    for n in a.topk_form_cols:
        for rows in a.topk_form_rows:
            if rows * n > 1 << 29:
                print(f"[{rows}, {n}] skipped: more than 2 GiB of scores")
                continue
            x = jax.random.normal(jax.random.PRNGKey(rows + n), (rows, n), jnp.float32)
            lengths = jnp.full((rows,), n, jnp.int32)
            fns = {"read": (jax.jit(lambda v, l: jnp.max(v, axis=1)), (x, lengths))}
            ks = a.topk_ks or [cfg.topk_pools]
            for k in ks:
                fs = {"sampled": jax.jit(lambda v, l, k=k: dense_topk.select_candidates(
                          v, l, dense_topk.collect_candidates(v, l, *dense_topk.sample_guesses(v, l, k), k), k)),
                      "pallas": jax.jit(lambda v, l, k=k: ops.topk_pools(v, l, k, implementation="pallas"))}
                if rows >= 256 or n <= 32768:
                    fs["rows"] = jax.jit(lambda v, l, k=k: topk_rows.topk_pools(v, l, k))
                want = np.asarray(fs["pallas"](x, lengths))
                if any(not np.array_equal(np.asarray(f(x, lengths)), want) for f in fs.values()):
                    raise SystemExit(f"topk [{rows}, {n}] k={k}: the forms' ids differ")
                fns.update({(k, nm): (f, (x, lengths)) for nm, f in fs.items()})
            s = {key: summarize(c)["span_us"] for key, c in trace_many(fns, a.calls, busy, busy_arg).items()}
            cells = [f"k={k}: sampled {s[k, 'sampled']:.1f} / rows "
                     + (f"{s[k, 'rows']:.1f}" if (k, "rows") in s else "-") + f" / pallas {s[k, 'pallas']:.1f}"
                     for k in ks]
            print(f"[{rows}, {n}] read {s['read']:.1f}; " + "; ".join(cells), flush=True)


def expansion(cfg, a):
    """The expansion kernel's traced span per --expand-rows against its copy floor: the
    bytes it reads (the pool ids) and writes (the token indices) at the rate of an XLA
    copy of the output's size traced in the same run (one read and one write a word)."""
    busy, busy_arg = busy_kernel(), jnp.ones((16,), jnp.float32)
    k, r = cfg.topk_pools, cfg.kpool
    width = k * r + r - 1
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}; "
          f"{a.calls} calls per row, each behind a busy kernel")
    rows = []
    for n_rows in a.expand_rows:
        seq = jnp.arange(1, n_rows + 1, dtype=jnp.int32)                    # a prefill's rows: row p sees p + 1 tokens
        ids = jax.random.randint(jax.random.PRNGKey(n_rows), (n_rows, k), -1, n_rows // r + 2, jnp.int32)
        out = jnp.zeros((n_rows, width), jnp.int32)
        copy = summarize(trace_calls(jax.jit(lambda x: x + 1), (out,), a.calls, busy, busy_arg))
        moved_bytes = ids.size * 4 + out.size * 4
        floor_us = moved_bytes / (2 * out.size * 4 / copy["span_us"])
        f = jax.jit(lambda i, s_: ops.expand_pools(i, s_, r, implementation="pallas"))
        got = np.asarray(f(ids, seq))
        want = np.asarray(ref.expand_pools(ids, seq, r))
        if not np.array_equal(got, want):
            raise SystemExit(f"expansion [{n_rows}, {k}]: the kernel differs from the reference")
        s = summarize(trace_calls(f, (ids, seq), a.calls, busy, busy_arg))
        rows.append((f"expand [{n_rows}, {k}]", "expand_pools", s,
                     f"{s['span_us'] / floor_us:.2f}x copy floor ({floor_us:.1f} us)"))
    print_rows(rows)


def print_rows(rows):
    print(f"\n{'case':<24}{'implementation':<34}{'span us':>9}{'kernels us':>11}{'gaps us':>9}{'kernels':>8}  ratios")
    print("-" * 120)
    for case, impl, s, ratio in rows:
        print(f"{case:<24}{impl:<34}{s['span_us']:>9.1f}{s['kernels_us']:>11.1f}{s['gaps_us']:>9.1f}"
              f"{s['n']:>8}  {ratio}")
    for case, impl, s, _ in rows:
        if s["order"] and "cub::" not in " ".join(s["order"]):
            parts = ", ".join(f"{nm} {t:.1f}" for nm, t in zip(s["order"], s["per_kernel_us"]))
            print(f"kernels (us, launch order) of {case} {impl}: {parts}")


if __name__ == "__main__":
    main()
