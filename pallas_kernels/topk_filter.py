"""Kernel: the candidate filter of ``topk.topk_pools`` in filter mode (spec 2.5, 5.9).

One pass over the scores with a fixed per-row key floor (``topk_floor``): a
program owns one row and one chunk of CHUNK consecutive columns, loads it with
ONE load that does not wait for anything (unmasked: when n is a multiple of
CHUNK its columns are contiguous and in bounds, so it vectorises; otherwise the
columns past the array are clamped to its last column; the row length is applied
after the load), and keeps the candidates with ``order_key(score) >= floor`` and
id < length. It reserves
room for them in the row's candidate list with one atomic add on the row's
counter, then writes keys and ids at base + (exclusive cumsum of its keep mask).
The counter ends as the number of candidates of the row, which may exceed CAP:
an overflow, the list then holds only the CAP that got the lowest slots (the
select kernel then runs the exact streaming path on that row instead).

The order of the programs' reservations is up to the GPU, so the order of the
candidates in a list is not deterministic; their SET is, and the select ranks
them by (key desc, id asc) alone. On random rows the floor passes ~1.15 k keys
(k = 512 at 2048 run maxima: ~18 per 4096-column chunk).

Reads ONLY its inputs; writes ONLY its outputs: counts [rows] i32 (aliased to the
zeros the floor kernel wrote; every program of row r adds to counts[r] once),
keys [rows, CAP] u32 and ids [rows, CAP] i32 (each slot by the one program that
reserved it; slots past the count are left unwritten). Masked-out lanes touch no
memory.

Grid: (rows, splits), splits = ceil(n / CHUNK).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import _backend as B
from . import topk as tk


def _kernel(len_ref, floor_ref, x_ref, _cnt_in, cnt_ref, kl_ref, il_ref, *, n_cols: int, chunk: int,
            cap: int):
    # len_ref [rows] i32, floor_ref [rows] u32, x_ref [rows, n_cols] f32
    # cnt_ref [rows] i32 (zeros on entry, aliased), kl_ref [rows, CAP] u32, il_ref [rows, CAP] i32
    r, s = B.program_id(0), B.program_id(1)
    row = r + 0 * tk._iota((1,), 0)                                                 # [1]
    cols = s * chunk + tk._iota((1, chunk), 1)                                      # [1, CH] ids
    rows = row[:, None] + 0 * cols
    if n_cols % chunk == 0:                                                         # in bounds: one
        x = B.gather(x_ref, rows, cols)                                             # vector load
    else:                                                                           # clamped lanes
        x = B.gather(x_ref, rows, jnp.minimum(cols, n_cols - 1))                    # are dropped below
    hi = jnp.minimum(B.load(len_ref.at[row]), n_cols)                               # [1] valid ids < hi
    floor = B.load(floor_ref.at[row])                                               # [1] u32
    key = tk.order_key(x)                                                           # [1, CH] u32
    keep = (cols < hi[:, None]) & (key >= floor[:, None])                           # [1, CH]
    ki = keep.astype(jnp.int32)
    n_keep = jnp.sum(ki)                                                            # scalar
    base = B.atomic_add(cnt_ref, r, n_keep)                                         # scalar, before
    pos = base + jnp.cumsum(ki, axis=1) - ki                                        # [1, CH] slot
    put = keep & (pos < cap)
    slot = jnp.minimum(pos, cap - 1)
    B.scatter(kl_ref, rows, slot, key, put)
    B.scatter(il_ref, rows, slot, cols, put)


def filter_candidates(scores, lengths, floor, counts, *, chunk: int, cap: int, interpret=None,
                      num_warps: int = 4):
    """scores [rows, n] f32, lengths [rows] i32, floor [rows] u32, counts [rows] i32 (zeros) ->
    (counts [rows] i32, keys [rows, cap] u32, ids [rows, cap] i32)."""
    rows, n_cols = scores.shape
    for name, v in (("chunk", chunk), ("cap", cap)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"filter {name} must be a power of two, got {v}")
    splits = -(-n_cols // chunk)
    interpret = B.resolve_interpret(interpret)
    kern = functools.partial(_kernel, n_cols=n_cols, chunk=chunk, cap=cap)
    return B.pallas_call(
        kern, grid=(rows, splits),
        out_shape=(jax.ShapeDtypeStruct((rows,), jnp.int32),
                   jax.ShapeDtypeStruct((rows, cap), jnp.uint32),
                   jax.ShapeDtypeStruct((rows, cap), jnp.int32)),
        input_output_aliases={3: 0}, interpret=interpret, name="kpool_topk_filter", num_warps=num_warps,
    )(lengths.astype(jnp.int32), floor.astype(jnp.uint32), scores.astype(jnp.float32),
      counts.astype(jnp.int32))
