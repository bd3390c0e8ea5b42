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

Grid: (ceil(rows / TILE_ROWS), ceil(width / TILE_COLS)); each program fills a
[TILE_ROWS, TILE_COLS] tile, gathering the pool id of each column.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ..core import backend as B

TILE_ROWS = 8
TILE_COLS = 256


def _kernel(ids_ref, seq_ref, out_ref, *, rows: int, k: int, r: int):
    # ids_ref: [rows, k] i32; seq_ref: [rows] i32; out_ref: [rows, k*r + r - 1] i32
    width = k * r + r - 1
    pr, pc = B.program_id(0), B.program_id(1)
    ri = pr * TILE_ROWS + lax.broadcasted_iota(jnp.int32, (TILE_ROWS, TILE_COLS), 0)
    c = pc * TILE_COLS + lax.broadcasted_iota(jnp.int32, (TILE_ROWS, TILE_COLS), 1)
    ok = (ri < rows) & (c < width)
    rc = jnp.minimum(ri, rows - 1)
    row1 = jnp.minimum(pr * TILE_ROWS + lax.broadcasted_iota(jnp.int32, (TILE_ROWS,), 0), rows - 1)
    seq = jnp.maximum(B.load(seq_ref.at[row1]), 0)[:, None]                        # [TILE_R, 1]
    n_pools = seq // r
    is_pool = c < k * r
    g, o = c // r, c % r
    pid = B.gather(ids_ref, rc, jnp.minimum(g, k - 1), mask=ok & is_pool, other=-1)
    pool_ok = is_pool & (pid >= 0) & (pid < n_pools)
    t = c - k * r
    tail_ok = (~is_pool) & (t < seq % r)
    val = jnp.where(pool_ok, pid * r + o, jnp.where(tail_ok, n_pools * r + t, -1))
    B.scatter(out_ref, rc, c, val, ok)


@functools.partial(jax.jit, static_argnames=("kpool", "interpret"))
def expand_pools(pool_ids, seq_lens_tokens, kpool: int, *, interpret=None):
    """pool_ids: [rows, k] i32; seq_lens_tokens: [rows] i32.
    Returns [rows, k*kpool + kpool - 1] i32 token indices (-1 = empty)."""
    rows, k = pool_ids.shape
    width = k * kpool + kpool - 1
    if rows == 0 or k == 0:                                   # only the tail columns
        seq = jnp.maximum(seq_lens_tokens.astype(jnp.int32), 0)
        t = jnp.arange(width, dtype=jnp.int32)
        return jnp.where(t < (seq % kpool)[:, None], (seq // kpool * kpool)[:, None] + t, -1)
    return B.pallas_call(
        functools.partial(_kernel, rows=rows, k=k, r=kpool),
        grid=(-(-rows // TILE_ROWS), -(-width // TILE_COLS)),
        out_shape=jax.ShapeDtypeStruct((rows, width), jnp.int32),
        input_output_aliases={}, interpret=interpret, name="kpool_expand_pools", num_warps=4,
    )(pool_ids.astype(jnp.int32), seq_lens_tokens.astype(jnp.int32))
