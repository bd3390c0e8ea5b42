"""Where the time of the compression kernel goes: the same kernel with parts of its
numerics swapped for cheap (NOT bit-exact) stand-ins, timed in one run.

Usage (on the H200):  PYTHONPATH=$PWD python benchmarks/probe_compress.py [--tokens 32768] [--quick]

Each variant patches functions of ``pallas_kernels.numerics`` (the kernel body looks
them up at trace time), clears JAX's caches, and times ``compress_prefill`` in a
chain of calls with the cache donated (``_timing.time_chain``). Only the first row
("exact") is the shipped kernel; it is checked byte for byte against the XLA
reference first. The others are timing probes: their bytes differ by design.
Reported: us per call, the fraction of device-to-device copy bandwidth (bytes moved
counted as in bench_writes.py: K + gate + slot read once, 132 B written per pool),
and the share of the exact kernel's time each probe removes.

``--decode`` runs the same probes on the decode update instead, timed as device spans
from a profiler trace against an empty kernel (trace_writes.py's method); the probe
"no pool arithmetic" leaves only its loads, branches and stores, the latency floor of
its memory chain (written in session 12 for the next session's first decode run).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import ops
from glm5_jax.testing import session7_exp_f32
from pallas_kernels import numerics as nm
from pallas_kernels.pool_compress import compress_prefill

sys.path.insert(0, os.path.dirname(__file__))
from _timing import copy_bandwidth, time_chain  # noqa: E402
from tune_writes import SENTINEL, prefill  # noqa: E402


def _plain_mac(c, a, b):
    return c + a * b


def _fast_exp(d, lookup=None):
    return jnp.exp(jnp.clip(d, -87.0, 88.0))


def _fast_recip(b):
    return 1.0 / b


def _no_hadamard(x):
    return x


def _no_pool_arithmetic(keys, gates, ape_rows, exp_lookup=None):
    """compress_pool's shapes with none of its work: the newest member's key as the fp8
    row, its first element as the scale (the kernel's loads and stores stay)."""
    k = keys[-1].astype(jnp.float32)
    return jnp.clip(k, -nm.FP8_MAX, nm.FP8_MAX).astype(nm.FP8), k[..., 0]


PROBES = {
    "exact": {},
    "session-7 numerics": {"exp_f32": session7_exp_f32, "mac_bf16": nm.mac},   # same-run baseline
    "mac -> c + a*b": {"mac": _plain_mac, "mac_bf16": _plain_mac},
    "exp -> jnp.exp": {"exp_f32": _fast_exp},
    "recip -> 1/x": {"recip_f32": _fast_recip},
    "hadamard -> identity": {"hadamard128": _no_hadamard},
    "exp+recip cheap": {"exp_f32": _fast_exp, "recip_f32": _fast_recip},
    "all cheap": {"exp_f32": _fast_exp, "recip_f32": _fast_recip, "mac": _plain_mac,
                  "mac_bf16": _plain_mac, "hadamard128": _no_hadamard},
    "no pool arithmetic": {"compress_pool": _no_pool_arithmetic},
}


@contextlib.contextmanager
def patched(names):
    old = {k: getattr(nm, k) for k in names}
    try:
        for k, v in names.items():
            setattr(nm, k, v)
        jax.clear_caches()
        yield
    finally:
        for k, v in old.items():
            setattr(nm, k, v)
        jax.clear_caches()


def decode(probes, rng, quick, calls=30):
    """decode_update under each probe: B = 256 and 1 (4 quick), next_n 1 and 4, as
    bench_writes.decode_case. Device spans from a profiler trace (trace_writes.py's
    method; host wall time off the GPU), against an empty kernel traced the same way:
    where the latency of the decode update goes ("no pool arithmetic" leaves its loads,
    branches and stores)."""
    import trace_read as tr
    import trace_writes as tw
    from _timing import empty_launch_step
    from bench_writes import decode_case
    from pallas_kernels.decode_update import decode_update

    busy = tr.busy_kernel(interpret=jax.default_backend() != "gpu")
    busy_arg = jnp.ones((16,), jnp.float32)

    def span_us(step, state, *args):
        return tw.trace_state_calls(tw.donated(step), state, args, 3 if quick else calls, busy, busy_arg)[0]["span_us"]

    empty = span_us(empty_launch_step, jnp.zeros((1024,), jnp.uint32))
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}; "
          f"empty Pallas kernel {empty:.2f} us (device span)")
    print(f"{'probe':<24}{'case':>18}{'span us':>10}{'x empty':>9}")
    for batch in ((4,) if quick else (256, 1)):
        for nn in (1, 4):
            layout, _, args = decode_case(rng, batch, nn)
            s = layout.strides(0)
            for name, patch in probes.items():
                with patched(patch):
                    us = span_us(lambda c, *x: decode_update(c, s, *x), layout.allocate(0), *args)
                print(f"{name:<24}{f'B={batch} next_n={nn}':>18}{us:>10.2f}{us / empty:>9.2f}")


