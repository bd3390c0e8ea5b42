"""Benchmark of the cache-write kernels: Pallas, Triton (jax_triton) and the XLA reference, as ratios.

Usage (on the H200):
    PYTHONPATH=$PWD python benchmarks/bench_writes.py [--quick] [--impls pallas,triton,xla] [--json out.json]

For each case and implementation it prints the time per call (``_timing.time_chain``:
one jitted chain of calls; 100 calls for the latency-bound seed and decode
kernels, so the one jit dispatch adds <= 0.6 us per call, 10 for compression and
for the XLA reference, whose calls take >= 10 us and whose 100-call chains take
minutes to compile), the bytes the op
must move (each input read once, each output written once), the achieved
fraction of the device-to-device copy bandwidth measured in this run, the ratio
to an empty Pallas launch, and the speed-up over the XLA reference (when "xla"
is among --impls). All implementations run the same sizes in one run; "triton"
is skipped with a note where it cannot run (no GPU, or jax_triton missing).

The write tables of docs/benchmarks.md come from trace_writes.py (each call's
device span from a profiler trace): a chain shares one jit dispatch among its
calls, and XLA may compute the pools of identical chained calls once. This script
times the Triton-language kernels beside Pallas and XLA (``ops.DEFAULT_ORDER``'s
choice between them).
"""
from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import ops
from glm5_jax.config import IndexerConfig
from glm5_jax.layout import CacheLayout
from glm5_jax.testing import Scenario

sys.path.insert(0, __import__("os").path.dirname(__file__))
from _timing import copy_bandwidth, empty_launch_seconds, time_chain  # noqa: E402


