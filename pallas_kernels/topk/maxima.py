"""Kernel: the run maxima of ``topk.topk_pools``'s key floor (docs/semantics.md 2.5, 5.9).

Same value as ``common.run_maxima`` (the XLA reduce), bit for bit: a row's columns
are cut into M runs of RUN consecutive columns (``common.run_geometry``: RUN a power
of two), and entry m is the largest ``order_key`` of a valid column (id < the
row's length) of run m, 0 when the run holds none. A program owns one row and G
consecutive runs: one [G, RUN] load, the key, a max along the run. When the runs
tile the row (n == M * RUN, e.g. [64, 131072] at 4096 runs of 32, or the 8352
pools of a 32k-token decode row at 1044 runs of 8) every lane is in bounds, so the
load needs no mask and does not wait for the row's length. When the runs tile the
row but not the programs (a decode row of 32,832 pools: 4,104 runs of 8, 9 programs
of 512 runs) only whole runs past the last are masked, per run, so the lanes of a
run stay one vectorised load (Nsight Compute at decode B = 64 x 128k: 6.4 us and
1.19M instructions, against 6.7 us and 1.94M with the per-lane mask of the general
case). Otherwise (runs that straddle the row's end) every lane is masked.

Reads ONLY its inputs; writes ONLY its output: top [rows, M] u32, each entry by
the one program that owns its run. Grid: (rows, ceil(M / G)).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..core import backend as B
from . import common as tk

TILE = 4096             # scores per program (G * RP)


def _kernel(len_ref, x_ref, top_ref, *, n_cols: int, m: int, run: int, rp: int, g: int):
    # len_ref [rows] i32, x_ref [rows, n_cols] f32, top_ref [rows, M] u32
    r, q = B.program_id(0), B.program_id(1)
    row = r + 0 * tk._iota((1,), 0)                                                 # [1]
    i = q * g + tk._iota((g, 1), 0)                                                 # [G, 1] run ids
    cols = i * run + tk._iota((1, rp), 1)                                           # [G, RP] ids
    rows = row[:, None] + 0 * cols
    if n_cols == m * run and m % g == 0:
        x = B.gather(x_ref, rows, cols)                                             # in bounds
    elif n_cols == m * run:                             # whole runs; the last program's tail runs
        i_in = jnp.minimum(i, m - 1)                    # (>= M) masked per run, so the lanes of a
        cols = i_in * run + tk._iota((1, rp), 1)        # run stay one vectorised load
        x = B.gather(x_ref, rows, cols, mask=(i < m) & (cols >= 0), other=0.0)
    else:
        inb = (cols < (i + 1) * run) & (cols < n_cols)
        x = B.gather(x_ref, rows, jnp.minimum(cols, n_cols - 1), mask=inb, other=0.0)
    hi = jnp.minimum(B.load(len_ref.at[row]), n_cols)                               # [1]
    valid = (cols < (i + 1) * run) & (cols < hi[:, None])
    key = jnp.where(valid, tk.order_key(x), jnp.uint32(0))                          # [G, RP]
    top = jnp.max(key, axis=1, keepdims=True)                                       # [G, 1]
    B.scatter(top_ref, row[:, None] + 0 * i, jnp.minimum(i, m - 1), top, i < m)


def run_maxima(scores, lengths, buckets: int, *, interpret=None, num_warps: int = 4):
    """scores [rows, n] f32, lengths [rows] i32 -> [rows, M] u32, == ``common.run_maxima``."""
    rows, n_cols = scores.shape
    run, m = tk.run_geometry(n_cols, buckets)
    g = max(1, min(tk.next_pow2(m), TILE // run))
    interpret = B.resolve_interpret(interpret)
    kern = functools.partial(_kernel, n_cols=n_cols, m=m, run=run, rp=run, g=g)
    return B.pallas_call(
        kern, grid=(rows, -(-m // g)),
        out_shape=jax.ShapeDtypeStruct((rows, m), jnp.uint32),
        input_output_aliases={}, interpret=interpret, name="kpool_topk_maxima", num_warps=num_warps,
    )(lengths.astype(jnp.int32), scores.astype(jnp.float32))
