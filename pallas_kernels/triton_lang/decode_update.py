"""Triton kernel: batched decode update with pool completion (docs/semantics.md 5.4).

Touches ONLY, per request b and token t (in index = position order):
  * if the token completes a pool (pos % kpool == kpool-1, valid pool slot loc and
    valid tail slot: ``addressing.decode_completes``): the 128 key bytes and 4 scale
    bytes of pool slot loc;
  * if pos >= 0 and its tail slot is valid: the 2 x 256 bytes of ring row
    pos % ring of its own tail block (tslot // ring).
It reads the kpool-1 earlier members of a completing pool from the same ring.

Split of work: ``decode_targets`` (XLA, through ``addressing``) gives every
token R + 1 word-view (row, col) entries: the ring rows of the pool's R - 1
earlier members, the ring row it stashes into (row -1: no stash) and its pool
record (row -1: completes nothing). The kernel runs one program per request and
walks the request's tokens in order; a block barrier between the steps makes a
stash visible to a later token's completion in the same launch, and a
completion reads the ring before the same token's stash. The token count is the
static width n of the [B, n] arrays; padding tokens (pos < 0) carry -1 rows and
do nothing, so uneven and shorter windows reuse the compiled kernel.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from ..core import addressing as addr
from ..core import numerics as nm
from ..core.strides import CacheStrides
from . import _call
from .addressing_tl import word_index
from .numerics_tl import (NAN_ALL, abs_bits, bf16_to_f32, exp_f32, mac_bf16, pool_finish, rotate_quant_words,
                          unpack_words_f32)

NUM_WARPS = 1


def decode_targets(s: CacheStrides, slot_mapping, tslot, positions):
    """[B, n] i32 metadata -> [B, n, R + 1, 4] i32 word-view entries per token.

    Entry j < R - 1: (K row, K col, gate row, gate col) of the ring row holding
    pool member j (read only when the token completes). Entry R - 1: the ring row
    the token stashes into, rows -1 when it does not stash. Entry R: (key row,
    key col, scale row, scale col) of the pool record, rows -1 when the token
    completes nothing. The ring block is the token's own (tail_block(tslot), bug B4).
    """
    r = s.kpool
    pos_c = jnp.maximum(positions, 0)
    blk = addr.tail_block(s, tslot)                                                  # [B, n]
    complete = addr.decode_completes(s, positions, slot_mapping, tslot)
    stash = addr.decode_stashes(s, positions, tslot)

    def ring_entry(ring_slot, write):
        out = []
        for half in (0, 1):
            row, col = addr.split_word(s, addr.tail_row_words(s, blk, ring_slot, half))
            out += [row if write is None else jnp.where(write, row, -1), col]
        return jnp.stack(out, axis=-1)                                               # [B, n, 4]

    first = jnp.maximum(pos_c - (r - 1), 0)
    entries = [ring_entry((first + j) % s.ring, None) for j in range(r - 1)]
    entries.append(ring_entry(pos_c % s.ring, stash))
    loc = jnp.where(complete, slot_mapping, 0)
    kr, kc = addr.split_word(s, addr.pool_key_words(s, loc))
    sr, sc = addr.split_word(s, addr.pool_scale_words(s, loc))
    entries.append(jnp.stack([jnp.where(complete, kr, -1), kc, jnp.where(complete, sr, -1), sc], axis=-1))
    return jnp.stack(entries, axis=-2).astype(jnp.int32)                            # [B, n, R+1, 4]


@triton.jit
def _member(cache_ptr, ent, cur_ptr, j: tl.constexpr, half: tl.constexpr, R: tl.constexpr):
    """[1, 128] f32 K (half 0) or gate (half 1) of pool member j: the ring row of
    entry j for j < R - 1, the current token's row (cur_ptr) for j = R - 1."""
    if j < R - 1:
        row = tl.load(ent + j * 4 + 2 * half)
        col = tl.load(ent + j * 4 + 2 * half + 1)
        words = tl.load(cache_ptr + word_index(row, col) + tl.arange(0, 64)[None, :])   # [1, 64] u32
        x = unpack_words_f32(words, 1)
    else:
        x = bf16_to_f32(tl.load(cur_ptr + tl.arange(0, 128)[None, :]))
    return x


@triton.jit
def _score(cache_ptr, ent, gate_row_ptr, ape_ptr, j: tl.constexpr, R: tl.constexpr):
    """s_j = f32(gate_j) + ape[j], [1, 128]."""
    ape = tl.load(ape_ptr + j * 128 + tl.arange(0, 128)[None, :])
    return _member(cache_ptr, ent, gate_row_ptr, j, 1, R) + ape


