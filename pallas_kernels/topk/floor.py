"""Kernel: the key floor of ``topk.topk_pools`` in filter mode (docs/semantics.md 2.5, 5.9).

Same value as ``common.bucket_floor(..., bits)``, bit for bit: per row, the k-th
largest of the row's M run maxima (``maxima``, a Pallas pass over the
scores equal to the XLA ``common.run_maxima``) with its low 32 - bits bits cleared,
so at least k valid keys of the row are >= it (k different runs each hold one);
0 when fewer than k runs hold a valid key. ``bucket_floor`` finds it with an XLA
sort of [rows, M]; this kernel with the radix search ``common.kth_key`` over the
top `bits` bits on one [1, MP] tile per row (MP = M rounded up to a power of two,
the padding lanes dead).

With the floor it writes what the filter kernel needs: the ids of the runs whose
maximum is >= the floor, ascending (only those runs hold a key >= the floor: ~k
of the M = 8 k runs on random rows, so the filter reads an eighth of the
scores), their number, and the zeros that the filter's per-row candidate
counters start from (so that they cost no launch of their own).

Reads ONLY its input (the run maxima); writes ONLY its outputs, row r by program
r: floor [rows] u32, zeros [rows] i32, runs [rows, MP] i32 (slots past the
number left unwritten), n_runs [rows] i32. Grid: (rows,).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..core import backend as B
from . import common as tk


def _kernel(top_ref, floor_ref, cnt_ref, runs_ref, nruns_ref, *, k: int, m: int, mp: int, radix_bits: int,
            bits: int):
    # top_ref [rows, M] u32 run maxima -> floor_ref [rows] u32, cnt_ref [rows] i32 (zeros),
    # runs_ref [rows, MP] i32, nruns_ref [rows] i32
    r = B.program_id(0)
    row = r + 0 * tk._iota((1,), 0)                                                 # [1]
    cols = tk._iota((1, mp), 1)                                                     # [1, MP] run ids
    rows = row[:, None] + 0 * cols
    if mp == m:
        live = cols >= 0
        top = B.gather(top_ref, rows, cols)                                         # [1, MP]
    else:
        live = cols < m
        top = B.gather(top_ref, rows, jnp.minimum(cols, m - 1), mask=live, other=0)
    floor = tk.kth_key(top, live, k, radix_bits, bits, skip_prefix=True)             # [1]
    reach = live & (top >= floor[:, None])                                          # [1, MP]
    ri = reach.astype(jnp.int32)
    B.scatter(runs_ref, rows, jnp.cumsum(ri, axis=1) - ri, cols, reach)
    on = row >= 0
    B.store(nruns_ref.at[row], jnp.sum(ri, axis=1), mask=on)
    B.store(cnt_ref.at[row], jnp.zeros((1,), jnp.int32), mask=on)
    B.store(floor_ref.at[row], floor, mask=on)


def floor_of_maxima(top, k: int, *, bits: int = 32, radix_bits: int = tk.RADIX_BITS, interpret=None,
                    num_warps: int = tk.ROW_WARPS):
    """top [rows, M] u32 (M >= k) -> (floor [rows] u32: the k-th largest entry of each row,
    its low 32 - bits bits cleared; zeros [rows] i32; runs [rows, MP] i32: the ids of the
    entries >= the floor, ascending; n_runs [rows] i32: how many)."""
    rows, m = top.shape
    if m < k:
        raise ValueError(f"floor needs at least k = {k} run maxima per row, got {m}")
    mp = tk.next_pow2(m)
    interpret = B.resolve_interpret(interpret)
    kern = functools.partial(_kernel, k=k, m=m, mp=mp, radix_bits=radix_bits, bits=bits)
    return B.pallas_call(
        kern, grid=(rows,),
        out_shape=(jax.ShapeDtypeStruct((rows,), jnp.uint32), jax.ShapeDtypeStruct((rows,), jnp.int32),
                   jax.ShapeDtypeStruct((rows, mp), jnp.int32), jax.ShapeDtypeStruct((rows,), jnp.int32)),
        input_output_aliases={}, interpret=interpret, name="kpool_topk_floor", num_warps=num_warps,
    )(top.astype(jnp.uint32))
