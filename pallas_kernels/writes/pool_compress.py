"""Kernel: prefill pool compression, the flat-token writer (docs/semantics.md 5.2).

Touches ONLY: for every token row i with i >= kpool-1 and a valid pool slot
``loc = slot_mapping[i]``, the 128 key bytes and the 4 scale bytes of pool slot
``loc`` in this layer's indexer pages. Nothing else (no tail bytes).

Grid: one program per tile of tile_pools * kpool rows (``default_tile_pools``; warps:
``default_num_warps``). Pool-completing rows are
at least kpool apart (each owns the kpool rows i-kpool+1 .. i of its request,
since chunks start on pool boundaries; ``glm5_jax.ops`` rejects concrete slot
mappings that break this), so a tile holds at most tile_pools of them. The
program loads the tile's slots, ranks its completing rows with a cumsum and
gives the j-th to lane j; each lane gathers its kpool member rows, pools them
with the gated softmax, rotates, quantises, packs the fp8 bytes into words and
stores the 132-byte record. No pass over the batch runs outside the kernel and
no work is spent on lanes without a completion.
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

TILE_POOLS_MAX = 4           # pools per program once the batch is large
MIN_PROGRAMS = 2048          # ... but the tile shrinks (to 1) while the grid would have fewer programs
NUM_WARPS = 4                # below the largest tile
NUM_WARPS_MAX_TILE = 2       # at TILE_POOLS_MAX: 8 values of a pooled row per thread


def default_tile_pools(tokens: int, kpool: int) -> int:
    """Pools per program for a batch of `tokens` rows: the largest power of two <= 4 that
    keeps >= MIN_PROGRAMS programs, at least 1. H200 device spans, 64 requests
    (docs/benchmarks.md, "Compression launch shape"): 4k tokens 3.23 us at 1 pool per
    program against 4.00 at 8; 32k 11.30 us at 4 against 11.89 at 8; 128k 39.04 us at 4
    against 40.43 at 8."""
    tile = 1
    while tile < TILE_POOLS_MAX and (tokens // kpool) // (2 * tile) >= MIN_PROGRAMS:
        tile *= 2
    return tile


def default_num_warps(tile_pools: int) -> int:
    """Warps per program: 2 at the largest tile (the big batches), else 4. H200 device
    spans, 64 requests (docs/benchmarks.md, "Compression launch shape"): 4 pools x 2 warps
    11.26 / 39.02 us at 32k / 128k tokens against 13.95 / 50.50 at 4 x 8 (8 x 4, the same
    8 values per thread, 11.89 / 40.43); 4 x 2 at 4k tokens 3.71 against 3.23 at the
    default 1 x 4."""
    return NUM_WARPS_MAX_TILE if tile_pools >= TILE_POOLS_MAX else NUM_WARPS


def _kernel(slot_ref, key_ref, gate_ref, ape_ref, tab_ref, _cache_in, cache_ref, *,
            s: CacheStrides, t_total: int, tile_pools: int, interpret: bool):
    # slot_ref: [T] i32; key_ref, gate_ref: [T, 128] bf16; ape_ref: [R, 128] f32;
    # tab_ref: [1, 64] f32 (numerics.EXP_TABLE); cache_ref: [rows, 1024] u32
    r = s.kpool
    w_rows = tile_pools * r
    p = B.program_id(0)
    i = p * w_rows + lax.broadcasted_iota(jnp.int32, (w_rows,), 0)                   # [W] rows
    in_range = i < t_total
    sl = B.load(slot_ref.at[jnp.minimum(i, t_total - 1)], mask=in_range, other=-1)    # [W]
    done = in_range & (i >= r - 1) & addr.pool_slot_valid(s, sl)                    # completes a pool
    di = done.astype(jnp.int32)
    rank = jnp.cumsum(di) - di                                                        # [W]
    lane = lax.broadcasted_iota(jnp.int32, (tile_pools, w_rows), 0)                  # [TILE, W]
    hit = done[None, :] & (rank[None, :] == lane)
    row = jnp.max(jnp.where(hit, i[None, :], -1), axis=1)                             # [TILE]
    valid = row >= 0
    loc = jnp.max(jnp.where(hit, sl[None, :], 0), axis=1)                             # [TILE]
    row = jnp.maximum(row, r - 1)
    col = lax.broadcasted_iota(jnp.int32, (tile_pools, nm.HEAD_DIM), 1)              # [TILE, 128]
    m2 = valid[:, None] & (col >= 0)
    keys, gates = [], []
    for j in range(r):
        member = (row - (r - 1) + j)[:, None] + 0 * col                               # [TILE, 128]
        keys.append(B.gather(key_ref, member, col, mask=m2))                          # [TILE, 128] bf16
        gates.append(B.gather(gate_ref, member, col, mask=m2))
    # R x [128] f32, broadcast over the tile by the pooling's adds (the compiler moves each row
    # into the pools' layout through shared memory; gathering them at [TILE, 128] indices
    # avoids that but is 2-5 % slower on the H200)
    apes = [ape_ref[j, :] for j in range(r)]
    q8, scale = nm.compress_pool(keys, gates, apes, **B.kernel_numerics(tab_ref, interpret))   # [TILE,128], [TILE]
    _store_pools(cache_ref, s, loc, valid, q8, scale)


def _store_pools(cache_ref, s, loc, valid, q8, scale):
    """Pool slots loc [TILE] (where valid) = the fp8 rows q8 [TILE, 128] and scales [TILE]."""
    w = lax.broadcasted_iota(jnp.int32, q8.shape[:1] + (addr.KEY_WORDS,), 1)          # [TILE, 32]
    rk, ck = addr.split_word(s, addr.pool_key_words(s, loc)[:, None] + w)
    B.scatter(cache_ref, rk, ck, nm.pack_fp8_words(q8), valid[:, None] & (w >= 0))
    rs, cs = addr.split_word(s, addr.pool_scale_words(s, loc))
    B.scatter(cache_ref, rs, cs, nm.f32_word(scale), valid)


@functools.partial(jax.jit, static_argnames=("s", "interpret", "tile_pools", "num_warps"))
def compress_prefill(cache, s: CacheStrides, key, gate, ape, slot_mapping, *, interpret=None,
                     tile_pools: int | None = None, num_warps: int | None = None):
    """cache: [total_words] u32; key, gate: [T, 128] bf16; ape: [R, 128] f32; slot_mapping: [T] i32.
    tile_pools (a power of two; None: ``default_tile_pools``), num_warps (None:
    ``default_num_warps``): launch shape (``benchmarks/trace_writes.py --compress-shapes``);
    the bytes are the same for any."""
    t = key.shape[0]
    if t < s.kpool:
        return cache                       # no row can own a whole pool
    tile_pools = default_tile_pools(t, s.kpool) if tile_pools is None else tile_pools
    if tile_pools & (tile_pools - 1):
        raise ValueError(f"tile_pools must be a power of two, got {tile_pools}")
    num_warps = default_num_warps(tile_pools) if num_warps is None else num_warps
    view = cache.reshape(addr.view_shape(s))
    w_rows = tile_pools * s.kpool
    interpret = B.resolve_interpret(interpret)
    out = B.pallas_call(
        functools.partial(_kernel, s=s, t_total=t, tile_pools=tile_pools, interpret=interpret),
        grid=(-(-t // w_rows),),
        out_shape=jax.ShapeDtypeStruct(view.shape, view.dtype),
        input_output_aliases={5: 0},
        interpret=interpret, name="kpool_compress_prefill", num_warps=num_warps,
    )(slot_mapping.astype(jnp.int32), key.astype(jnp.bfloat16), gate.astype(jnp.bfloat16),
      ape.astype(jnp.float32), nm.exp_table_input(), view)
    return out.reshape(-1)
