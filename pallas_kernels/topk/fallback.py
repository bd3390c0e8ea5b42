"""Kernel: the exact streaming top-k of the rows whose candidate list overflowed
(filter mode of ``topk.topk_pools``; docs/semantics.md 2.5, 5.9).

Filter mode's select (``select``) ranks a row's candidate list; a row whose
count exceeds the list's CAP slots (skewed or tied rows: more keys >= the floor
than fit) is left to this kernel. Program r reads row r's count and returns at
once unless it overflowed; then it streams the row's scores through the exact
filter of ``common.stream`` (prefiltered at the same floor, so every key of the top
k passes) and writes the row's ids by ``common.emit_sorted``: (key desc, id asc),
-1 padded. A separate launch because Triton sizes a kernel's registers for its
largest path: inside the select, this path cost the select its occupancy.

Reads ONLY its inputs; writes ONLY its outputs: the overflowed rows of ids
[rows, k] i32 (aliased to the select's result, whose other rows it leaves as they
are) and its buffers [rows, CAP_S] u32 / i32 (row r private to program r).

Grid: (rows,).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..core import backend as B
from . import common as tk

FALLBACK_CHUNK = 2048   # scores per step of the streaming path on an overflowed row


def _kernel(len_ref, floor_ref, x_ref, cnt_ref, _ids_in, out_ref, kb_ref, ib_ref, *, cap: int, gf: tk.Geometry,
            n_cols: int, interpret: bool):
    # len_ref [rows] i32, floor_ref [rows] u32, x_ref [rows, n_cols] f32, cnt_ref [rows] i32;
    # out_ref [rows, k] i32 (aliased to _ids_in); kb_ref / ib_ref [rows, CAP_S]
    row = B.program_id(0) + 0 * tk._iota((1,), 0)                                   # [1]

    @B.when(jnp.max(B.load(cnt_ref.at[row])) > cap)
    def _stream():
        length = jnp.minimum(B.load(len_ref.at[row]), n_cols)                       # [1]
        hi = jnp.max(length)
        init = tk.prefilter_state(1, B.load(floor_ref.at[row]))
        produce = tk.score_producer(gf, x_ref, row, length, 0, hi, n_cols)
        st = tk.stream(gf, kb_ref, ib_ref, row, (hi + gf.ch - 1) // gf.ch, produce, interpret, init)
        tk.emit_sorted(gf, kb_ref, ib_ref, row, st[0], out_ref, row, row >= 0, interpret)


def stream_overflowed(scores, lengths, floor, counts, ids, *, cap: int, interpret=None):
    """scores [rows, n] f32, lengths [rows] i32, floor [rows] u32, counts [rows] i32 (the
    filter's), ids [rows, k] i32 (the select's) -> ids with every row whose count > cap
    replaced by its exact top k, the other rows unchanged."""
    rows, n_cols = scores.shape
    k = ids.shape[1]
    gf = tk.Geometry(k=k, bn=1, ch=min(FALLBACK_CHUNK, tk.next_pow2(n_cols)))
    interpret = B.resolve_interpret(interpret)
    kern = functools.partial(_kernel, cap=cap, gf=gf, n_cols=n_cols, interpret=interpret)
    out, _, _ = B.pallas_call(
        kern, grid=(rows,),
        out_shape=(jax.ShapeDtypeStruct((rows, k), jnp.int32),) + tk.buffer_shapes(gf, rows),
        input_output_aliases={4: 0}, interpret=interpret, name="kpool_topk_fallback", num_warps=4,
    )(lengths.astype(jnp.int32), floor.astype(jnp.uint32), scores.astype(jnp.float32),
      counts.astype(jnp.int32), ids.astype(jnp.int32))
    return out
