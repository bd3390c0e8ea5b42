"""Kernel: the final select of ``topk.topk_pools`` in filter mode (spec 2.5, 5.9).

One program per row reads the row's candidate lists (``topk_filter``: SPLITS
lists of CAP slots, each in ascending id order, lists in split order, so the
[1, SLOTS] tile of slot j = s * CAP + c is in ascending id order over its live
slots), finds the exact k-th best key with the radix search ``topk.kth_key``,
keeps the keys above it plus the lowest-id ties (``topk.keep_top_k``), squeezes
those <= k survivors into the row's scratch lists in id order, and writes their
ids sorted by rank (``topk.emit_sorted``: #better + #equal-with-lower-id), then
-1 for the slots a row with fewer than k valid candidates leaves.

Only valid when no list overflowed (count <= CAP everywhere): the caller checks
that and runs the streaming path instead otherwise.

Reads ONLY its inputs; writes ONLY its outputs: ids [rows, k] i32 and the row's
private scratch, keys [rows, KP] u32 and ids [rows, KP] i32 (KP = k rounded up
to a power of two). Masked-out lanes touch no memory.

Grid: (rows,), one program per row.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import _backend as B
from . import topk as tk


def _kernel(cnt_ref, kl_ref, il_ref, out_ref, ks_ref, is_ref, *,
            g: tk.Geometry, splits: int, cap: int, slots: int, interpret: bool):
    # cnt_ref [rows, splits] i32, kl_ref [rows, splits * CAP] u32, il_ref [rows, splits * CAP] i32
    # out_ref [rows, k] i32; ks_ref [rows, KP] u32, is_ref [rows, KP] i32 (scratch)
    r = B.program_id(0)
    row = r + 0 * tk._iota((1,), 0)                                                 # [1]
    j = tk._iota((1, slots), 1)                                                     # [1, SLOTS] slot
    split, col = j // cap, j % cap                                                  # list, slot in it
    rows = row[:, None] + 0 * j
    in_list = split < splits
    n_list = B.gather(cnt_ref, rows, jnp.minimum(split, splits - 1), mask=in_list, other=0)
    live = in_list & (col < jnp.minimum(n_list, cap))                               # [1, SLOTS]
    jc = jnp.minimum(j, splits * cap - 1)
    key = B.gather(kl_ref, rows, jc, mask=live, other=0)                            # [1, SLOTS] u32
    ids = B.gather(il_ref, rows, jc, mask=live, other=0)                            # [1, SLOTS] i32
    keep, _ = tk.keep_top_k(key, live, g.k)                                         # <= k, id order
    ki = keep.astype(jnp.int32)
    pos = jnp.cumsum(ki, axis=1) - ki                                               # < k where keep
    pos = jnp.minimum(pos, g.kp - 1)
    B.scatter(ks_ref, rows, pos, key, keep)
    B.scatter(is_ref, rows, pos, ids, keep)
    n_keep = jnp.sum(ki, axis=1)                                                    # [1]
    tk.emit_sorted(g, ks_ref, is_ref, row, n_keep, out_ref, row, row >= 0, interpret)   # barrier first


def select_candidates(counts, keys, ids, k: int, *, interpret=None, num_warps: int = tk.ROW_WARPS):
    """counts [rows, splits] i32 (each <= CAP), keys [rows, splits * CAP] u32,
    ids [rows, splits * CAP] i32 -> [rows, k] i32: best ids by (key desc, id asc), -1 padded."""
    rows, splits = counts.shape
    cap = keys.shape[1] // splits
    if cap * splits != keys.shape[1] or cap & (cap - 1):
        raise ValueError(f"bad candidate lists: {keys.shape} for {splits} splits")
    g = tk.Geometry(k=k, bn=1, ch=1)
    slots = tk.next_pow2(splits) * cap
    interpret = B.resolve_interpret(interpret)
    kern = functools.partial(_kernel, g=g, splits=splits, cap=cap, slots=slots, interpret=interpret)
    out, _, _ = B.pallas_call(
        kern, grid=(rows,),
        out_shape=(jax.ShapeDtypeStruct((rows, k), jnp.int32),
                   jax.ShapeDtypeStruct((rows, g.kp), jnp.uint32),
                   jax.ShapeDtypeStruct((rows, g.kp), jnp.int32)),
        input_output_aliases={}, interpret=interpret, name="kpool_topk_select", num_warps=num_warps,
    )(counts, keys, ids)
    return out
