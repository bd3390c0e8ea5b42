"""Where does a chained short write call spend its time? (H200 diagnosis)

Usage: python benchmarks/launch_overhead.py

A chained call of the seed (request ends) or the decode update cost ~14 us on the
H200 in 20-call chains (session 2) while Nsight Compute gives their kernels ~4 us,
and an empty launch chained at ~4 us. This prints the time per call of
``_timing.time_chain`` (one chain's time / its length) with reps 20 and 100, as a
ratio to the empty one-operand launch:
  * the empty kernel with one 4 KiB operand (the baseline of bench_writes);
  * the empty kernel with the seed's operands (ends, tslot, key, gate, cache view);
  * the empty kernel on the seed's grid (32 programs);
  * the real seed and decode update.
If the per-call time follows the operands, not the kernel body, the cost is in
the launch path (host or runtime), not in our kernels.
"""
from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _timing import _empty_kernel, time_chain  # noqa: E402
import tune_writes as tw  # noqa: E402
from bench_writes import staggered_starts  # noqa: E402
from glm5_jax import ops  # noqa: E402
from pallas_kernels.core import addressing as addr  # noqa: E402
from pallas_kernels.core import backend as B  # noqa: E402


def _nothing(*refs):
    pass


def empty_with(operands, grid=1):
    """A step that launches an empty kernel taking `operands` + the state (aliased)."""
    def step(s, *a):
        view = s.reshape(-1, 1024)
        out = B.pallas_call(_nothing, grid=(grid,), out_shape=jax.ShapeDtypeStruct(view.shape, view.dtype),
                            input_output_aliases={len(a): 0}, interpret=None, name="empty_ops", num_warps=4)(*a, view)
        return out.reshape(-1)
    return step


def main():
    rng = np.random.default_rng(0)
    layout, sc, pre, ends = tw.prefill(rng, 32768, 64)
    s = layout.strides(0)
    seed_args = (ends, pre["tslot"], pre["key"], pre["gate"])
    rows = []

    def add(name, step, state, *args):
        for reps in (20, 100):
            t, _ = time_chain(step, state(), *args, reps=reps)
            rows.append((name, reps, t))
            print(f"{name:<44} reps {reps:>3}: {t * 1e6:8.2f} us", flush=True)

    tiny = lambda: jnp.zeros((1024,), jnp.uint32)                                       # noqa: E731
    add("empty, 1 operand of 4 KiB", lambda x: B.pallas_call(
        _empty_kernel, grid=(1,), out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), input_output_aliases={0: 0},
        interpret=None, name="empty", num_warps=1)(x), tiny)
    add("empty, the seed's 5 operands", empty_with(seed_args), lambda: layout.allocate(0), *seed_args)
    add("empty, seed operands, 32 programs", empty_with(seed_args, 32), lambda: layout.allocate(0), *seed_args)
    add("seed_tail with request ends (32k tok / 64 req)", lambda c, e, t, k, g: ops.seed_tail(
        c, layout, 0, k, g, t, request_ends_tokens=e, implementation="pallas"), lambda: layout.allocate(0),
        *seed_args)
    cfg = layout.config
    dl = tw.CacheLayout(cfg, num_layers=1, num_blocks=256 * 6 + 2)
    dctx = 4 * cfg.block_size - 8
    dsc = tw.Scenario.random(rng, dl, [dctx] * 256)
    st = {k: jnp.asarray(v) for k, v in dsc.decode(staggered_starts(dctx, 256, 1, cfg.kpool), [1] * 256, 1).items()}
    dargs = (st["key"], st["gate"], jnp.asarray(dsc.ape), st["slot_mapping"], st["tslot"], st["positions"])
    add("empty, the decode's 7 operands", empty_with(dargs), lambda: dl.allocate(0), *dargs)
    add("empty, decode operands, 256 programs", empty_with(dargs, 256), lambda: dl.allocate(0), *dargs)
    add("decode_update B=256 next_n=1 (1 in 4 complete)", lambda c, *a: ops.decode_update(
        c, dl, 0, *a, implementation="pallas"), lambda: dl.allocate(0), *dargs)
    base = {r: t for n, r, t in rows if n.startswith("empty, 1 operand")}
    print("\n| call | reps | us per call | x empty launch |\n|---|---|---|---|")
    for n, r, t in rows:
        print(f"| {n} | {r} | {t * 1e6:.2f} | {t / base[r]:.2f}x |")


if __name__ == "__main__":
    main()