def prefill_case(rng, total_tokens, n_requests):
    cfg = IndexerConfig()
    per = total_tokens // n_requests
    per -= per % cfg.kpool
    blocks = n_requests * (-(-per // cfg.block_size) + 1) + 2
    layout = CacheLayout(cfg, num_layers=1, num_blocks=blocks)
    sc = Scenario.random(rng, layout, [per] * n_requests)
    return layout, sc, sc.prefill([per] * n_requests)


def compress_bytes(tokens: int, pools: int) -> int:
    """Compression: read K + gate once (512 B/token) + slot (4 B/token); write 132 B per pool."""
    return 512 * tokens + 4 * tokens + 132 * pools


def seed_bytes(tokens: int, n_requests: int, kpool: int) -> int:
    """Seed: tslot of every token (4 B) + K/gate of the last kpool tokens per request; write 512 B each."""
    return 4 * tokens + 2 * 512 * n_requests * kpool


def decode_bytes(batch: int, next_n: int, completed_pools: int, kpool: int) -> int:
    """Decode update: read K/gate of each token (512 B) + 12 B metadata, stash 512 B; per
    completion read (kpool-1) * 512 B of ring, write 132 B."""
    return batch * next_n * (512 + 12 + 512) + completed_pools * ((kpool - 1) * 512 + 132)


def bench_prefill(rng, total_tokens, n_requests, reps, impls, reps_latency):
    layout, sc, pre = prefill_case(rng, total_tokens, n_requests)
    t = pre["key"].shape[0]
    args = [jnp.asarray(pre[k]) for k in ("key", "gate")]
    ape = jnp.asarray(sc.ape)
    slot, tslot = jnp.asarray(pre["slot_mapping"]), jnp.asarray(pre["tslot"])
    ends = jnp.asarray(np.cumsum([t // n_requests] * n_requests).astype(np.int32))
    pools = int((pre["slot_mapping"] >= 0).sum())
    rows = []
    comp_bytes = compress_bytes(t, pools)
    res = {}
    for impl in impls:
        step = lambda c, k, g, a, s, impl=impl: ops.compress_prefill(c, layout, 0, k, g, a, s, implementation=impl)
        res[impl], _ = time_chain(step, layout.allocate(0), *args, ape, slot, reps=reps)
    rows.append(("compress_prefill", f"{t} tok", res, comp_bytes))
    nbytes_seed = seed_bytes(t, n_requests, layout.config.kpool)
    for name, with_ends in (("seed_tail", False), ("seed_tail+ends", True)):
        res = {}
        for impl in impls:
            kw = dict(request_ends_tokens=ends) if with_ends and impl != "xla" else {}
            step = lambda c, k, g, s, impl=impl, kw=kw: ops.seed_tail(c, layout, 0, k, g, s, implementation=impl,
                                                                      **kw)
            res[impl], _ = time_chain(step, layout.allocate(0), *args, tslot,
                                      reps=reps if impl == "xla" else reps_latency)
        rows.append((name, f"{t} tok / {n_requests} req", res, nbytes_seed))
    return rows


def staggered_starts(ctx: int, batch: int, next_n: int, kpool: int) -> list:
    """First decode position of each request: ctx - next_n - (b % kpool)."""
    return [ctx - next_n - (b % kpool) for b in range(batch)]


def decode_case(rng, batch: int, next_n: int):
    """The decode-update benchmark case: (layout, st, args) with args = [key, gate,
    ape, slot_mapping, tslot, positions] as device arrays (ops.decode_update order).

    Steady state: the requests' positions are staggered, so at next_n = 1 one request
    in R completes a pool in every call (the kernel's time is its slowest program's:
    with all requests at one position, a call would complete none or all of them)."""
    cfg = IndexerConfig(num_spec_tokens=max(0, next_n - 1))
    ctx_tokens = 4 * 1152 - 8
    layout = CacheLayout(cfg, num_layers=1, num_blocks=batch * 6 + 2)
    sc = Scenario.random(rng, layout, [ctx_tokens] * batch)
    st = sc.decode(staggered_starts(ctx_tokens, batch, next_n, cfg.kpool), [next_n] * batch, next_n)
    args = [jnp.asarray(st[k]) for k in ("key", "gate")] + [jnp.asarray(sc.ape)] + [
        jnp.asarray(st[k]) for k in ("slot_mapping", "tslot", "positions")]
    return layout, st, args


def bench_decode(rng, batch, next_n, reps, impls, reps_xla):
    layout, st, args = decode_case(rng, batch, next_n)
    cfg = layout.config
    completed_pools = int((st["slot_mapping"] >= 0).sum())
    nbytes = decode_bytes(batch, next_n, completed_pools, cfg.kpool)
    res = {}
    for impl in impls:
        step = lambda c, k, g, a, s, ts, p, impl=impl: ops.decode_update(c, layout, 0, k, g, a, s, ts, p,
                                                                         implementation=impl)
        res[impl], _ = time_chain(step, layout.allocate(0), *args,
                                  reps=reps_xla if impl == "xla" else reps)
    return [("decode_update", f"B={batch} next_n={next_n}", res, nbytes)]


def runnable_impls(requested):
    """The requested implementations that can run here; prints a note for each one skipped."""
    from pallas_kernels.triton_lang import _call
    out = []
    for impl in requested:
        if impl not in ops.IMPLEMENTATIONS:
            raise SystemExit(f"unknown implementation {impl!r}; choose from {ops.IMPLEMENTATIONS}")
        reason = _call.unavailable_reason() if impl == "triton" else None
        if reason is not None:
            print(f"note: skipping implementation 'triton': {reason}")
            continue
        out.append(impl)
    if not out:
        raise SystemExit("no implementation left to run")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run)")
    ap.add_argument("--impls", default="pallas,triton,xla",
                    help="comma-separated implementations to time (default: pallas,triton,xla)")
    ap.add_argument("--json", help="write the rows as JSON here")
    ap.add_argument("--decode-only", action="store_true", help="only the decode update cases")
    a = ap.parse_args(argv)
    impls = runnable_impls([s.strip() for s in a.impls.split(",") if s.strip()])
    rng = np.random.default_rng(0)
    reps = 3 if a.quick else 10                     # compression (tens of us a call)
    reps_latency = 3 if a.quick else 100            # seed and decode (a few us a call)
    bw = copy_bandwidth(1 << 24 if a.quick else 1 << 30)
    empty = empty_launch_seconds()
    print(f"measured copy bandwidth {bw / 1e12:.2f} TB/s, empty Pallas launch {empty * 1e6:.2f} us", flush=True)
    rows = []

    def add(new):                                   # progress, in case a time limit cuts the run
        rows.extend(new)
        for name, case, res, _ in new:
            print("measured", name, case, {k: f"{v * 1e6:.2f} us" for k, v in res.items()}, flush=True)

    # the headline cases first (B = 256, 32k and 128k tokens), in case a time
    # limit cuts the run; the table below lists them in size order
    for b in ((4,) if a.quick else (256, 64, 1)):
        for n in (1, 4):
            add(bench_decode(rng, b, n, reps_latency, impls, reps))
        if (b == 256 or a.quick) and not a.decode_only:
            for total in ((1024,) if a.quick else (32768, 131072, 4096)):
                add(bench_prefill(rng, total, 4 if a.quick else 64, reps, impls, reps_latency))
    order = {("decode_update", c): i for i, c in enumerate(
        f"B={b} next_n={n}" for b in (1, 4, 64, 256) for n in (1, 4))}
    rows.sort(key=lambda r: (r[0] != "decode_update", order.get((r[0], r[1]), 0),
                             int(r[1].split()[0]) if r[0] != "decode_update" else 0))
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}; "
          f"implementations {', '.join(impls)}")
    print(f"copy bandwidth measured now: {bw / 1e12:.2f} TB/s; empty Pallas launch: {empty * 1e6:.2f} us "
          f"(chains of {reps_latency} calls for the Pallas/Triton decode and seed, {reps} for compression and XLA)\n")
    hdr = (f"{'kernel':<18}{'case':<24}{'impl':<8}{'us/call':>10}{'MB moved':>10}{'frac copy BW':>14}"
           f"{'x empty':>9}{'vs XLA':>9}")
    print(hdr)
    print("-" * len(hdr))
    out = []
    for name, case, res, nbytes in rows:
        for impl, t in res.items():
            frac = nbytes / t / bw
            vs = res["xla"] / t if "xla" in res else None
            vs_txt = f"{vs:>8.2f}x" if vs is not None else f"{'-':>9}"
            print(f"{name:<18}{case:<24}{impl:<8}{t * 1e6:>10.2f}{nbytes / 1e6:>10.3f}{frac:>14.3f}"
                  f"{t / empty:>9.2f}{vs_txt}")
            out.append(dict(kernel=name, case=case, impl=impl, us=t * 1e6, bytes=nbytes, frac_copy_bw=frac,
                            x_empty_launch=t / empty, speedup_vs_xla=vs))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(backend=jax.default_backend(), device=str(jax.devices()[0].device_kind),
                           jax=jax.__version__, impls=impls, copy_bw_Bps=bw, empty_launch_s=empty, rows=out),
                      f, indent=1)


if __name__ == "__main__":
    main()
