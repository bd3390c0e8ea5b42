"""Triton kernel: prefill pool compression, the flat-token writer (docs/semantics.md 5.2).

Touches ONLY: for every token row i with i >= kpool-1 and a valid pool slot
``loc = slot_mapping[i]``, the 128 key bytes and the 4 scale bytes of pool slot
``loc`` in this layer's indexer pages. Nothing else (no tail bytes).

Split of work: ``pool_targets`` (XLA, through ``addressing``) lists the
pool-completing rows (at most T // kpool: each pool owns its kpool rows, since
chunks start on pool boundaries) and where each record goes, as (row, col)
pairs of the word view. The kernel, one program per TILE_POOLS completions,
gathers the kpool member rows, runs the two-pass gated softmax with
left-to-right sums, rotates, quantises, packs the fp8 bytes into words and
stores the 132-byte record (32 key words + 1 scale word).
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
from .numerics_tl import NAN_ALL, abs_bits, bf16_to_f32, exp_f32, mac_bf16, pool_finish, rotate_quant_words

TILE_POOLS = 4
NUM_WARPS = 4


def pool_targets(s: CacheStrides, slot_mapping):
    """slot_mapping [T] i32 -> (first [N] i32, dst [N, 4] i32), N = T // kpool.

    first: the first member row of each completing pool (row i - kpool + 1 of a
    row i with a valid slot and i >= kpool - 1), -1 padded; dst: (key row, key
    col, scale row, scale col) of its record in the word view, rows -1 for padding.
    """
    t = slot_mapping.shape[0]
    r = s.kpool
    i = jnp.arange(t, dtype=jnp.int32)
    completes = addr.pool_slot_valid(s, slot_mapping) & (i >= r - 1)                 # [T]
    rows = jnp.nonzero(completes, size=t // r, fill_value=-1)[0].astype(jnp.int32)   # [N]
    valid = rows >= 0
    loc = jnp.where(valid, slot_mapping[jnp.maximum(rows, 0)], 0)
    kr, kc = addr.split_word(s, addr.pool_key_words(s, loc))
    sr, sc = addr.split_word(s, addr.pool_scale_words(s, loc))
    dst = jnp.stack([jnp.where(valid, kr, -1), kc, jnp.where(valid, sr, -1), sc], axis=-1)
    return jnp.where(valid, rows - (r - 1), -1), dst.astype(jnp.int32)


@triton.jit
def _member(ptr, first, m, j: tl.constexpr):
    """[TILE, 128] f32 of member row first + j of each pool (masked rows read 0)."""
    d = tl.arange(0, 128)
    x = tl.load(ptr + (first + j)[:, None] * 128 + d[None, :], mask=m, other=0.0)
    return bf16_to_f32(x)


@triton.jit
def _score(gate_ptr, ape_ptr, first, m, j: tl.constexpr):
    """s_j = f32(gate_j) + ape[j], [TILE, 128]."""
    return _member(gate_ptr, first, m, j) + tl.load(ape_ptr + j * 128 + tl.arange(0, 128))[None, :]


@triton.jit
def compress_prefill_kernel(N, first_ptr, dst_ptr, key_ptr, gate_ptr, ape_ptr, cache_in_ptr, cache_ptr,
                            R: tl.constexpr, TILE: tl.constexpr):
    # N: i32 completions; first: [N] i32; dst: [N, 4] i32 (pool_targets); key, gate: [T, 128] bf16;
    # ape: [R * 128 + 64] f32 (the ape rows, then numerics.EXP_TABLE);
    # cache: [total_words] u32 (cache_in_ptr is the same buffer, unused)
    k = tl.program_id(0) * TILE + tl.arange(0, TILE)                      # [TILE] completion index
    ok = k < N
    first = tl.load(first_ptr + k, mask=ok, other=-1)
    if tl.max(first, axis=0) >= 0:                                        # skip padding-only tiles
        m = (first >= 0)[:, None]                                         # [TILE, 1]
        row0 = tl.maximum(first, 0).to(tl.int64)                          # [TILE] first member row
        # pass 1: the per-dimension max of the scores (and the non-finite rule's flag)
        mx = _score(gate_ptr, ape_ptr, row0, m, 0)                        # [TILE, 128]
        flag = abs_bits(mx)
        for j in tl.static_range(1, R):
            sj = _score(gate_ptr, ape_ptr, row0, m, j)
            flag = tl.maximum(flag, abs_bits(sj))
            mx = tl.maximum(mx, sj, propagate_nan=NAN_ALL)
        # pass 2: weights and left-to-right sums
        e = exp_f32(_score(gate_ptr, ape_ptr, row0, m, 0) - mx, ape_ptr + R * 128)
        den = e
        kj = _member(key_ptr, row0, m, 0)
        flag = tl.maximum(flag, abs_bits(kj))
        acc = mac_bf16(tl.zeros_like(e), kj, e)
        for j in tl.static_range(1, R):
            e = exp_f32(_score(gate_ptr, ape_ptr, row0, m, j) - mx, ape_ptr + R * 128)
            den = den + e
            kj = _member(key_ptr, row0, m, j)
            flag = tl.maximum(flag, abs_bits(kj))
            acc = mac_bf16(acc, kj, e)
        words, scale = rotate_quant_words(pool_finish(acc, den), flag, TILE)   # [TILE, 32] u32, [TILE] f32
        # store the record
        krow = tl.load(dst_ptr + k * 4 + 0, mask=ok, other=-1)
        kcol = tl.load(dst_ptr + k * 4 + 1, mask=ok, other=0)
        srow = tl.load(dst_ptr + k * 4 + 2, mask=ok, other=-1)
        scol = tl.load(dst_ptr + k * 4 + 3, mask=ok, other=0)
        w = tl.arange(0, 32)
        tl.store(cache_ptr + word_index(krow, kcol)[:, None] + w[None, :], words, mask=(krow >= 0)[:, None])
        tl.store(cache_ptr + word_index(srow, scol), scale.to(tl.uint32, bitcast=True), mask=srow >= 0)


def plan(cache, s: CacheStrides, key, gate, ape, slot_mapping, *, tile_pools=TILE_POOLS, num_warps=NUM_WARPS):
    """The launch of compress_prefill (None when no row can own a whole pool)."""
    t = key.shape[0]
    if t < s.kpool:
        return None
    first, dst = pool_targets(s, slot_mapping.astype(jnp.int32))
    n = first.shape[0]
    return _call.Launch(compress_prefill_kernel,
                        (first, dst, key.astype(jnp.bfloat16), gate.astype(jnp.bfloat16),
                         nm.ape_with_exp_table(ape), cache),
                        cache_index=5, grid=(-(-n // tile_pools),), num_warps=num_warps,
                        name="kpool_compress_prefill_triton", constexprs=dict(R=s.kpool, TILE=tile_pools),
                        scalars=(n,))


@functools.partial(jax.jit, static_argnames=("s", "tile_pools", "num_warps"))
def compress_prefill(cache, s: CacheStrides, key, gate, ape, slot_mapping, *, tile_pools=TILE_POOLS,
                     num_warps=NUM_WARPS):
    """cache: [total_words] u32; key, gate: [T, 128] bf16; ape: [R, 128] f32; slot_mapping: [T] i32.
    tile_pools (a power of two) and num_warps are launch parameters: same bytes."""
    launch = plan(cache, s, key, gate, ape, slot_mapping, tile_pools=tile_pools, num_warps=num_warps)
    return cache if launch is None else _call.run(launch)
