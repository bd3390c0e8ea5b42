"""Kernel: the final select of ``topk.topk_pools`` in filter mode (docs/semantics.md 2.5, 5.9).

The row's candidate list (``filter``: the row's count n and its first n
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

A row whose count exceeds CAP (the list overflowed: skewed or tied rows) is
left alone here: ``driver.select_candidates`` then launches ``fallback``, which
runs the exact streaming path on exactly those rows, in place in the same ids
array (no host round trip; the second launch does nothing but read the counts
when no row overflowed). The streaming path is kept out of this kernel because
Triton sizes a kernel's registers for its largest path: with it inside, the select
takes 255 registers and runs at 12 % warps active (Nsight Compute), against 148
without.

Reads ONLY its inputs; writes ONLY its output: ids [rows, k] i32, the rows
whose list did not overflow. Masked-out lanes touch no memory.

Grid: (rows, max(CAP, KP) / TI), KP = k rounded up to a power of two.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ..core import backend as B
from . import common as tk


def _kernel(cnt_ref, kl_ref, il_ref, out_ref, *, k: int, cap: int, ti: int, tj: int):
    # cnt_ref [rows] i32, kl_ref [rows, CAP] u32, il_ref [rows, CAP] i32 -> out_ref [rows, k] i32
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

            # Dead lanes (slot >= n) read nothing and hold key 0, which no candidate has
            # (f32 keys are >= 1), so they never count as better: the compare needs no mask.
            def tile(c):                                                            # [1, TJ] x 2
                sj = c * tj + tk._iota((1, tj), 1)
                inj = sj < n
                rows = row[:, None] + 0 * sj
                sj = jnp.minimum(sj, cap - 1)
                return (B.gather(kl_ref, rows, sj, mask=inj, other=0),
                        B.gather(il_ref, rows, sj, mask=inj, other=-1))

            def step(c, carry):
                acc, (k_j, id_j) = carry
                nxt = tile(c + 1)                                                   # in flight now
                better = (k_j > k_i) | ((k_j == k_i) & (id_j < id_i))              # [TI, TJ]
                return acc + better.astype(jnp.int32), nxt                          # no reduction here

            acc, _ = lax.fori_loop(0, (n + tj - 1) // tj, step, (jnp.zeros((ti, tj), jnp.int32), tile(0)))
            rank = jnp.sum(acc, axis=1, keepdims=True)                              # [TI, 1], once
            B.scatter(out_ref, orow, jnp.minimum(rank, k - 1), id_i, mine & (rank < k))


def rank_candidates(counts, keys, ids, k: int, *, ti: int = 64, tj: int = 64, interpret=None,
                    num_warps: int = 4, num_stages: int = 1):
    """The filter's counts [rows] i32, keys [rows, CAP] u32, ids [rows, CAP] i32 ->
    [rows, k] i32: best ids by (key desc, id asc), -1 padded, on the rows whose list
    did not overflow; the other rows are left for ``fallback.stream_overflowed``
    (``driver.select_candidates`` launches both)."""
    rows, cap = keys.shape
    kp = tk.next_pow2(k)
    for name, v in (("CAP", cap), ("TI", ti), ("TJ", tj)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"select: {name} must be a power of two, got {v}")
    ti = min(ti, max(cap, kp))
    interpret = B.resolve_interpret(interpret)
    kern = functools.partial(_kernel, k=k, cap=cap, ti=ti, tj=tj)
    return B.pallas_call(
        kern, grid=(rows, max(cap, kp) // ti),
        out_shape=jax.ShapeDtypeStruct((rows, k), jnp.int32),
        input_output_aliases={}, interpret=interpret, name="kpool_topk_select", num_warps=num_warps,
        num_stages=num_stages,
    )(counts.astype(jnp.int32), keys.astype(jnp.uint32), ids.astype(jnp.int32))
