"""Kernel: the final select of ``topk.topk_pools`` in filter mode (spec 2.5, 5.9).

The row's candidate list (``topk_filter``: the row's count n and its first n
slots, in no particular order) holds every valid key >= the row's floor, and the
floor passes only ~1.15 k keys of a random row. So the select needs no k-th key
search: it ranks every candidate against all n by (key desc, id asc),

    rank(i) = #{j : key_j > key_i, or key_j == key_i and id_j < id_i},

and writes out[r, rank(i)] = id_i when rank(i) < k. Ranks are distinct (ids
are), so every output slot below min(n, k) is written once, and the result does
not depend on the order in which the filter's programs filled the list. The
slots n .. k - 1 of a row with fewer than k candidates get -1.

Program (r, t) ranks slots t * TI .. t * TI + TI - 1 of row r, walking the n
candidates TJ at a time (the next tile is loaded before the current one is
compared, to hide the L2 latency; the comparisons accumulate in a [TI, TJ] tile
that is summed once at the end, so the loop has no reduction), and writes -1 to
those of its slots that are >= n and < k. Programs whose slots are all past n return after that. No radix
search, no scratch, no barrier: n * n comparisons per row spread over
ceil(n / TI) programs (~600 x 600 at [64, 131072], k = 512; at most CAP x CAP).

When the row's count exceeds CAP (the list overflowed: skewed or tied rows),
program (r, 0) instead runs the exact streaming path (``topk.stream`` over the
row's scores with the same floor, then ``topk.emit_sorted``) and the row's other
programs do nothing: no host round trip, no second launch.

Reads ONLY its inputs; writes ONLY its outputs: ids [rows, k] i32 and the
streaming path's buffers [rows, CAP_S] u32 / i32 (row r private to program
(r, 0)). Masked-out lanes touch no memory.

Grid: (rows, max(CAP, KP) / TI), KP = k rounded up to a power of two.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from . import _backend as B
from . import topk as tk

FALLBACK_CHUNK = 2048   # scores per step of the streaming path on an overflowed row


def _kernel(len_ref, floor_ref, x_ref, cnt_ref, kl_ref, il_ref, out_ref, kb_ref, ib_ref,
            *, k: int, cap: int, ti: int, tj: int, gf: tk.Geometry, n_cols: int, interpret: bool):
    # len_ref [rows] i32, floor_ref [rows] u32, x_ref [rows, n_cols] f32 (read on overflow only)
    # cnt_ref [rows] i32, kl_ref [rows, CAP] u32, il_ref [rows, CAP] i32
    # out_ref [rows, k] i32; kb_ref / ib_ref [rows, CAP_S] (streaming path of program (r, 0))
    r, t = B.program_id(0), B.program_id(1)
    row = r + 0 * tk._iota((1,), 0)                                                 # [1]
    count = B.load(cnt_ref.at[row])                                                 # [1]
    n = jnp.minimum(jnp.max(count), cap)                                            # scalar
    over = jnp.max(count) > cap
    si = t * ti + tk._iota((ti, 1), 0)                                              # [TI, 1] my slots
    orow = row[:, None] + 0 * si

    @B.when(jnp.logical_not(over))
    def _select():
        B.scatter(out_ref, orow, jnp.minimum(si, k - 1), jnp.full((ti, 1), -1, jnp.int32),
                  (si >= n) & (si < k))                                             # rows short of k

        @B.when(t * ti < n)
        def _rank():
            mine = si < n
            k_i = B.gather(kl_ref, orow, jnp.minimum(si, cap - 1), mask=mine, other=0)   # [TI, 1] u32
            id_i = B.gather(il_ref, orow, jnp.minimum(si, cap - 1), mask=mine, other=0)  # [TI, 1] i32

            def tile(c):                                                            # [1, TJ] x 2, dead
                sj = c * tj + tk._iota((1, tj), 1)                                  # lanes read nothing
                inj = sj < n
                rows = row[:, None] + 0 * sj
                sj = jnp.minimum(sj, cap - 1)
                return (B.gather(kl_ref, rows, sj, mask=inj, other=0),
                        B.gather(il_ref, rows, sj, mask=inj, other=-1), inj)

            def step(c, carry):
                acc, (k_j, id_j, inj) = carry
                nxt = tile(c + 1)                                                   # in flight now
                better = inj & ((k_j > k_i) | ((k_j == k_i) & (id_j < id_i)))       # [TI, TJ]
                return acc + better.astype(jnp.int32), nxt                          # no reduction here

            acc, _ = lax.fori_loop(0, (n + tj - 1) // tj, step, (jnp.zeros((ti, tj), jnp.int32), tile(0)))
            rank = jnp.sum(acc, axis=1, keepdims=True)                              # [TI, 1], once
            B.scatter(out_ref, orow, jnp.minimum(rank, k - 1), id_i, mine & (rank < k))

    @B.when(over & (t == 0))
    def _stream():
        length = jnp.minimum(B.load(len_ref.at[row]), n_cols)                       # [1]
        hi = jnp.max(length)
        init = tk.prefilter_state(1, B.load(floor_ref.at[row]))
        produce = tk.score_producer(gf, x_ref, row, length, 0, hi, n_cols)
        st = tk.stream(gf, kb_ref, ib_ref, row, (hi + gf.ch - 1) // gf.ch, produce, interpret, init)
        tk.emit_sorted(gf, kb_ref, ib_ref, row, st[0], out_ref, row, row >= 0, interpret)


def select_candidates(scores, lengths, floor, counts, keys, ids, k: int, *, ti: int = 64, tj: int = 64,
                      interpret=None, num_warps: int = 4, num_stages: int = 1):
    """scores [rows, n] f32, lengths [rows] i32, floor [rows] u32 (the filter's), and the
    filter's counts [rows] i32, keys [rows, CAP] u32, ids [rows, CAP] i32 ->
    [rows, k] i32: best ids by (key desc, id asc), -1 padded."""
    rows, n_cols = scores.shape
    cap = keys.shape[1]
    kp = tk.next_pow2(k)
    for name, v in (("CAP", cap), ("TI", ti), ("TJ", tj)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"select: {name} must be a power of two, got {v}")
    ti = min(ti, max(cap, kp))
    gf = tk.Geometry(k=k, bn=1, ch=min(FALLBACK_CHUNK, tk.next_pow2(n_cols)))
    interpret = B.resolve_interpret(interpret)
    kern = functools.partial(_kernel, k=k, cap=cap, ti=ti, tj=tj, gf=gf, n_cols=n_cols, interpret=interpret)
    out, *_ = B.pallas_call(
        kern, grid=(rows, max(cap, kp) // ti),
        out_shape=(jax.ShapeDtypeStruct((rows, k), jnp.int32),) + tk.buffer_shapes(gf, rows),
        input_output_aliases={}, interpret=interpret, name="kpool_topk_select", num_warps=num_warps,
        num_stages=num_stages,
    )(lengths.astype(jnp.int32), floor.astype(jnp.uint32), scores.astype(jnp.float32),
      counts.astype(jnp.int32), keys.astype(jnp.uint32), ids.astype(jnp.int32))
    return out
