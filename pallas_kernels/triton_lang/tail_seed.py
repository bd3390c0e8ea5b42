"""Triton kernel: seed each request's bf16 tail ring with its last kpool prefill tokens (docs/semantics.md 5.3).

Touches ONLY: for token i with a valid tail slot that is among its request's
last kpool tokens of the batch, the 2 x 256 bytes of ring row ``tslot % ring``
of tail block ``tslot // ring`` (K half and gate half), which alias the start of
indexer block ``tslot // ring`` of this layer. Nothing else.

Split of work: ``seed_targets`` (XLA, through ``addressing``) lists the
candidate rows - every row of the batch or, when the caller passes
``request_ends_tokens`` (one past each request's last row), only the last kpool rows of
each request, so the cost depends on the number of requests and not on the
prompt length - applies the reference's rule (look kpool rows ahead: end of
batch, padding or another tail block) and gives each seeded candidate its
source row and the (row, col) word-view pairs of its two ring rows; -1 means
"write nothing". The kernel, one program per TILE_TOKENS candidates, copies only
the seeded rows (masked lanes touch no memory) as 64 words each: a bf16 row read
as little-endian words is its packed ring row.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from ..core import addressing as addr
from ..core.strides import CacheStrides
from . import _call
from .addressing_tl import word_index

TILE_TOKENS = 16
NUM_WARPS = 4


def seed_targets(s: CacheStrides, tslot, request_ends_tokens=None):
    """tslot [T] i32 (request_ends_tokens [N] i32 or None) -> (src [M] i32, dst [M, 4] i32).

    M = T candidates (every row), or N * kpool with request_ends_tokens (row end - kpool + j
    of each request; entries <= 0 are padding). src: the row a seeded candidate
    copies, -1 if it seeds nothing (padding, invalid slot, not among its request's
    last kpool rows of the batch); dst: (K row, K col, gate row, gate col) of the
    ring row it writes in the [rows, VIEW_COLS] word view, rows -1 when src is -1.
    A request shorter than kpool makes its window reach into the previous request:
    those rows are then candidates twice and write the same bytes twice.
    """
    t = tslot.shape[0]
    r = s.kpool
    if request_ends_tokens is None:
        i = jnp.arange(t, dtype=jnp.int32)                                         # [M]
    else:
        c = jnp.arange(request_ends_tokens.shape[0] * r, dtype=jnp.int32)
        end = request_ends_tokens[c // r]
        i = jnp.where(end > 0, end - r + c % r, -1)
    in_range = (i >= 0) & (i < t)
    ts = jnp.where(in_range, tslot[jnp.clip(i, 0, t - 1)], -1)
    j = i + r
    ahead = jnp.where(in_range & (j < t), tslot[jnp.clip(j, 0, t - 1)], -1)
    seeded = (addr.tail_slot_valid(s, ts)
              & ((ahead < 0) | (addr.tail_block(s, ahead) != addr.tail_block(s, ts))))
    blk = addr.tail_block(s, ts)
    ring_slot = jnp.where(seeded, ts, 0) % s.ring
    cols = []
    for half in (0, 1):
        row, col = addr.split_word(s, addr.tail_row_words(s, blk, ring_slot, half))
        cols += [jnp.where(seeded, row, -1), col]
    return jnp.where(seeded, i, -1).astype(jnp.int32), jnp.stack(cols, axis=-1).astype(jnp.int32)


@triton.jit
def seed_tail_kernel(M, src_ptr, dst_ptr, key_ptr, gate_ptr, cache_in_ptr, cache_ptr, TILE: tl.constexpr):
    # M: i32 candidates; src: [M] i32, dst: [M, 4] i32 (seed_targets); key, gate: [T, 128] bf16;
    # cache: [total_words] u32 (cache_in_ptr is the same buffer, unused)
    c = tl.program_id(0) * TILE + tl.arange(0, TILE)                      # [TILE] candidate
    ok = c < M
    row_src = tl.load(src_ptr + c, mask=ok, other=-1)                     # [TILE] token row
    m = (row_src >= 0)[:, None]                                           # [TILE, 1]
    w = tl.arange(0, 64)
    # A bf16 row read as 64 little-endian words is exactly numerics.pack_bf16_words of
    # it (element 2w in the low half): the seed is a word copy.
    src_words = tl.maximum(row_src, 0).to(tl.int64)[:, None] * 64 + w[None, :]   # [TILE, 64]
    for half in tl.static_range(2):
        row = tl.load(dst_ptr + c * 4 + 2 * half, mask=ok, other=-1)      # [TILE]
        col = tl.load(dst_ptr + c * 4 + 2 * half + 1, mask=ok, other=0)
        if half == 0:
            words = tl.load(key_ptr.to(tl.pointer_type(tl.uint32)) + src_words, mask=m, other=0)   # [TILE, 64] u32
        else:
            words = tl.load(gate_ptr.to(tl.pointer_type(tl.uint32)) + src_words, mask=m, other=0)
        tl.store(cache_ptr + word_index(row, col)[:, None] + w[None, :], words, mask=m & (row >= 0)[:, None])


def plan(cache, s: CacheStrides, key, gate, tslot, request_ends_tokens=None, *, tile_tokens=TILE_TOKENS,
         num_warps=NUM_WARPS):
    """The launch of seed_tail (None when there is nothing to write)."""
    t = key.shape[0]
    if t == 0 or (request_ends_tokens is not None and request_ends_tokens.shape[0] == 0):
        return None
    src, dst = seed_targets(s, tslot.astype(jnp.int32),
                            None if request_ends_tokens is None else request_ends_tokens.astype(jnp.int32))
    m = src.shape[0]
    return _call.Launch(seed_tail_kernel, (src, dst, key.astype(jnp.bfloat16), gate.astype(jnp.bfloat16), cache),
                        cache_index=4, grid=(-(-m // tile_tokens),), num_warps=num_warps,
                        name="kpool_seed_tail_triton", constexprs=dict(TILE=tile_tokens), scalars=(m,))


@functools.partial(jax.jit, static_argnames=("s", "tile_tokens", "num_warps"))
def seed_tail(cache, s: CacheStrides, key, gate, tslot, request_ends_tokens=None, *, tile_tokens=TILE_TOKENS,
              num_warps=NUM_WARPS):
    """cache: [total_words] u32; key, gate: [T, 128] bf16; tslot: [T] i32; request_ends_tokens:
    optional [N] i32, one past each request's last row (0: padding; a negative entry visits
    nothing, like 0). Returns the new cache.
    tile_tokens (a power of two) and num_warps are launch parameters: same bytes."""
    launch = plan(cache, s, key, gate, tslot, request_ends_tokens, tile_tokens=tile_tokens, num_warps=num_warps)
    return cache if launch is None else _call.run(launch)
