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

``prefetch=True`` (opt-in until measured on the H200) loads the program's n
positions, slots and key / gate rows once, before the token loop, instead of
after each token's barrier, and drops the barrier between a token's completion
and its stash: the completion reads ring rows pos-R+1 .. pos-1 and the stash
writes row pos (mod ring >= R), so they never touch the same row, and the one
barrier at the top of each token still orders every earlier token's stash
before a later completion's reads and every completion's reads before a later
token's stash. A token then waits on one global round trip (its ring rows)
instead of four.
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


def _prefetch_lanes(n: int) -> int:
    """Lanes of the prefetched per-token vectors: a power of two >= n (and >= 8)."""
    p = 8
    while p < n:
        p *= 2
    return p


def _kernel(pos_ref, slot_ref, tslot_ref, key_ref, gate_ref, ape_ref, _cache_in, cache_ref, *,
            s: CacheStrides, n: int, interpret: bool, prefetch: bool):
    # pos_ref, slot_ref, tslot_ref: [B, n] i32; key_ref, gate_ref: [B, n, 128] bf16
    # ([B*n, 128] with prefetch); ape_ref: [R, 128] f32; cache_ref: [rows, 1024] u32
    r = s.kpool
    b = B.program_id(0)
    w64 = lax.broadcasted_iota(jnp.int32, (addr.TAIL_ROW_WORDS,), 0)                # [64]
    w32 = lax.broadcasted_iota(jnp.int32, (addr.KEY_WORDS,), 0)                     # [32]
    apes = [ape_ref[j, :] for j in range(r)]                                        # R x [128] f32

    def ring_row(blk, ring_slot, half):                                             # -> [128] bf16
        rr, cc = addr.split_word(s, addr.tail_row_words(s, blk, ring_slot, half) + w64)
        return nm.unpack_bf16_words(B.gather(cache_ref, rr, cc))

    if prefetch:                                        # every token's inputs, loaded once
        lanes = _prefetch_lanes(n)
        ti = lax.broadcasted_iota(jnp.int32, (lanes,), 0)                           # [L]
        tc = jnp.minimum(ti, n - 1)
        meta = [B.gather(ref, 0 * tc + b, tc) for ref in (pos_ref, tslot_ref, slot_ref)]   # 3 x [L] i32
        rows = (b * n + tc)[:, None] + 0 * lax.broadcasted_iota(jnp.int32, (1, 128), 1)     # [L, 128]
        cols = 0 * tc[:, None] + lax.broadcasted_iota(jnp.int32, (1, 128), 1)
        rows_kg = [lax.bitcast_convert_type(B.gather(ref, rows, cols), jnp.uint16).astype(jnp.uint32)
                   for ref in (key_ref, gate_ref)]                                  # 2 x [L, 128] u32

        def inputs(t):                                  # lane t, exactly (integer select, no float sum)
            pos, tslot, loc = (jnp.sum(jnp.where(ti == t, v, 0)) for v in meta)
            kg = [lax.bitcast_convert_type(jnp.sum(jnp.where(ti[:, None] == t, v, jnp.uint32(0)), axis=0)
                                           .astype(jnp.uint16), jnp.bfloat16) for v in rows_kg]
            return pos, tslot, loc, kg[0], kg[1]
    else:
        def inputs(t):
            return pos_ref[b, t], tslot_ref[b, t], slot_ref[b, t], None, None

    def token(t, carry):
        pos, tslot, loc, key_t, gate_t = inputs(t)
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
            keys.append(key_ref[b, t, :] if key_t is None else key_t)
            gates.append(gate_ref[b, t, :] if gate_t is None else gate_t)
            q8, scale = nm.compress_pool(keys, gates, apes)                         # [128] fp8, []
            rk, ck = addr.split_word(s, addr.pool_key_words(s, loc) + w32)
            B.scatter(cache_ref, rk, ck, nm.pack_fp8_words(q8), w32 >= 0)
            rs, cs = addr.split_word(s, addr.pool_scale_words(s, loc))
            cache_ref[rs, cs] = nm.f32_word(scale)

        if not prefetch:
            B.barrier(interpret)                                     # reads above finish before the stash

        @B.when(live & addr.tail_slot_valid(s, tslot))
        def _stash():                                       # gated on the tail slot (bug B3)
            for half, src, row in ((0, key_ref, key_t), (1, gate_ref, gate_t)):
                rr, cc = addr.split_word(s, addr.tail_row_words(s, blk, pos_c % s.ring, half) + w64)
                B.scatter(cache_ref, rr, cc, nm.pack_bf16_words(src[b, t, :] if row is None else row), w64 >= 0)

        return carry

    lax.fori_loop(0, n, token, 0)


NUM_WARPS = 4              # H200: 2x faster than 1 warp at B=256, next_n 1 (tune_writes.py)
PREFETCH = False           # the default of ``prefetch`` (module docstring)


def decode_update(cache, s: CacheStrides, key, gate, ape, slot_mapping, tslot, positions, *,
                  interpret=None, num_warps: int = NUM_WARPS, prefetch: bool | None = None):
    """cache: [total_words] u32; key, gate: [B, n, 128] bf16; ape [R, 128] f32;
    slot_mapping, tslot, positions: [B, n] i32. Returns the new cache.
    num_warps: launch shape (``benchmarks/tune_writes.py``); prefetch: the
    variant of the module docstring (None: ``PREFETCH`` when called)."""
    return _decode_update(cache, s, key, gate, ape, slot_mapping, tslot, positions, interpret=interpret,
                          num_warps=num_warps, prefetch=PREFETCH if prefetch is None else bool(prefetch))


@functools.partial(jax.jit, static_argnames=("s", "interpret", "num_warps", "prefetch"))
def _decode_update(cache, s: CacheStrides, key, gate, ape, slot_mapping, tslot, positions, *,
                   interpret, num_warps: int, prefetch: bool):
    b, n = positions.shape
    if b == 0 or n == 0:
        return cache
    view = cache.reshape(addr.view_shape(s))
    interpret = B.resolve_interpret(interpret)
    key, gate = key.astype(jnp.bfloat16), gate.astype(jnp.bfloat16)
    if prefetch:                                        # rows b * n + t: a 2-D gather per program
        key, gate = key.reshape(b * n, 128), gate.reshape(b * n, 128)
    out = B.pallas_call(
        functools.partial(_kernel, s=s, n=n, interpret=interpret, prefetch=prefetch),
        grid=(b,),
        out_shape=jax.ShapeDtypeStruct(view.shape, view.dtype),
        input_output_aliases={6: 0},
        interpret=interpret, name="kpool_decode_update", num_warps=num_warps,
    )(positions.astype(jnp.int32), slot_mapping.astype(jnp.int32), tslot.astype(jnp.int32),
      key, gate, ape.astype(jnp.float32), view)
    return out.reshape(-1)
