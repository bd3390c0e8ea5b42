"""Per-kernel device time of one call of each op, for Nsight Compute.

Usage (on the H200):
  ncu --profile-from-start off --metrics gpu__time_duration.sum,dram__bytes.sum,\
sm__throughput.avg.pct_of_peak_sustained_elapsed --csv \
      env PYTHONPATH=$PWD python benchmarks/profile_kernels.py > ncu.csv

Every op is compiled and run once first; then the CUDA profiler is switched on
around one more call of each (``cudaProfilerStart/Stop``), so ncu sees exactly
the kernels of those calls: the Pallas kernels and any XLA kernels an op adds
around them. Without ncu the script still runs (and prints which ops it ran).
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import bench_read as br  # noqa: E402
from bench_writes import staggered_starts  # noqa: E402
import tune_writes as tw  # noqa: E402
from glm5_jax import ops  # noqa: E402
from glm5_jax.config import IndexerConfig  # noqa: E402


def cudart():
    """libcudart of the CUDA pip wheels JAX uses (or the system one); None if absent."""
    try:
        import nvidia
    except ImportError:                                   # no CUDA wheels (CPU machine)
        return None
    pats = [os.path.join(p, "**", "libcudart.so*") for p in nvidia.__path__]
    for path in sorted(sum((glob.glob(p, recursive=True) for p in pats), [])) + ["libcudart.so"]:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def chain_hlo_ops(fn, state, reps=3):
    """Kinds of top-level work (custom calls, fusions, copies) in the compiled chain of `reps` calls."""
    import re
    import functools

    @functools.partial(jax.jit, donate_argnums=0)
    def chain(s):
        for _ in range(reps):
            s = fn(s)
        return s
    text = chain.lower(state).compile().as_text()
    entry = text[text.rfind("ENTRY"):]
    kinds = re.findall(r"= [^ ]+ (custom-call|fusion|copy|scatter|gather|while|dynamic-update-slice)\(", entry)
    return {k: kinds.count(k) for k in sorted(set(kinds))}, chain


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    quick = "--quick" in argv                                          # CPU smoke run: tiny sizes
    chains = "--chains" in argv     # the write ops and an empty launch as chains of 3 calls in one jit
    rng = np.random.default_rng(0)
    cfg = IndexerConfig(block_size=512, topk=64) if quick else IndexerConfig()
    tokens, n_req, b, rb, rctx, tk = (512, 4, 4, 2, 2048, (4, 2048, 64)) if quick else (
        32768, 64, 256, 64, 131072, (64, 131072, 512))
    calls = []
    layout, sc, pre, ends = tw.prefill(rng, tokens, n_req)
    ape = jnp.asarray(sc.ape)
    calls.append((f"compress {tokens // 1024}k", lambda c: ops.compress_prefill(c, layout, 0, pre["key"], pre["gate"], ape,
                                                                  pre["slot_mapping"], implementation="pallas"),
                  layout))
    calls.append((f"seed {tokens // 1024}k with ends", lambda c: ops.seed_tail(c, layout, 0, pre["key"], pre["gate"],
                                                                    pre["tslot"], request_ends_tokens=ends,
                                                                    implementation="pallas"), layout))
    dl = tw.CacheLayout(cfg, num_layers=1, num_blocks=b * 6 + 2)
    dctx = 4 * cfg.block_size - 8
    dsc = tw.Scenario.random(rng, dl, [dctx] * b)
    dape = jnp.asarray(dsc.ape)
    for nn in (1, 4):
        st = {k: jnp.asarray(v) for k, v in dsc.decode(staggered_starts(dctx, b, nn, cfg.kpool), [nn] * b, nn).items()}
        calls.append((f"decode B={b} n={nn}", lambda c, st=st: ops.decode_update(
            c, dl, 0, st["key"], st["gate"], dape, st["slot_mapping"], st["tslot"], st["positions"],
            implementation="pallas"), dl))
    rl, rcache, table, key, heads = br.read_case(cfg, rb, rctx)
    q8, w = br.queries(key, rb, 1, heads)
    ctx = jnp.full((rb, 1), rctx // cfg.kpool, jnp.int32)
    pos = jnp.full((rb, 1), rctx - 1, jnp.int32)
    read = [(f"paged_logits B={rb} {rctx // 1024}k", lambda: ops.paged_logits(rcache, rl, 0, q8, w, table, ctx,
                                                                 implementation="pallas")),
            (f"select_tokens B={rb} {rctx // 1024}k", lambda: ops.select_tokens(rcache, rl, 0, q8, w, table, pos,
                                                                  short_context=False, implementation="pallas"))]
    x = jax.random.normal(jax.random.PRNGKey(7), tk[:2], jnp.float32)
    lens = jnp.full(tk[:1], tk[1], jnp.int32)
    read.append((f"topk [{tk[0]},{tk[1]}] k={tk[2]}", lambda: ops.topk_pools(x, lens, tk[2], implementation="pallas")))

    if chains:
        from _timing import _empty_kernel  # noqa: E402
        from pallas_kernels.core import backend as B
        empty = jax.ShapeDtypeStruct((1024,), jnp.uint32)

        class _Tiny:
            @staticmethod
            def allocate(_):
                return jnp.zeros(empty.shape, empty.dtype)
        calls.append(("empty launch", lambda s: B.pallas_call(
            _empty_kernel, grid=(1,), out_shape=empty, input_output_aliases={0: 0}, interpret=None,
            name="empty", num_warps=1)(s), _Tiny))
        jitted = []
        for n, f, lay in calls:
            kinds, chain = chain_hlo_ops(f, lay.allocate(0))
            print(f"chain of 3 x {n}: compiled top-level ops {kinds}")
            jitted.append((n + " x3", chain, lay))
        read = []
    else:
        jitted = [(n, jax.jit(f, donate_argnums=0), lay) for n, f, lay in calls]
    caches = {}
    for n, f, lay in jitted:                              # compile + warm up
        caches[n] = jax.block_until_ready(f(lay.allocate(0)))
    rj = [(n, jax.jit(f)) for n, f in read]
    for n, f in rj:
        jax.block_until_ready(f())
    lib = cudart()
    if lib is not None:
        lib.cudaProfilerStart()
    for n, f, lay in jitted:
        caches[n] = jax.block_until_ready(f(caches[n]))
    for n, f in rj:
        jax.block_until_ready(f())
    if lib is not None:
        lib.cudaProfilerStop()
    print("profiled, in order:", ", ".join(n for n, _, _ in jitted + [(n, f, None) for n, f in rj]),
          "" if lib is not None else "(no libcudart found: the profiler range was not set)")


if __name__ == "__main__":
    main()