def profile(probes, shapes, layout, s, args):
    """One call per (probe, shape), in order, inside the CUDA profiler's window."""
    from profile_kernels import cudart
    lib = cudart()
    order = []
    for name, patch in probes.items():
        for tp, nw in shapes:
            with patched(patch):
                f = jax.jit(lambda c, *x, tp=tp, nw=nw: compress_prefill(c, s, *x, tile_pools=tp, num_warps=nw),
                            donate_argnums=0)
                c = jax.block_until_ready(f(layout.allocate(0), *args))
                if lib is not None:
                    lib.cudaProfilerStart()
                c = jax.block_until_ready(f(c, *args))
                if lib is not None:
                    lib.cudaProfilerStop()
            order.append(f"{name} {tp}x{nw}")
    print("profiled, in order:", "; ".join(order))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--shapes", default="8x4,16x4,16x8,32x8", help="tile_pools x num_warps list")
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run)")
    ap.add_argument("--profile", action="store_true",
                    help="run each probe once between cudaProfilerStart/Stop (for ncu --profile-from-start off)")
    ap.add_argument("--probes", default=",".join(PROBES), help="comma-separated probe names")
    ap.add_argument("--decode", action="store_true",
                    help="time decode_update (B = 256 and 1, next_n 1 and 4, device spans) instead")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    tokens = 512 if a.quick else a.tokens
    reps, trials = (2, 1) if a.quick else (10, 5)
    layout, sc, pre, _ = prefill(rng, tokens, 4 if a.quick else 64)
    s, ape = layout.strides(0), jnp.asarray(sc.ape)
    args = (pre["key"], pre["gate"], ape, pre["slot_mapping"])
    t = int(pre["key"].shape[0])
    nbytes = t * (512 + 4) + (t // layout.config.kpool) * 132
    bw = copy_bandwidth(1 << 26 if a.quick else 1 << 30)
    shapes = [tuple(int(v) for v in x.split("x")) for x in a.shapes.split(",")]
    if a.quick:
        shapes = shapes[:1]

    probes = {k: PROBES[k] for k in a.probes.split(",")}
    if a.decode:
        return decode(probes, rng, a.quick)
    if a.profile:
        return profile(probes, shapes, layout, s, args)
    want = np.asarray(ops.compress_prefill(layout.allocate(SENTINEL), layout, 0, *args, implementation="xla"))
    rows = []
    for name, patch in probes.items():
        for tp, nw in shapes:
            with patched(patch):
                f = lambda c, *x, tp=tp, nw=nw: compress_prefill(c, s, *x, tile_pools=tp, num_warps=nw)
                note = ""
                if not patch:
                    got = np.asarray(f(layout.allocate(SENTINEL), *args))
                    note = "bytes == reference" if (got == want).all() else "BYTES DIFFER"
                sec = time_chain(f, layout.allocate(0), *args, reps=reps, trials=trials)[0]
            rows.append((name, f"{tp}x{nw}", sec, note))
    base = {shape: sec for name, shape, sec, _ in rows if name == "exact"}
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}; "
          f"compression of {t} tokens, {nbytes / 1e6:.2f} MB moved; copy bandwidth {bw / 1e12:.2f} TB/s")
    hdr = f"{'probe':<24}{'tile x warps':>13}{'us/call':>10}{'x copy BW':>11}{'saves':>8}  note"
    print(hdr + "\n" + "-" * len(hdr))
    for name, shape, sec, note in rows:
        frac = nbytes / sec / bw
        saves = 1 - sec / base[shape]
        print(f"{name:<24}{shape:>13}{sec * 1e6:>10.2f}{frac:>11.3f}{saves:>8.0%}  {note}")
    print("\nx copy BW: (bytes moved / time) / copy bandwidth of this run; saves: 1 - probe / exact at "
          "the same launch shape. Only 'exact' is a shipped kernel.")


if __name__ == "__main__":
    main()
