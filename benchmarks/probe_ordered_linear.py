"""Launch-shape probe of the ordered contraction kernel (pallas_kernels/contractions/ordered_linear.py)
at the serving step's shapes (bench_scaleout's GPU workload: 2,064 step tokens), and of
its form reading K / V rows from a table (``ordered_linear_rows``: "rows p.v", "rows q.k").

Usage (GPU machine):
    PYTHONPATH=$PWD python benchmarks/probe_ordered_linear.py [--variants "4:32x64:4,16:32x64:4"] [--calls 10]

A variant is unroll:BMxBN:num_warps (BMxBN "auto": the kernel's default tile). The
bits cannot depend on the launch shape (each output is the same chain over K in the
same order); every variant's result is compared with the default's bit for bit before
it is timed, and a mismatch is reported instead of a time. Times are device spans
from a profiler trace (trace_read.trace_calls: each call behind a busy kernel),
median over the calls; the ratio is the default's span over the variant's.
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.contractions.ordered_linear import ordered_linear, ordered_linear_rows

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import trace_read as tr  # noqa: E402

# (name, x shape, w shape, w_transposed): the serving step's largest contractions
# (profile_step.py, session 20): the sparse attention's scores and weighted sum (one
# product per token over its 2,051 selected tokens), the LM head, the indexer's q.
SHAPES = (
    ("attention p.v", (2064, 8, 2051), (2064, 2051, 64), False),
    ("attention q.k", (2064, 8, 64), (2064, 2051, 64), True),
    ("lm head", (2064, 512), (512, 4096), False),
    ("q_b + indexer q", (2064, 256), (256, 4608), False),
)
# the attention's two contractions reading K / V rows from the cache (ordered_linear_rows,
# session 21): x shape, rows [T, W] into a table of TABLE_ROWS rows of 32 words (head_dim 64)
ROWS_SHAPES = (
    ("rows p.v", (2064, 8, 2051), False),
    ("rows q.k", (2064, 8, 64), True),
)
TABLE_ROWS = 2 * 64 * 64 * 2          # 2 layers x 64 blocks x 64 tokens x (K, V)


def parse_variant(v: str):
    unroll, tile, warps = v.split(":")
    tile = None if tile == "auto" else tuple(int(t) for t in tile.split("x"))
    return dict(unroll=int(unroll), tile=tile, num_warps=int(warps))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="4:auto:4,8:auto:4,16:auto:4,32:auto:4,16:auto:2,16:auto:8")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--shapes", default=None, help="comma-separated names of SHAPES (default: all)")
    a = ap.parse_args(argv)
    variants = [parse_variant(v) for v in a.variants.split(",")]
    busy, busy_arg = tr.busy_kernel(), np.zeros((16,), np.float32)
    print(f"probe_ordered_linear: {jax.default_backend()} {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(f"{'shape':<16} {'variant (unroll:tile:warps)':<28} {'span us':>10} {'vs default':>10}")
    rng = np.random.default_rng(0)
    ok = True
    wanted = None if a.shapes is None else set(a.shapes.split(","))
    cases = [(name, xs, ws, wt, False) for name, xs, ws, wt in SHAPES]
    cases += [(name, xs, None, wt, True) for name, xs, wt in ROWS_SHAPES]
    for name, xs, ws, wt, from_rows in cases:
        if wanted is not None and name not in wanted:
            continue
        x = jnp.asarray(rng.standard_normal(xs, np.float32), jnp.bfloat16)
        if from_rows:                   # finite bf16 pairs; about 1 % of the rows -1 (no token)
            w = jnp.asarray((rng.standard_normal((TABLE_ROWS, 64)) * 0.1).astype(jnp.bfloat16).view(np.uint32))
            rows = rng.integers(0, TABLE_ROWS, (xs[0], 2051)).astype(np.int32)
            rows[rng.random(rows.shape) < 0.01] = -1
            rows = jnp.asarray(rows)
        else:
            w = jnp.asarray(rng.standard_normal(ws, np.float32), jnp.bfloat16)
        ref, base = None, None
        for v in variants:
            if from_rows:
                f = jax.jit(lambda x, w, v=v: ordered_linear_rows(x, w, rows, w_transposed=wt, **v))
            else:
                f = jax.jit(lambda x, w, v=v: ordered_linear(x, w, mode="bf16", w_transposed=wt, **v))
            out = np.asarray(f(x, w))
            label = f"{v['unroll']}:{'auto' if v['tile'] is None else 'x'.join(map(str, v['tile']))}:{v['num_warps']}"
            if ref is None:
                ref = out
            elif not np.array_equal(out.view(np.uint32), ref.view(np.uint32)):
                ok = False
                print(f"{name:<16} {label:<28} {'BITS DIFFER':>10}")
                continue
            span = tr.summarize(tr.trace_calls(f, (x, w), a.calls, busy, busy_arg))["span_us"]
            base = span if base is None else base
            print(f"{name:<16} {label:<28} {span:>10.1f} {base / span:>9.2f}x", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