@triton.jit
def decode_update_kernel(N, tab_ptr, key_ptr, gate_ptr, ape_ptr, cache_in_ptr, cache_ptr, R: tl.constexpr):
    # N: i32 tokens per request; tab: [B, N, R + 1, 4] i32 (decode_targets);
    # key, gate: [B, N, 128] bf16; ape: [R * 128 + 64] f32 (the ape rows, then numerics.EXP_TABLE);
    # cache: [total_words] u32 (cache_in_ptr is the same buffer, unused)
    b = tl.program_id(0)
    w64 = tl.arange(0, 64)[None, :]
    w32 = tl.arange(0, 32)[None, :]
    for t in range(N):
        tok = b.to(tl.int64) * N + t                                      # row of the [B * N] tokens
        ent = tab_ptr + tok * ((R + 1) * 4)                               # this token's entries
        key_row_ptr = key_ptr + tok * 128
        gate_row_ptr = gate_ptr + tok * 128
        tl.debug_barrier()                                                # earlier tokens' stashes are visible
        prow = tl.load(ent + R * 4 + 0)
        if prow >= 0:                                                     # completes a pool
            mx = _score(cache_ptr, ent, gate_row_ptr, ape_ptr, 0, R)      # [1, 128]
            flag = abs_bits(mx)                                           # the non-finite rule's flag
            for j in tl.static_range(1, R):
                sj = _score(cache_ptr, ent, gate_row_ptr, ape_ptr, j, R)
                flag = tl.maximum(flag, abs_bits(sj))
                mx = tl.maximum(mx, sj, propagate_nan=NAN_ALL)
            e = exp_f32(_score(cache_ptr, ent, gate_row_ptr, ape_ptr, 0, R) - mx, ape_ptr + R * 128)
            den = e
            kj = _member(cache_ptr, ent, key_row_ptr, 0, 0, R)
            flag = tl.maximum(flag, abs_bits(kj))
            acc = mac_bf16(tl.zeros_like(e), kj, e)
            for j in tl.static_range(1, R):
                e = exp_f32(_score(cache_ptr, ent, gate_row_ptr, ape_ptr, j, R) - mx, ape_ptr + R * 128)
                den = den + e
                kj = _member(cache_ptr, ent, key_row_ptr, j, 0, R)
                flag = tl.maximum(flag, abs_bits(kj))
                acc = mac_bf16(acc, kj, e)
            words, scale = rotate_quant_words(pool_finish(acc, den), flag, 1)   # [1, 32] u32, [1] f32
            pcol = tl.load(ent + R * 4 + 1)
            srow = tl.load(ent + R * 4 + 2)
            scol = tl.load(ent + R * 4 + 3)
            tl.store(cache_ptr + word_index(prow, pcol) + w32, words)
            tl.store(cache_ptr + word_index(srow, scol) + tl.arange(0, 1), scale.to(tl.uint32, bitcast=True))
        tl.debug_barrier()                                                # the reads above finish before the stash
        krow = tl.load(ent + (R - 1) * 4 + 0)
        if krow >= 0:                                                     # stash K and gate (bug B3: tail slot)
            kcol = tl.load(ent + (R - 1) * 4 + 1)
            grow = tl.load(ent + (R - 1) * 4 + 2)
            gcol = tl.load(ent + (R - 1) * 4 + 3)
            # a bf16 row read as 64 little-endian words is its packed ring row (pack_bf16_words)
            kw = tl.load(key_row_ptr.to(tl.pointer_type(tl.uint32)) + w64)            # [1, 64] u32
            gw = tl.load(gate_row_ptr.to(tl.pointer_type(tl.uint32)) + w64)
            tl.store(cache_ptr + word_index(krow, kcol) + w64, kw)
            tl.store(cache_ptr + word_index(grow, gcol) + w64, gw)


def plan(cache, s: CacheStrides, key, gate, ape, slot_mapping, tslot, positions, *, num_warps=NUM_WARPS):
    """The launch of decode_update (None for an empty batch)."""
    b, n = positions.shape
    if b == 0 or n == 0:
        return None
    tab = decode_targets(s, slot_mapping.astype(jnp.int32), tslot.astype(jnp.int32),
                         positions.astype(jnp.int32))
    return _call.Launch(decode_update_kernel,
                        (tab, key.astype(jnp.bfloat16), gate.astype(jnp.bfloat16), nm.ape_with_exp_table(ape), cache),
                        cache_index=4, grid=(b,), num_warps=num_warps, name="kpool_decode_update_triton",
                        constexprs=dict(R=s.kpool), scalars=(n,))


@functools.partial(jax.jit, static_argnames=("s", "num_warps"))
def decode_update(cache, s: CacheStrides, key, gate, ape, slot_mapping, tslot, positions, *,
                  num_warps=NUM_WARPS):
    """cache: [total_words] u32; key, gate: [B, n, 128] bf16; ape [R, 128] f32;
    slot_mapping, tslot, positions: [B, n] i32. Returns the new cache.
    num_warps is a launch parameter: same bytes."""
    launch = plan(cache, s, key, gate, ape, slot_mapping, tslot, positions, num_warps=num_warps)
    return cache if launch is None else _call.run(launch)
