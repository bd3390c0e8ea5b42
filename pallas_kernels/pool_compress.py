"""Kernel: prefill pool compression, the flat-token writer (spec 5.2).

Touches ONLY: for every token row i with i >= kpool-1 and a valid pool slot
``loc = slot_mapping[i]``, the 128 key bytes and the 4 scale bytes of pool slot
``loc`` in this layer's indexer pages. Nothing else (no tail bytes).

Grid: one program per tile of TILE_TOKENS token rows. Each row that completes a
pool gathers its kpool member rows (i-kpool+1 .. i, the same request because
chunks start on pool boundaries), pools them with the gated softmax, rotates,
quantises, packs the fp8 bytes into words and stores the record. Rows that do
not complete a pool are masked: they load and store nothing.
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

TILE_TOKENS = 32


def _kernel(slot_ref, key_ref, gate_ref, ape_ref, _cache_in, cache_ref, *, s: CacheStrides, t_total: int):
    # slot_ref: [T] i32; key_ref, gate_ref: [T, 128] bf16; ape_ref: [R, 128] f32; cache_ref: [rows, 1024] u32
    r = s.kpool
    p = B.program_id(0)
    i = p * TILE_TOKENS + lax.broadcasted_iota(jnp.int32, (TILE_TOKENS,), 0)      # [TILE]
    in_range = i < t_total
    loc = B.load(slot_ref.at[jnp.minimum(i, t_total - 1)], mask=in_range, other=-1)
    valid = in_range & (i >= r - 1) & addr.pool_slot_valid(s, loc)                  # [TILE]
    col = lax.broadcasted_iota(jnp.int32, (TILE_TOKENS, nm.HEAD_DIM), 1)             # [TILE, 128]
    m2 = valid[:, None] & (col >= 0)
    keys, gates, apes = [], [], []
    for j in range(r):
        member = jnp.clip(i - (r - 1) + j, 0, t_total - 1)[:, None] + 0 * col        # [TILE, 128]
        keys.append(B.gather(key_ref, member, col, mask=m2))                        # [TILE, 128] bf16
        gates.append(B.gather(gate_ref, member, col, mask=m2))
        apes.append(ape_ref[j, :])                                                  # [128] f32
    q8, scale = nm.compress_pool(keys, gates, apes)                                 # [TILE,128] fp8, [TILE]
    loc = jnp.where(valid, loc, 0)
    w = lax.broadcasted_iota(jnp.int32, (TILE_TOKENS, addr.KEY_WORDS), 1)          # [TILE, 32]
    rk, ck = addr.split_word(s, addr.pool_key_words(s, loc)[:, None] + w)
    B.scatter(cache_ref, rk, ck, nm.pack_fp8_words(q8), valid[:, None] & (w >= 0))
    rs, cs = addr.split_word(s, addr.pool_scale_words(s, loc))
    B.scatter(cache_ref, rs, cs, nm.f32_word(scale), valid)


@functools.partial(jax.jit, static_argnames=("s", "interpret"))
def compress_prefill(cache, s: CacheStrides, key, gate, ape, slot_mapping, *, interpret=None):
    """cache: [total_words] u32; key, gate: [T, 128] bf16; ape: [R, 128] f32; slot_mapping: [T] i32."""
    t = key.shape[0]
    if t < s.kpool:
        return cache                       # no row can own a whole pool
    view = cache.reshape(addr.view_shape(s))
    out = B.pallas_call(
        functools.partial(_kernel, s=s, t_total=t),
        grid=(-(-t // TILE_TOKENS),),
        out_shape=jax.ShapeDtypeStruct(view.shape, view.dtype),
        input_output_aliases={4: 0},
        interpret=interpret, name="kpool_compress_prefill", num_warps=4,
    )(slot_mapping.astype(jnp.int32), key.astype(jnp.bfloat16), gate.astype(jnp.bfloat16),
      ape.astype(jnp.float32), view)
    return out.reshape(-1)
