"""Kernel: the final select of ``topk.topk_pools`` in filter mode (spec 2.5, 5.9).

PARTS programs per row. Each reads the row's candidate list (``topk_filter``: the
row's count and its first min(count, CAP) slots, in no particular order) into one
[1, CAP] tile and picks the k best by (key desc, id asc):

  * the k-th best key ``thr`` by the radix search ``topk.kth_key``;
  * every key above it, plus the lowest-id ties at ``thr`` (a second radix
    search, over the ids, runs only when there are more ties than room);
  * those m = min(k, count) survivors go to the program's private scratch row,
    and program t ranks survivors t * TS .. t * TS + TS - 1 (TS = KP / PARTS)
    against all m: rank = #(key greater) + #(key equal, id lower), and writes
    out[r, rank] = id. It also writes -1 to its share of the slots m .. k - 1.

So the ids come out sorted by rank, and the result does not depend on the order
in which the filter's programs filled the list. Every part repeats the radix
search (cheap next to the rank) so that no part waits for another.

When the row's count exceeds CAP (the list overflowed: skewed or tied rows), part
0 instead runs the exact streaming path (``topk.stream`` over the row's scores
with the same floor, then ``topk.emit_sorted``) and the other parts do nothing:
no host round trip, no second launch.

Reads ONLY its inputs; writes ONLY its outputs: ids [rows, k] i32, the survivor
scratch keys [rows * PARTS, KP] u32 and ids [rows * PARTS, KP] i32 (row
r * PARTS + t private to program (r, t)), and the streaming path's buffers
[rows, CAP_S] u32 / i32 (row r private to program (r, 0)). Masked-out lanes touch
no memory.

Grid: (rows, PARTS).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from . import _backend as B
from . import topk as tk

RANK_TILE = 8192        # TS * TJ comparisons per step of the rank loop
FALLBACK_CHUNK = 2048   # scores per step of the streaming path on an overflowed row


def keep_best(key, ids, live, k: int, radix_bits: int):
    """[BN, C] bool: the min(k, #live) best `live` entries of key [BN, C] u32 by
    (key desc, id asc); ids [BN, C] i32 are distinct, in any order."""
    thr = tk.kth_key(key, live, k, radix_bits)                                      # [BN]; 0: < k live
    gt = live & (key > thr[:, None])
    eq = live & (key == thr[:, None])
    need = k - jnp.sum(gt.astype(jnp.int32), axis=1)                                # [BN] ties to keep
    extra = jnp.max(jnp.sum(eq.astype(jnp.int32), axis=1) - need)

    def lowest_ids():                                                               # need-th lowest id
        idk = jnp.uint32(0xFFFFFFFF) - ids.astype(jnp.uint32)                       # larger = lower id
        return eq & (idk >= tk.kth_key(idk, eq, need, radix_bits)[:, None])

    return gt | lax.cond(extra > 0, lowest_ids, lambda: eq)


def _kernel(len_ref, floor_ref, x_ref, cnt_ref, kl_ref, il_ref, out_ref, ks_ref, is_ref, kb_ref, ib_ref,
            *, k: int, cap: int, parts: int, ts: int, tj: int, radix_bits: int, gf: tk.Geometry,
            n_cols: int, interpret: bool):
    # len_ref [rows] i32, floor_ref [rows] u32, x_ref [rows, n_cols] f32 (read on overflow only)
    # cnt_ref [rows] i32, kl_ref [rows, CAP] u32, il_ref [rows, CAP] i32
    # out_ref [rows, k] i32; ks_ref / is_ref [rows * PARTS, KP] scratch; kb_ref / ib_ref [rows, CAP_S]
    r, t = B.program_id(0), B.program_id(1)
    row = r + 0 * tk._iota((1,), 0)                                                 # [1]
    count = B.load(cnt_ref.at[row])                                                 # [1]
    over = jnp.max(count) > cap

    @B.when(jnp.logical_not(over))
    def _select():
        j = tk._iota((1, cap), 1)                                                   # [1, CAP] slot
        rows = row[:, None] + 0 * j
        live = j < count[:, None]
        key = B.gather(kl_ref, rows, j, mask=live, other=0)                         # [1, CAP] u32
        ids = B.gather(il_ref, rows, j, mask=live, other=0)                         # [1, CAP] i32
        keep = keep_best(key, ids, live, k, radix_bits)                             # min(k, count) set
        ki = keep.astype(jnp.int32)
        pos = jnp.minimum(jnp.cumsum(ki, axis=1) - ki, ts * parts - 1)              # < k where keep
        prow = (r * parts + t) + 0 * j                                              # private scratch
        B.scatter(ks_ref, prow, pos, key, keep)
        B.scatter(is_ref, prow, pos, ids, keep)
        m = jnp.sum(ki)                                                             # scalar survivors
        si = t * ts + tk._iota((ts, 1), 0)                                          # [TS, 1] mine
        sr = (r * parts + t) + 0 * si
        tail = (si >= m) & (si < k)
        B.scatter(out_ref, row[:, None] + 0 * si, jnp.minimum(si, k - 1), jnp.full((ts, 1), -1, jnp.int32),
                  tail)

        @B.when(t * ts < m)
        def _rank():
            B.barrier(interpret)                                                    # scratch visible
            mine = si < m
            k_i = B.gather(ks_ref, sr, si, mask=mine, other=0)                      # [TS, 1]
            id_i = B.gather(is_ref, sr, si, mask=mine, other=0)

            def step(c, rank):                                                      # rank [TS, 1]
                sj = c * tj + tk._iota((1, tj), 1)                                  # [1, TJ]
                inj = sj < m
                srj = (r * parts + t) + 0 * sj
                k_j = B.gather(ks_ref, srj, sj, mask=inj, other=0)
                id_j = B.gather(is_ref, srj, sj, mask=inj, other=0)
                better = inj & ((k_j > k_i) | ((k_j == k_i) & (id_j < id_i)))       # [TS, TJ]
                return rank + jnp.sum(better.astype(jnp.int32), axis=1, keepdims=True)

            rank = lax.fori_loop(0, (m + tj - 1) // tj, step, jnp.zeros((ts, 1), jnp.int32))
            B.scatter(out_ref, row[:, None] + 0 * si, jnp.minimum(rank, k - 1), id_i, mine)

    @B.when(over & (t == 0))
    def _stream():
        length = jnp.minimum(B.load(len_ref.at[row]), n_cols)                       # [1]
        hi = jnp.max(length)
        init = tk.prefilter_state(1, B.load(floor_ref.at[row]))
        produce = tk.score_producer(gf, x_ref, row, length, 0, hi, n_cols)
        st = tk.stream(gf, kb_ref, ib_ref, row, (hi + gf.ch - 1) // gf.ch, produce, interpret, init)
        tk.emit_sorted(gf, kb_ref, ib_ref, row, st[0], out_ref, row, row >= 0, interpret)


def select_candidates(scores, lengths, floor, counts, keys, ids, k: int, *, parts: int = 4,
                      radix_bits: int = 4, interpret=None, num_warps: int = tk.ROW_WARPS):
    """scores [rows, n] f32, lengths [rows] i32, floor [rows] u32 (the filter's), and the
    filter's counts [rows] i32, keys [rows, CAP] u32, ids [rows, CAP] i32 ->
    [rows, k] i32: best ids by (key desc, id asc), -1 padded."""
    rows, n_cols = scores.shape
    cap = keys.shape[1]
    kp = tk.next_pow2(k)
    if cap & (cap - 1) or parts < 1 or parts & (parts - 1) or parts > kp:
        raise ValueError(f"select: CAP {cap} and PARTS {parts} must be powers of two, PARTS <= {kp}")
    ts = kp // parts
    tj = max(1, min(kp, RANK_TILE // ts))
    gf = tk.Geometry(k=k, bn=1, ch=min(FALLBACK_CHUNK, tk.next_pow2(n_cols)))
    interpret = B.resolve_interpret(interpret)
    kern = functools.partial(_kernel, k=k, cap=cap, parts=parts, ts=ts, tj=tj, radix_bits=radix_bits, gf=gf,
                             n_cols=n_cols, interpret=interpret)
    out, *_ = B.pallas_call(
        kern, grid=(rows, parts),
        out_shape=(jax.ShapeDtypeStruct((rows, k), jnp.int32),
                   jax.ShapeDtypeStruct((rows * parts, kp), jnp.uint32),
                   jax.ShapeDtypeStruct((rows * parts, kp), jnp.int32))
        + tk.buffer_shapes(gf, rows),
        input_output_aliases={}, interpret=interpret, name="kpool_topk_select", num_warps=num_warps,
    )(lengths.astype(jnp.int32), floor.astype(jnp.uint32), scores.astype(jnp.float32),
      counts.astype(jnp.int32), keys.astype(jnp.uint32), ids.astype(jnp.int32))
    return out
