"""Kernel: the candidate filter of ``topk.topk_pools`` in filter mode (docs/semantics.md 2.5, 5.9).

Given the row's key floor and the runs whose maximum reaches it (``floor``:
a row's columns are cut into M runs of RUN consecutive columns, and only a run
whose maximum is >= the floor can hold a key >= the floor), a program owns G
entries of one row's run list: one [G, RUN] load of those runs (RUN a power of
two, ``common.run_geometry``; the lanes of a run are contiguous, so the load
vectorises along them; list entries past the row's count are masked off), and it keeps the
candidates with ``order_key(score) >= floor`` and id < length. It reserves room
for them in the row's candidate list with one atomic add on the row's counter,
then writes keys and ids at base + (the candidates of its earlier runs) + (the
candidates earlier in the same run). The counter ends as the number of candidates
of the row, which may exceed CAP: an overflow, the list then holds only the CAP
that got the lowest slots (the select kernel then runs the exact streaming path
on that row instead).

On random rows ~k of the M = 8 k runs reach the floor, so the filter reads about
an eighth of the scores, and ~1.1 k keys pass. Programs past the row's run
count read the count and return.

The order of the programs' reservations is up to the GPU, so the order of the
candidates in a list is not deterministic; their SET is, and the select ranks
them by (key desc, id asc) alone.

Reads ONLY its inputs; writes ONLY its outputs: counts [rows] i32 (aliased to the
zeros the floor kernel wrote; every program of row r with runs adds to counts[r]
once), keys [rows, CAP] u32 and ids [rows, CAP] i32 (each slot by the one
program that reserved it; slots past the count are left unwritten). Masked-out
lanes touch no memory.

Grid: (rows, ceil(MP / G)).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..core import backend as B
from . import common as tk

TILE = 4096             # scores per program (G * RP)


def _kernel(len_ref, floor_ref, x_ref, runs_ref, nruns_ref, _cnt_in, cnt_ref, kl_ref, il_ref, *,
            n_cols: int, m: int, run: int, rp: int, g: int, mp: int, cap: int):
    # len_ref [rows] i32, floor_ref [rows] u32, x_ref [rows, n_cols] f32, runs_ref [rows, MP] i32,
    # nruns_ref [rows] i32; cnt_ref [rows] i32 (zeros on entry, aliased), kl_ref [rows, CAP] u32,
    # il_ref [rows, CAP] i32
    r, q = B.program_id(0), B.program_id(1)
    row = r + 0 * tk._iota((1,), 0)                                                 # [1]
    n_runs = jnp.max(B.load(nruns_ref.at[row]))                                     # scalar

    @B.when(q * g < n_runs)
    def _filter():
        e = q * g + tk._iota((g, 1), 0)                                             # [G, 1] list entries
        has = e < n_runs
        rid = B.gather(runs_ref, row[:, None] + 0 * e, jnp.minimum(e, mp - 1), mask=has, other=0)
        j = tk._iota((1, rp), 1)                                                    # [1, RP]
        cols = rid * run + j                                                        # [G, RP] ids
        rows = row[:, None] + 0 * cols
        if n_cols == m * run and rp == run:                                         # runs tile the row:
            inb = has & (j >= 0)                                                    # mask per run only,
            x = B.gather(x_ref, rows, cols, mask=inb, other=0.0)                    # contiguous lanes
        else:
            inb = has & (j < run) & (cols < n_cols)
            x = B.gather(x_ref, rows, jnp.minimum(cols, n_cols - 1), mask=inb, other=0.0)
        hi = jnp.minimum(B.load(len_ref.at[row]), n_cols)                           # [1]
        floor = B.load(floor_ref.at[row])                                           # [1] u32
        key = tk.order_key(x)                                                       # [G, RP] u32
        keep = inb & (cols < hi[:, None]) & (key >= floor[:, None])
        ki = keep.astype(jnp.int32)
        per_run = jnp.sum(ki, axis=1, keepdims=True)                                # [G, 1]
        base = B.atomic_add(cnt_ref, r, jnp.sum(per_run))                           # scalar, before
        pos = base + (jnp.cumsum(per_run, axis=0) - per_run) + (jnp.cumsum(ki, axis=1) - ki)
        put = keep & (pos < cap)
        slot = jnp.minimum(pos, cap - 1)
        B.scatter(kl_ref, rows, slot, key, put)
        B.scatter(il_ref, rows, slot, cols, put)


def filter_candidates(scores, lengths, floor, counts, runs, n_runs, buckets: int, *, cap: int,
                      interpret=None, num_warps: int = 4):
    """scores [rows, n] f32, lengths [rows] i32, and from ``floor``: floor [rows] u32,
    counts [rows] i32 (zeros), runs [rows, MP] i32, n_runs [rows] i32, over the runs of
    ``common.run_geometry(n, buckets)`` -> (counts [rows] i32, keys [rows, cap] u32, ids [rows, cap] i32)."""
    rows, n_cols = scores.shape
    if cap < 1 or cap & (cap - 1):
        raise ValueError(f"filter cap must be a power of two, got {cap}")
    run, m = tk.run_geometry(n_cols, buckets)
    rp = run
    mp = runs.shape[1]
    g = max(1, min(mp, TILE // rp))
    interpret = B.resolve_interpret(interpret)
    kern = functools.partial(_kernel, n_cols=n_cols, m=m, run=run, rp=rp, g=g, mp=mp, cap=cap)
    return B.pallas_call(
        kern, grid=(rows, -(-mp // g)),
        out_shape=(jax.ShapeDtypeStruct((rows,), jnp.int32),
                   jax.ShapeDtypeStruct((rows, cap), jnp.uint32),
                   jax.ShapeDtypeStruct((rows, cap), jnp.int32)),
        input_output_aliases={5: 0}, interpret=interpret, name="kpool_topk_filter", num_warps=num_warps,
    )(lengths.astype(jnp.int32), floor.astype(jnp.uint32), scores.astype(jnp.float32),
      runs.astype(jnp.int32), n_runs.astype(jnp.int32), counts.astype(jnp.int32))
