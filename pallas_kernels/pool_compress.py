"""Kernel: prefill pool compression, the flat-token writer (spec 5.2).

Touches ONLY: for every token row i with i >= kpool-1 and a valid pool slot
``loc = slot_mapping[i]``, the 128 key bytes and the 4 scale bytes of pool slot
``loc`` in this layer's indexer pages. Nothing else (no tail bytes).

The wrapper first lists the pool-completing rows (a cheap XLA pass over the
[T] slot mapping). A batch completes at most T // kpool pools: each completion
owns the kpool rows i-kpool+1 .. i of its request, since chunks start on pool
boundaries (``glm5_jax.ops`` rejects concrete slot mappings that claim more).
Grid: one program per TILE_POOLS completing rows; each gathers its kpool member
rows, pools them with the gated softmax, rotates, quantises, packs the fp8 bytes
into words and stores the 132-byte record. No work is spent on the other rows.
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

TILE_POOLS = 8


def _kernel(rows_ref, slot_ref, key_ref, gate_ref, ape_ref, _cache_in, cache_ref, *,
            s: CacheStrides, n_rows: int):
    # rows_ref: [n_rows] i32 completing rows (-1 = none); slot_ref: [T] i32;
    # key_ref, gate_ref: [T, 128] bf16; ape_ref: [R, 128] f32; cache_ref: [rows, 1024] u32
    r = s.kpool
    p = B.program_id(0)
    k = p * TILE_POOLS + lax.broadcasted_iota(jnp.int32, (TILE_POOLS,), 0)           # [TILE]
    row = B.load(rows_ref.at[jnp.minimum(k, n_rows - 1)], mask=k < n_rows, other=-1)
    valid = row >= 0
    row = jnp.maximum(row, r - 1)
    loc = jnp.where(valid, slot_ref[row], 0)                                          # [TILE]
    col = lax.broadcasted_iota(jnp.int32, (TILE_POOLS, nm.HEAD_DIM), 1)               # [TILE, 128]
    m2 = valid[:, None] & (col >= 0)
    keys, gates, apes = [], [], []
    for j in range(r):
        member = (row - (r - 1) + j)[:, None] + 0 * col                               # [TILE, 128]
        keys.append(B.gather(key_ref, member, col, mask=m2))                          # [TILE, 128] bf16
        gates.append(B.gather(gate_ref, member, col, mask=m2))
        apes.append(ape_ref[j, :])                                                    # [128] f32
    q8, scale = nm.compress_pool(keys, gates, apes)                                   # [TILE,128], [TILE]
    w = lax.broadcasted_iota(jnp.int32, (TILE_POOLS, addr.KEY_WORDS), 1)            # [TILE, 32]
    rk, ck = addr.split_word(s, addr.pool_key_words(s, loc)[:, None] + w)
    B.scatter(cache_ref, rk, ck, nm.pack_fp8_words(q8), valid[:, None] & (w >= 0))
    rs, cs = addr.split_word(s, addr.pool_scale_words(s, loc))
    B.scatter(cache_ref, rs, cs, nm.f32_word(scale), valid)


def completing_rows(s: CacheStrides, slot_mapping):
    """[T // kpool] i32: the rows that complete a pool (valid slot, i >= kpool-1), -1 padded."""
    t = slot_mapping.shape[0]
    i = jnp.arange(t, dtype=jnp.int32)
    valid = addr.pool_slot_valid(s, slot_mapping) & (i >= s.kpool - 1)
    return jnp.nonzero(valid, size=t // s.kpool, fill_value=-1)[0].astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("s", "interpret"))
def compress_prefill(cache, s: CacheStrides, key, gate, ape, slot_mapping, *, interpret=None):
    """cache: [total_words] u32; key, gate: [T, 128] bf16; ape: [R, 128] f32; slot_mapping: [T] i32."""
    t = key.shape[0]
    if t < s.kpool:
        return cache                       # no row can own a whole pool
    slot_mapping = slot_mapping.astype(jnp.int32)
    rows = completing_rows(s, slot_mapping)
    n_rows = rows.shape[0]
    view = cache.reshape(addr.view_shape(s))
    out = B.pallas_call(
        functools.partial(_kernel, s=s, n_rows=n_rows),
        grid=(-(-n_rows // TILE_POOLS),),
        out_shape=jax.ShapeDtypeStruct(view.shape, view.dtype),
        input_output_aliases={5: 0},
        interpret=interpret, name="kpool_compress_prefill", num_warps=4,
    )(rows, slot_mapping, key.astype(jnp.bfloat16), gate.astype(jnp.bfloat16),
      ape.astype(jnp.float32), view)
    return out.reshape(-1)
