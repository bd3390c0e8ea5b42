"""Kernel: the candidate filter of ``topk.topk_pools`` in filter mode (spec 2.5, 5.9).

One pass over the scores with a fixed per-row key floor (``topk_floor``): a
program owns one row and one span of SPAN consecutive columns, loads it in
SPAN / CHUNK vector loads of CHUNK scores, and keeps the candidates with
``order_key(score) >= floor`` and id < length. They go to the program's private
list of CAP slots (keys u32, ids i32) at positions from a cumsum, so a list is
in ascending id order; the program then writes how many candidates it found.
That count may exceed CAP: an overflow marker, the list then holds only the first
CAP (the caller falls back to the exact streaming path). No compaction, no
threshold: the floor alone decides, so on random rows only ~0.6 k keys of a row
pass (k = 512 at 4 k run maxima: ~18 per 4096-column span).

Reads ONLY its inputs; writes ONLY its outputs, each slot by one program:
counts [rows, splits] i32, keys [rows, splits * CAP] u32, ids [rows, splits * CAP]
i32 (list s of row r: columns s * CAP .. s * CAP + CAP - 1; slots past the count
are left unwritten). Masked-out lanes touch no memory.

Grid: (rows, splits), splits = ceil(n / SPAN).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from . import _backend as B
from . import topk as tk


def _kernel(len_ref, floor_ref, x_ref, cnt_ref, kl_ref, il_ref, *,
            n_cols: int, span: int, chunk: int, cap: int):
    # len_ref [rows] i32, floor_ref [rows] u32, x_ref [rows, n_cols] f32
    # cnt_ref [rows, splits] i32, kl_ref [rows, splits * CAP] u32, il_ref [rows, splits * CAP] i32
    r, s = B.program_id(0), B.program_id(1)
    row = r + 0 * tk._iota((1,), 0)                                                 # [1]
    split = s + 0 * row                                                             # [1]
    on = row >= 0                                                                   # [1] True
    hi = jnp.minimum(B.load(len_ref.at[row], mask=on, other=0), n_cols)             # [1] valid ids < hi
    floor = B.load(floor_ref.at[row], mask=on, other=0)                             # [1] u32
    hi_s = jnp.max(hi)                                                              # scalar
    lo = s * span                                                                   # first column

    def body(c, count):                                                             # count [1] i32
        start = lo + c * chunk
        cols = start + tk._iota((1, chunk), 1)                                      # [1, CH] ids
        rows = row[:, None] + 0 * cols
        valid = cols < hi[:, None]
        x = lax.cond(start + chunk <= hi_s,                                         # whole chunk valid:
                     lambda: B.gather(x_ref, rows, cols),                           # unmasked load
                     lambda: B.gather(x_ref, rows, jnp.minimum(cols, n_cols - 1), mask=valid, other=0.0))
        key = tk.order_key(x)                                                       # [1, CH] u32
        keep = valid & (key >= floor[:, None])
        ki = keep.astype(jnp.int32)
        pos = count[:, None] + jnp.cumsum(ki, axis=1) - ki                          # slot in the list
        put = keep & (pos < cap)
        slot = s * cap + jnp.minimum(pos, cap - 1)
        B.scatter(kl_ref, rows, slot, key, put)
        B.scatter(il_ref, rows, slot, cols, put)
        return count + jnp.sum(ki, axis=1)

    count = jnp.zeros((1,), jnp.int32)
    n_loads = span // chunk
    count = body(0, count) if n_loads == 1 else lax.fori_loop(0, n_loads, body, count)
    B.scatter(cnt_ref, row, split, count, on)                                       # may exceed CAP


def filter_candidates(scores, lengths, floor, *, span: int, chunk: int, cap: int, interpret=None,
                      num_warps: int = 4):
    """scores [rows, n] f32, lengths [rows] i32, floor [rows] u32 ->
    (counts [rows, splits] i32, keys [rows, splits * cap] u32, ids [rows, splits * cap] i32)."""
    rows, n_cols = scores.shape
    for name, v in (("span", span), ("chunk", chunk), ("cap", cap)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"filter {name} must be a power of two, got {v}")
    if chunk > span:
        raise ValueError(f"filter chunk {chunk} > span {span}")
    splits = -(-n_cols // span)
    interpret = B.resolve_interpret(interpret)
    kern = functools.partial(_kernel, n_cols=n_cols, span=span, chunk=chunk, cap=cap)
    return B.pallas_call(
        kern, grid=(rows, splits),
        out_shape=(jax.ShapeDtypeStruct((rows, splits), jnp.int32),
                   jax.ShapeDtypeStruct((rows, splits * cap), jnp.uint32),
                   jax.ShapeDtypeStruct((rows, splits * cap), jnp.int32)),
        input_output_aliases={}, interpret=interpret, name="kpool_topk_filter", num_warps=num_warps,
    )(lengths.astype(jnp.int32), floor.astype(jnp.uint32), scores.astype(jnp.float32))
