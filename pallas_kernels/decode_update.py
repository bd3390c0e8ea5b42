"""Kernel: batched decode update with pool completion (spec 5.4).

Touches ONLY, per request b and token t (in index = position order):
  * if the token completes a pool (pos % kpool == kpool-1, valid pool slot loc):
    the 128 key bytes and 4 scale bytes of pool slot loc;
  * if pos >= 0 and its tail slot is valid: the 2 x 256 bytes of ring row
    pos % ring of its own tail block (tslot // ring).
It reads the kpool-1 earlier members of a completing pool from the same ring.

Grid: one program per request. The program walks the request's tokens in
order, so a completion at the last token of a verify window reads stashes
written by earlier tokens of the same launch; a block barrier between tokens
orders those writes before the reads. The token count is the static width n of
the [B, n] arrays: padding tokens (pos < 0) are skipped, so a batch with fewer or
uneven tokens per request uses the same compiled kernel.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from . import _backend as B
from . import addressing as addr
from . import numerics as nm
from .strides import CacheStrides


def _kernel(pos_ref, slot_ref, tslot_ref, key_ref, gate_ref, ape_ref, tab_ref, _cache_in, cache_ref, *,
            s: CacheStrides, n: int, interpret: bool):
    # pos_ref, slot_ref, tslot_ref: [B, n] i32; key_ref, gate_ref: [B, n, 128] bf16;
    # ape_ref: [R, 128] f32; tab_ref: [1, 64] f32 (numerics.EXP_TABLE); cache_ref: [rows, 1024] u32
    r = s.kpool
    b = B.program_id(0)
    w64 = lax.broadcasted_iota(jnp.int32, (addr.TAIL_ROW_WORDS,), 0)                # [64]
    w32 = lax.broadcasted_iota(jnp.int32, (addr.KEY_WORDS,), 0)                     # [32]
    apes = [ape_ref[j, :] for j in range(r)]                                        # R x [128] f32

    def ring_row(blk, ring_slot, half):                                             # -> [128] bf16
        rr, cc = addr.split_word(s, addr.tail_row_words(s, blk, ring_slot, half) + w64)
        return nm.unpack_bf16_words(B.gather(cache_ref, rr, cc))

    def token(t, carry):
        pos = pos_ref[b, t]
        tslot = tslot_ref[b, t]
        loc = slot_ref[b, t]
        blk = addr.tail_block(s, tslot)                     # this token's own block (bug B4)
        live = pos >= 0
        pos_c = jnp.maximum(pos, 0)
        complete = live & (pos_c % r == r - 1) & addr.pool_slot_valid(s, loc)
        B.barrier(interpret)                                         # earlier tokens' stashes are visible

        @B.when(complete)
        def _complete():
            first = pos_c - (r - 1)
            keys = [ring_row(blk, (first + j) % s.ring, 0) for j in range(r - 1)]
            gates = [ring_row(blk, (first + j) % s.ring, 1) for j in range(r - 1)]
            keys.append(key_ref[b, t, :])
            gates.append(gate_ref[b, t, :])
            q8, scale = nm.compress_pool(keys, gates, apes, B.table_lookup(tab_ref))  # [128] fp8, []
            rk, ck = addr.split_word(s, addr.pool_key_words(s, loc) + w32)
            B.scatter(cache_ref, rk, ck, nm.pack_fp8_words(q8), w32 >= 0)
            rs, cs = addr.split_word(s, addr.pool_scale_words(s, loc))
            cache_ref[rs, cs] = nm.f32_word(scale)

        B.barrier(interpret)                                         # reads above finish before the stash

        @B.when(live & addr.tail_slot_valid(s, tslot))
        def _stash():                                       # gated on the tail slot (bug B3)
            for half, src in ((0, key_ref), (1, gate_ref)):
                rr, cc = addr.split_word(s, addr.tail_row_words(s, blk, pos_c % s.ring, half) + w64)
                B.scatter(cache_ref, rr, cc, nm.pack_bf16_words(src[b, t, :]), w64 >= 0)

        return carry

    lax.fori_loop(0, n, token, 0)


NUM_WARPS = 4              # H200: 2x faster than 1 warp at B=256, next_n 1 (tune_writes.py)


@functools.partial(jax.jit, static_argnames=("s", "interpret", "num_warps"))
def decode_update(cache, s: CacheStrides, key, gate, ape, slot_mapping, tslot, positions, *,
                  interpret=None, num_warps: int = NUM_WARPS):
    """cache: [total_words] u32; key, gate: [B, n, 128] bf16; ape [R, 128] f32;
    slot_mapping, tslot, positions: [B, n] i32. Returns the new cache.
    num_warps: launch shape (``benchmarks/tune_writes.py``)."""
    b, n = positions.shape
    if b == 0 or n == 0:
        return cache
    view = cache.reshape(addr.view_shape(s))
    interpret = B.resolve_interpret(interpret)
    out = B.pallas_call(
        functools.partial(_kernel, s=s, n=n, interpret=interpret),
        grid=(b,),
        out_shape=jax.ShapeDtypeStruct(view.shape, view.dtype),
        input_output_aliases={7: 0},
        interpret=interpret, name="kpool_decode_update", num_warps=num_warps,
    )(positions.astype(jnp.int32), slot_mapping.astype(jnp.int32), tslot.astype(jnp.int32),
      key.astype(jnp.bfloat16), gate.astype(jnp.bfloat16), ape.astype(jnp.float32), nm.exp_table_input(), view)
    return out.reshape(-1)
