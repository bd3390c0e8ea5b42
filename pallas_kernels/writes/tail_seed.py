"""Kernel: seed each request's bf16 tail ring with its last kpool prefill tokens (docs/semantics.md 5.3).

Touches ONLY: for token i with a valid tail slot that is among its request's
last kpool tokens of the batch, the 2 x 256 bytes of ring row ``tslot % ring`` of
tail block ``tslot // ring`` (K half and gate half), which alias the start of
indexer block ``tslot // ring`` of this layer. Nothing else.

Grid: one program per tile of TILE_TOKENS candidate rows. Candidates are every
row of the batch, or, when the caller passes ``request_ends_tokens`` (one past each
request's last row), only the last kpool rows of each request: then the grid
and the cost depend on the number of requests, not on the prompt length. Either
way the tail slots of a candidate and of the row kpool ahead decide whether it
is seeded (the reference's rule), and only seeded rows are loaded and stored
(masked lanes touch no memory): 512 bytes read and written per seeded row.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ..core import backend as B
from ..core import addressing as addr
from ..core import numerics as nm
from ..core.strides import CacheStrides

TILE_TOKENS = 64           # candidate rows per program, all-rows mode
TILE_ENDS = 8              # candidate rows per program, request-ends mode (few rows: spread them)


def _kernel(ends_ref, tslot_ref, key_ref, gate_ref, _cache_in, cache_ref, *, s: CacheStrides,
            t_total: int, n_ends: int):
    # ends_ref: [N] i32 (unused when n_ends == 0); tslot_ref: [T] i32;
    # key_ref, gate_ref: [T, 128] bf16; cache_ref: [rows, 1024] u32
    tile = TILE_ENDS if n_ends else TILE_TOKENS
    p = B.program_id(0)
    c = p * tile + lax.broadcasted_iota(jnp.int32, (tile,), 0)                     # [TILE] candidate
    if n_ends:                                   # candidate c: row end - R + c % R of request c // R
        req = c // s.kpool
        end = B.load(ends_ref.at[jnp.minimum(req, n_ends - 1)], mask=req < n_ends, other=0)
        i = jnp.where(end > 0, end - s.kpool + c % s.kpool, -1)
    else:
        i = c
    in_range = (i >= 0) & (i < t_total)
    i = jnp.maximum(i, 0)
    ts = B.load(tslot_ref.at[jnp.minimum(i, t_total - 1)], mask=in_range, other=-1)       # [TILE]
    j = i + s.kpool
    ahead = B.load(tslot_ref.at[jnp.minimum(j, t_total - 1)], mask=j < t_total, other=-1)  # [TILE]
    seeded = (in_range & addr.tail_slot_valid(s, ts)
              & ((ahead < 0) | (addr.tail_block(s, ahead) != addr.tail_block(s, ts))))
    blk = addr.tail_block(s, ts)
    ring_slot = jnp.where(seeded, ts, 0) % s.ring
    col = lax.broadcasted_iota(jnp.int32, (tile, 128), 1)                          # [TILE, 128]
    rows = jnp.minimum(i, t_total - 1)[:, None] + 0 * col                           # [TILE, 128]
    w = lax.broadcasted_iota(jnp.int32, (tile, addr.TAIL_ROW_WORDS), 1)          # [TILE, 64]
    m2 = seeded[:, None] & (w >= 0)
    for half, src in ((0, key_ref), (1, gate_ref)):
        row = B.gather(src, rows, col, mask=seeded[:, None] & (col >= 0))           # [TILE, 128] bf16
        wr, wc = addr.split_word(s, addr.tail_row_words(s, blk, ring_slot, half)[:, None] + w)
        B.scatter(cache_ref, wr, wc, nm.pack_bf16_words(row), m2)


@functools.partial(jax.jit, static_argnames=("s", "interpret"))
def seed_tail(cache, s: CacheStrides, key, gate, tslot, request_ends_tokens=None, *, interpret=None):
    """cache: [total_words] u32; key, gate: [T, 128] bf16; tslot: [T] i32;
    request_ends_tokens: optional [N] i32, one past each request's last row (0: padding;
    a negative entry visits nothing, like 0).
    Returns the new cache."""
    t = key.shape[0]
    if t == 0:
        return cache
    if request_ends_tokens is None:
        ends, n_ends, cands = jnp.zeros((1,), jnp.int32), 0, t
    else:
        ends, n_ends = request_ends_tokens.astype(jnp.int32), request_ends_tokens.shape[0]
        cands = n_ends * s.kpool
        if n_ends == 0:
            return cache
    view = cache.reshape(addr.view_shape(s))
    out = B.pallas_call(
        functools.partial(_kernel, s=s, t_total=t, n_ends=n_ends),
        grid=(pl_cdiv(cands, TILE_ENDS if n_ends else TILE_TOKENS),),
        out_shape=jax.ShapeDtypeStruct(view.shape, view.dtype),
        input_output_aliases={4: 0},
        interpret=interpret, name="kpool_seed_tail", num_warps=4,
    )(ends, tslot.astype(jnp.int32), key.astype(jnp.bfloat16), gate.astype(jnp.bfloat16), view)
    return out.reshape(-1)


def pl_cdiv(a, b):
    return -(-a // b)
