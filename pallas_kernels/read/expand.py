"""Kernel: expand selected pools to token indices and append the tail (docs/semantics.md 5.10).

For a row with token-granular sequence length L (= p + 1 for a query at position
p; <= 0 for padding) and its k selected pool ids, output column c of the
[rows, k*R + R - 1] i32 result (R = kpool) is

  * c < k*R:  g = c // R, o = c % R; pool_ids[g]*R + o if 0 <= pool_ids[g] < L // R,
    else -1. An id >= L // R is not a complete pool of this row: it is rejected,
    never expanded (docs/semantics.md B13: uninitialised ids once became wild token indices);
  * c >= k*R: t = c - k*R; (L // R)*R + t if t < L % R (the incomplete pool, which
    is always attended), else -1.

Reads ONLY pool_ids and seq_lens; writes ONLY its output (every column of every
row). No cache access.

Grid: (ceil(rows * width / BLOCK),); each program fills BLOCK consecutive elements
of the row-major output (rows cross block edges), so its stores are whole aligned
vectors rather than rows of an odd width (k*R + R - 1 words), and gathers the pool id
and sequence length of each element. Flat offsets are i32: an output of more elements
than one launch may address is written by launches over windows of rows.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..core import backend as B

BLOCK = 4096                    # output elements per program
MAX_ELEMENTS = 2**31 - BLOCK    # output elements one launch addresses (i32 flat offsets)


def _kernel(ids_ref, seq_ref, out_ref, *, rows: int, k: int, r: int):
    # ids_ref: [rows, k] i32; seq_ref: [1, rows] i32; out_ref: [rows * width] i32 (row-major [rows, width])
    width = k * r + r - 1
    start = B.program_id(0) * BLOCK
    row0 = start // width
    j = start - row0 * width + lax.broadcasted_iota(jnp.int32, (BLOCK,), 0)     # from row0's column 0
    dr = j // width
    c = j - dr * width                                                          # column of each element
    ok = start + lax.broadcasted_iota(jnp.int32, (BLOCK,), 0) < rows * width      # = row < rows, as flat offsets
    row = jnp.minimum(row0 + dr, rows - 1)
    seq = jnp.maximum(B.gather(seq_ref, jnp.zeros_like(row), row), 0)
    n_pools = seq // r
    is_pool = c < k * r
    g, o = c // r, c % r
    pid = B.gather(ids_ref, row, jnp.minimum(g, k - 1), mask=ok & is_pool, other=-1)
    pool_ok = is_pool & (pid >= 0) & (pid < n_pools)
    t = c - k * r
    tail_ok = (~is_pool) & (t < seq % r)
    val = jnp.where(pool_ok, pid * r + o, jnp.where(tail_ok, n_pools * r + t, -1))
    B.store(out_ref.at[pl.ds(start, BLOCK)], val, ok)


def _launch(pool_ids, seq_lens_tokens, kpool: int, interpret):
    rows, k = pool_ids.shape
    width = k * kpool + kpool - 1
    out = B.pallas_call(
        functools.partial(_kernel, rows=rows, k=k, r=kpool),
        grid=(-(-rows * width // BLOCK),),
        out_shape=jax.ShapeDtypeStruct((rows * width,), jnp.int32),
        input_output_aliases={}, interpret=interpret, name="kpool_expand_pools", num_warps=4,
    )(pool_ids, seq_lens_tokens[None, :])
    return out.reshape(rows, width)


@functools.partial(jax.jit, static_argnames=("kpool", "interpret", "max_elements"))
def expand_pools(pool_ids, seq_lens_tokens, kpool: int, *, interpret=None, max_elements: int = MAX_ELEMENTS):
    """pool_ids: [rows, k] i32; seq_lens_tokens: [rows] i32.
    Returns [rows, k*kpool + kpool - 1] i32 token indices (-1 = empty).
    ``max_elements``: the most output elements one launch writes (the i32 offsets'
    reach; smaller values only split the launches)."""
    rows, k = pool_ids.shape
    width = k * kpool + kpool - 1
    if rows == 0 or k == 0:                                   # only the tail columns
        seq = jnp.maximum(seq_lens_tokens.astype(jnp.int32), 0)
        t = jnp.arange(width, dtype=jnp.int32)
        return jnp.where(t < (seq % kpool)[:, None], (seq // kpool * kpool)[:, None] + t, -1)
    ids, seq = pool_ids.astype(jnp.int32), seq_lens_tokens.astype(jnp.int32)
    rows_per_launch = max(1, min(max_elements, MAX_ELEMENTS) // width)
    if rows <= rows_per_launch:
        return _launch(ids, seq, kpool, interpret)
    n_windows = -(-rows // rows_per_launch)
    window = -(-rows // n_windows)                            # equal windows, the last one ending at row `rows`

    def one_window(i, out):                                   # out: [rows, width]
        first = jnp.minimum(i * window, rows - window)
        part = _launch(lax.dynamic_slice_in_dim(ids, first, window), lax.dynamic_slice_in_dim(seq, first, window),
                       kpool, interpret)
        return lax.dynamic_update_slice_in_dim(out, part, first, 0)

    return lax.fori_loop(0, n_windows, one_window, jnp.zeros((rows, width), jnp.int32))
