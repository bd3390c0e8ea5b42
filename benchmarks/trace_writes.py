"""Device time of the cache-write kernels, read from a profiler trace: no timing harness inside.

Usage (on the H200):  PYTHONPATH=$PWD python benchmarks/trace_writes.py [--calls 30] [--quick]
                      [--decode-variants walk:4 forward:2] [--compress-shapes 8x4 2x4] [--json out.json]
                      [--profile compress:131072 decode:256:1 ...]

bench_writes.py times chains of calls in one jit: the chain's dispatch is shared by
its calls (1/10 of ~50 us per compression call), and its spread between runs is
larger than the latency-bound kernels' differences (the same compression kernel at
4k tokens has measured 20.1 and 44.6 us chained on the same H200). Here, as in
trace_read.py, each call is its own jit execution with the
cache donated, queued behind a one-program busy kernel, and its device span (first
kernel's start to last kernel's end) is read from a jax profiler trace.

Same-run baselines, traced the same way:
  empty     an empty one-program Pallas kernel: "x empty" = span / its span
  copy      a 1 GiB device copy (read + write): "frac copy BW" = bytes moved / span
            over the copy's bytes / span
  XLA       the reference implementation of the same call: "vs XLA" = its span / ours

Cases: decode_update at B in {1, 64, 256} x next_n in {1, 4} (staggered positions,
as bench_writes.decode_case); compression and the seed with request ends for prefill
batches of 4k, 32k and 128k tokens over 64 requests. --decode-variants (program
"forward" or "walk" x num_warps) and --compress-shapes (tile_pools x num_warps) add
variants of the Pallas kernels, each checked byte for byte against the default's
result first.

--profile CASE ... traces nothing: it runs one call of the default Pallas kernel per
case between cudaProfilerStart and cudaProfilerStop, after a warm-up call, for
``ncu --profile-from-start off`` (benchmarks/gpu.sh, step ncu). A case is
compress:TOKENS or seed:TOKENS (a prefill batch of 64 requests, as above) or
decode:B:NEXT_N.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import bench_writes as bw  # noqa: E402
import trace_read as tr  # noqa: E402
from _timing import empty_launch_seconds, empty_launch_step, profile_calls, threaded  # noqa: E402
from glm5_jax import ops  # noqa: E402

COPY_BYTES = 1 << 30


def trace_state_calls(f, state, args, calls: int, busy, busy_arg):
    """Trace `calls` executions of `state = f(state, *args)` (f jitted with the state
    donated), each queued behind the busy kernel and waited for. Returns (the calls'
    summary as trace_read.summarize gives it, the final state)."""
    state = jax.block_until_ready(f(state, *args))                   # compile + warm up
    jax.block_until_ready(busy(busy_arg))
    if jax.default_backend() != "gpu":       # no device trace off the GPU: host wall time (a smoke run)
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            state = jax.block_until_ready(f(state, *args))
            times.append((time.perf_counter() - t0) * 1e6)
        us = float(np.median(times))
        return dict(span_us=us, kernels_us=us, gaps_us=0.0, n=0, calls=calls, order=[], per_kernel_us=[]), state
    d = tempfile.mkdtemp(prefix="trace_writes_")
    with jax.profiler.trace(d):
        for _ in range(calls):
            busy(busy_arg)
            state = jax.block_until_ready(f(state, *args))
    paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise RuntimeError(f"jax.profiler wrote no xplane.pb under {d}")
    return tr.summarize(tr.group_calls(tr.device_events(paths[0]))), state


def donated(step):
    return jax.jit(step, donate_argnums=0)


def profile_case(rng, case: str):
    """(name, call) of one --profile case: the default Pallas kernel's call on a fresh
    cache, for ``_timing.profile_calls``."""
    kind, *nums = case.split(":")
    try:
        nums = [int(n) for n in nums]
    except ValueError:
        nums = []
    if kind == "decode" and len(nums) == 2:
        layout, _, args = bw.decode_case(rng, *nums)
        step = lambda c, *x: ops.decode_update(c, layout, 0, *x, implementation="pallas")      # noqa: E731
        return f"decode_update B={nums[0]} next_n={nums[1]}", threaded(donated(step), layout.allocate(0), *args)
    if kind in ("compress", "seed") and len(nums) == 1:
        layout, sc, pre = bw.prefill_case(rng, nums[0], 64)
        key, gate = jnp.asarray(pre["key"]), jnp.asarray(pre["gate"])
        tokens = key.shape[0]
        if kind == "compress":
            step = lambda c, k, g, a, sl: ops.compress_prefill(c, layout, 0, k, g, a, sl,        # noqa: E731
                                                               implementation="pallas")
            args = (key, gate, jnp.asarray(sc.ape), jnp.asarray(pre["slot_mapping"]))
        else:
            ends = jnp.asarray(np.cumsum([tokens // 64] * 64).astype(np.int32))
            step = lambda c, k, g, ts: ops.seed_tail(c, layout, 0, k, g, ts, request_ends_tokens=ends,  # noqa: E731
                                                     implementation="pallas")
            args = (key, gate, jnp.asarray(pre["tslot"]))
        return f"{kind} {tokens} tokens / 64 requests", threaded(donated(step), layout.allocate(0), *args)
    raise SystemExit(f"--profile: bad case {case!r} (compress:TOKENS, seed:TOKENS or decode:B:NEXT_N)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--quick", action="store_true",
                    help="small sizes: a smoke run of the script (off the GPU, spans are host wall times)")
    ap.add_argument("--decode-variants", nargs="*", default=[],
                    help="extra path:num_warps variants of the Pallas decode update, e.g. walk:4 forward:2")
    ap.add_argument("--compress-shapes", nargs="*", default=[],
                    help="extra tile_pools x num_warps variants of the Pallas compression, e.g. 8x4")
    ap.add_argument("--json", help="write the rows as JSON here")
    ap.add_argument("--profile", nargs="+", metavar="CASE",
                    help="no trace: one call of the default Pallas kernel per case inside the CUDA profiler's "
                         "window, for ncu --profile-from-start off (compress:TOKENS, seed:TOKENS, decode:B:NEXT_N)")
    a = ap.parse_args(argv)
    if a.profile:
        rng = np.random.default_rng(0)
        profile_calls([profile_case(rng, c) for c in a.profile])
        return
    from pallas_kernels.writes.decode_update import decode_update as decode_kernel
    from pallas_kernels.writes.pool_compress import compress_prefill as compress_kernel
    busy = tr.busy_kernel(interpret=jax.default_backend() != "gpu")
    busy_arg = jnp.ones((16,), jnp.float32)
    trace = lambda step, state, *args: trace_state_calls(donated(step), state, args, a.calls, busy, busy_arg)[0]

    copy_bytes = (1 << 22) if a.quick else COPY_BYTES
    copy = trace(lambda s: s + jnp.uint32(1), jnp.zeros((copy_bytes // 4,), jnp.uint32))
    bw_Bps = 2 * copy_bytes / (copy["span_us"] * 1e-6)
    empty = trace(empty_launch_step, jnp.zeros((1024,), jnp.uint32))
    empty_chained_us = empty_launch_seconds() * 1e6
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}; "
          f"{a.calls} calls per row, each behind a busy kernel")
    print(f"copy of {copy_bytes >> 20} MiB: {copy['span_us']:.1f} us span = {bw_Bps / 1e12:.3f} TB/s; "
          f"empty Pallas kernel: {empty['span_us']:.2f} us span (chained in one jit, for comparison: "
          f"{empty_chained_us:.2f} us per call)", flush=True)
    rows = []

    def add(kernel, case, impl, s, nbytes, base):
        rows.append(dict(kernel=kernel, case=case, impl=impl, span_us=s["span_us"], kernels=s["n"],
                         bytes=nbytes, frac_copy_bw=nbytes / (s["span_us"] * 1e-6) / bw_Bps,
                         x_empty=s["span_us"] / empty["span_us"], vs_xla=None, base=base,
                         order=s["order"], per_kernel_us=s["per_kernel_us"]))
        print(f"measured {kernel} {case} {impl}: {s['span_us']:.2f} us span ({s['n']} kernels)", flush=True)

    rng = np.random.default_rng(0)
    decode_cases = ((4, 1), (4, 4)) if a.quick else tuple((b, n) for b in (256, 64, 1) for n in (1, 4))
    for batch, next_n in decode_cases:
        layout, st, args = bw.decode_case(rng, batch, next_n)
        case = f"B={batch} next_n={next_n}"
        nbytes = bw.decode_bytes(batch, next_n, int((st["slot_mapping"] >= 0).sum()), layout.config.kpool)
        for impl in ("pallas", "xla"):
            step = lambda c, *x, impl=impl: ops.decode_update(c, layout, 0, *x, implementation=impl)
            add("decode_update", case, impl, trace(step, layout.allocate(0), *args), nbytes, impl)
        s = layout.strides(0)
        want = np.asarray(decode_kernel(layout.allocate(0), s, *args))
        for variant in a.decode_variants:
            path, warps = variant.split(":")
            step = lambda c, *x, p=path, w=int(warps): decode_kernel(c, s, *x, num_warps=w, path=p)
            got = np.asarray(step(layout.allocate(0), *args))
            impl = f"{path} {warps}w"
            if not np.array_equal(got, want):
                print(f"WRONG: decode_update {case} {impl} differs from the default kernel; not timed")
                continue
            add("decode_update", case, impl, trace(step, layout.allocate(0), *args), nbytes, "pallas")

    for total_tokens in ((1024,) if a.quick else (4096, 32768, 131072)):
        n_req = 4 if a.quick else 64
        layout, sc, pre = bw.prefill_case(rng, total_tokens, n_req)
        tokens = pre["key"].shape[0]                   # total_tokens, rounded to whole pools per request
        key, gate = jnp.asarray(pre["key"]), jnp.asarray(pre["gate"])
        ape, slot, tslot = jnp.asarray(sc.ape), jnp.asarray(pre["slot_mapping"]), jnp.asarray(pre["tslot"])
        ends = jnp.asarray(np.cumsum([tokens // n_req] * n_req).astype(np.int32))
        case = f"{tokens} tok / {n_req} req"
        nbytes = bw.compress_bytes(tokens, int((pre["slot_mapping"] >= 0).sum()))
        for impl in ("pallas", "xla"):
            step = lambda c, k, g, ap, sl, impl=impl: ops.compress_prefill(c, layout, 0, k, g, ap, sl,
                                                                            implementation=impl)
            add("compress_prefill", case, impl, trace(step, layout.allocate(0), key, gate, ape, slot), nbytes, impl)
        s = layout.strides(0)
        want = np.asarray(compress_kernel(layout.allocate(0), s, key, gate, ape, slot))
        for shape in a.compress_shapes:
            tile, warps = (int(v) for v in shape.split("x"))
            step = lambda c, k, g, ap, sl, tile=tile, warps=warps: compress_kernel(
                c, s, k, g, ap, sl, tile_pools=tile, num_warps=warps)
            if not np.array_equal(np.asarray(step(layout.allocate(0), key, gate, ape, slot)), want):
                print(f"WRONG: compress_prefill {case} {shape} differs from the default kernel; not timed")
                continue
            add("compress_prefill", case, f"pallas {shape}",
                trace(step, layout.allocate(0), key, gate, ape, slot), nbytes, "pallas")
        nbytes = bw.seed_bytes(tokens, n_req, layout.config.kpool)
        for impl in ("pallas", "xla"):
            kw = dict(request_ends_tokens=ends) if impl == "pallas" else {}
            step = lambda c, k, g, ts, impl=impl, kw=kw: ops.seed_tail(c, layout, 0, k, g, ts, implementation=impl,
                                                                        **kw)
            add("seed_tail+ends", case, impl, trace(step, layout.allocate(0), key, gate, tslot), nbytes, impl)

    for r in rows:
        xla = [x for x in rows if (x["kernel"], x["case"], x["impl"]) == (r["kernel"], r["case"], "xla")]
        r["vs_xla"] = xla[0]["span_us"] / r["span_us"] if xla else None
    print(f"\ncopy bandwidth {bw_Bps / 1e12:.3f} TB/s, empty Pallas kernel {empty['span_us']:.2f} us "
          f"(both traced in this run)")
    hdr = (f"{'kernel':<18}{'case':<22}{'impl':<12}{'span us':>9}{'kernels':>8}{'MB moved':>10}"
           f"{'frac copy BW':>14}{'x empty':>9}{'vs XLA':>9}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        vs = f"{r['vs_xla']:>8.2f}x" if r["vs_xla"] is not None else f"{'-':>9}"
        print(f"{r['kernel']:<18}{r['case']:<22}{r['impl']:<12}{r['span_us']:>9.2f}{r['kernels']:>8}"
              f"{r['bytes'] / 1e6:>10.3f}{r['frac_copy_bw']:>14.3f}{r['x_empty']:>9.2f}{vs}")
    for r in rows:
        if r["impl"] == "pallas" and r["kernels"] > 1:
            parts = ", ".join(f"{name} {us:.2f}" for name, us in zip(r["order"], r["per_kernel_us"]))
            print(f"kernels (us) of {r['kernel']} {r['case']} pallas: {parts}")
    print("(default shapes: decode_update", f"{decode_kernel.__module__}.default_path / default_num_warps; "
          f"compression {compress_kernel.__module__}.default_tile_pools x default_num_warps)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(backend=jax.default_backend(), device=str(jax.devices()[0].device_kind),
                           jax=jax.__version__, copy_bw_Bps=bw_Bps, empty_span_us=empty["span_us"],
                           empty_chained_us=empty_chained_us, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
