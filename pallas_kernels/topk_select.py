"""Kernel: the final select of ``topk.topk_pools`` in filter mode (spec 2.5, 5.9).

PARTS programs per row (so that a few rows still fill the GPU) each read the row's candidate lists (``topk_filter``: SPLITS
lists of CAP slots, each in ascending id order, lists in split order, so the
[1, SLOTS] tile of slot j = s * CAP + c is in ascending id order over its live
slots), finds the exact k-th best key with the radix search ``topk.kth_key``,
keeps the keys above it plus the lowest-id ties (``topk.keep_top_k``), squeezes
those <= k survivors into the program's scratch lists in id order, and writes
the ids of its share of them (every PARTS-th tile of survivors) at their ranks
(``topk.emit_sorted``: #better + #equal-with-lower-id); part 0 writes -1 for the
slots a row with fewer than k valid candidates leaves. The PARTS programs of a
row repeat the same search and squeeze (on the same inputs, so they agree) and
write disjoint output slots.

Only valid for a row whose lists did not overflow (count <= CAP): the caller
takes the streaming path's result for the others.

Reads ONLY its inputs; writes ONLY its outputs: ids [rows, k] i32 and the
program's private scratch, keys [rows * PARTS, KP] u32 and ids [rows * PARTS, KP]
i32 (KP = k rounded up to a power of two). Masked-out lanes touch no memory.

Grid: (rows, PARTS).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import _backend as B
from . import topk as tk


def _kernel(cnt_ref, kl_ref, il_ref, out_ref, ks_ref, is_ref, *,
            g: tk.Geometry, splits: int, cap: int, slots: int, parts: int, interpret: bool):
    # cnt_ref [rows, splits] i32, kl_ref [rows, splits * CAP] u32, il_ref [rows, splits * CAP] i32
    # out_ref [rows, k] i32; ks_ref [rows * PARTS, KP] u32, is_ref [rows * PARTS, KP] i32 (scratch)
    r, part = B.program_id(0), B.program_id(1)
    row = r + 0 * tk._iota((1,), 0)                                                 # [1]
    srow = row * parts + part                                                       # [1] scratch row
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
    srows = srow[:, None] + 0 * j
    B.scatter(ks_ref, srows, pos, key, keep)
    B.scatter(is_ref, srows, pos, ids, keep)
    n_keep = jnp.sum(ki, axis=1)                                                    # [1]
    tk.emit_sorted(g, ks_ref, is_ref, srow, n_keep, out_ref, row, row >= 0, interpret,   # barrier first
                   part=part, parts=parts)


SELECT_PROGRAMS = 264      # programs the select aims for (2 per SM of an H200): PARTS = this / rows


def select_parts(rows: int, k: int) -> int:
    """Programs per row: enough for SELECT_PROGRAMS in all, at most one per rank tile."""
    g = tk.Geometry(k=k, bn=1, ch=1)
    return max(1, min(g.kp // g.ti, -(-SELECT_PROGRAMS // max(rows, 1))))


def select_candidates(counts, keys, ids, k: int, *, interpret=None, num_warps: int = tk.ROW_WARPS,
                      parts: int | None = None):
    """counts [rows, splits] i32 (each <= CAP), keys [rows, splits * CAP] u32,
    ids [rows, splits * CAP] i32 -> [rows, k] i32: best ids by (key desc, id asc), -1 padded.
    parts: programs per row (default ``select_parts``)."""
    rows, splits = counts.shape
    cap = keys.shape[1] // splits
    if cap * splits != keys.shape[1] or cap & (cap - 1):
        raise ValueError(f"bad candidate lists: {keys.shape} for {splits} splits")
    g = tk.Geometry(k=k, bn=1, ch=1)
    parts = select_parts(rows, k) if parts is None else int(parts)
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    slots = tk.next_pow2(splits) * cap
    interpret = B.resolve_interpret(interpret)
    kern = functools.partial(_kernel, g=g, splits=splits, cap=cap, slots=slots, parts=parts,
                             interpret=interpret)
    out, _, _ = B.pallas_call(
        kern, grid=(rows, parts),
        out_shape=(jax.ShapeDtypeStruct((rows, k), jnp.int32),
                   jax.ShapeDtypeStruct((rows * parts, g.kp), jnp.uint32),
                   jax.ShapeDtypeStruct((rows * parts, g.kp), jnp.int32)),
        input_output_aliases={}, interpret=interpret, name="kpool_topk_select", num_warps=num_warps,
    )(counts, keys, ids)
    return out
