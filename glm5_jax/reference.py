"""Golden reference: every op of the kpool indexer cache in plain jax.numpy.

This is the spec, executable (spec sections 2, 3, 5.2-5.4). It is jit-able, runs
on any backend, and is the ``implementation="xla"`` of ``glm5_jax.ops``. The
Pallas kernels must write identical bytes.

Every writer takes the flat cache (uint32[total_words]) and returns the new one.
Writes go through ``.at[].set(mode="drop")`` on the [rows, 1024] word view; a
masked-out write is sent to row ``rows`` (past the end) and dropped. All offsets
come from ``pallas_kernels.addressing``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import addressing as addr
from pallas_kernels import numerics as nm
from pallas_kernels.strides import CacheStrides

from .layout import CacheLayout


def _view(cache, s: CacheStrides):
    return cache.reshape(addr.view_shape(s))


def _scatter_words(view, s: CacheStrides, local_words, values, mask):
    """view[local_words] = values where mask (mask broadcast over the word axis)."""
    row, col = addr.split_word(s, local_words)
    row = jnp.where(mask, row, view.shape[0])          # out of range -> dropped
    return view.at[row, col].set(values, mode="drop")


def _gather_words(view, s: CacheStrides, local_words):
    row, col = addr.split_word(s, local_words)
    return view.at[row, col].get(mode="clip")


def _iota_words(n):
    return jnp.arange(n, dtype=jnp.int32)


# ---------------------------------------------------------------------------------
# tail seed (spec 5.3)
# ---------------------------------------------------------------------------------
def seed_tail_strides(cache, s: CacheStrides, key, gate, tslot):
    """key, gate: [T, 128] bf16; tslot: [T] int32 token-granular tail slots.

    Token i is seeded iff its tslot is valid and it is among its request's last R
    tokens of the batch: looking R rows ahead finds the end of the batch, padding,
    or another tail block (= another request).
    """
    t = key.shape[0]
    r = s.kpool
    tslot = tslot.astype(jnp.int32)
    ahead = jnp.concatenate([tslot[r:], jnp.full((min(r, t),), -1, jnp.int32)])[:t]
    valid = addr.tail_slot_valid(s, tslot)
    last_r = (ahead < 0) | (addr.tail_block(s, ahead) != addr.tail_block(s, tslot))
    seeded = valid & last_r                                              # [T]
    blk = addr.tail_block(s, tslot)
    ring_slot = tslot % s.ring
    view = _view(cache, s)
    w = _iota_words(addr.TAIL_ROW_WORDS)
    for half, rows in ((0, key), (1, gate)):
        local = addr.tail_row_words(s, blk, ring_slot, half)[:, None] + w          # [T, 64]
        view = _scatter_words(view, s, local, nm.pack_bf16_words(rows.astype(jnp.bfloat16)),
                              seeded[:, None])
    return view.reshape(-1)


# ---------------------------------------------------------------------------------
# pool record write (shared by both writers)
# ---------------------------------------------------------------------------------
def _write_pools(view, s: CacheStrides, loc, q8, scale, mask):
    """Write fp8 key rows + fp32 scales of pools at slots loc [N] where mask [N]."""
    key_local = addr.pool_key_words(s, loc)[:, None] + _iota_words(addr.KEY_WORDS)   # [N, 32]
    view = _scatter_words(view, s, key_local, nm.pack_fp8_words(q8), mask[:, None])
    return _scatter_words(view, s, addr.pool_scale_words(s, loc), nm.f32_word(scale), mask)


# ---------------------------------------------------------------------------------
# prefill pool compression: the flat-token writer (spec 5.2)
# ---------------------------------------------------------------------------------
def compress_prefill_strides(cache, s: CacheStrides, key, gate, ape, slot_mapping):
    """key, gate: [T, 128] bf16; ape: [R, 128] f32; slot_mapping: [T] int32 pool slots.

    Row i with a valid slot and i >= R-1 pools flat rows i-R+1 .. i (the request's
    chunk must start on a pool boundary, as in vLLM) and writes slot_mapping[i].
    """
    t = key.shape[0]
    r = s.kpool
    loc = slot_mapping.astype(jnp.int32)
    i = jnp.arange(t, dtype=jnp.int32)
    mask = addr.pool_slot_valid(s, loc) & (i >= r - 1)
    ape = ape.astype(jnp.float32)
    members = [jnp.clip(i - (r - 1) + j, 0, max(t - 1, 0)) for j in range(r)]
    keys = [key[m] for m in members]
    gates = [gate[m] for m in members]
    q8, scale = nm.compress_pool(keys, gates, [ape[j] for j in range(r)])
    loc = jnp.where(mask, loc, 0)
    return _write_pools(_view(cache, s), s, loc, q8, scale, mask).reshape(-1)


# ---------------------------------------------------------------------------------
# batched decode update + pool completion (spec 5.4)
# ---------------------------------------------------------------------------------
def decode_update_strides(cache, s: CacheStrides, key, gate, ape, slot_mapping, tslot, positions):
    """key, gate: [B, n, 128] bf16; ape [R, 128] f32; slot_mapping, tslot, positions: [B, n] int32.

    Per request, tokens are taken in index (= position) order. For each token:
    1. if it completes a pool (pos % R == R-1, valid slot): read the pool's first
       R-1 members from the ring (before this token's stash), pool with the
       current token, write the record;
    2. then, if pos >= 0 and its tail slot is valid, stash K and gate in ring slot
       pos % ring (gated on the token-granular tail slot, bug B3).
    Requests are independent (distinct tail blocks), so each token step is
    vectorised over the batch.
    """
    b, n = slot_mapping.shape
    r = s.kpool
    ape = ape.astype(jnp.float32)
    view = _view(cache, s)
    w64 = _iota_words(addr.TAIL_ROW_WORDS)
    for t in range(n):
        pos = positions[:, t].astype(jnp.int32)
        ts = tslot[:, t].astype(jnp.int32)
        loc = slot_mapping[:, t].astype(jnp.int32)
        blk = addr.tail_block(s, ts)                                       # [B] (this token's own)
        live = pos >= 0
        pos_c = jnp.maximum(pos, 0)
        complete = live & (pos_c % r == r - 1) & addr.pool_slot_valid(s, loc)
        keys, gates = [], []
        for j in range(r - 1):
            rs = (jnp.maximum(pos_c - (r - 1), 0) + j) % s.ring
            keys.append(nm.unpack_bf16_words(_gather_words(
                view, s, addr.tail_row_words(s, blk, rs, 0)[:, None] + w64)))
            gates.append(nm.unpack_bf16_words(_gather_words(
                view, s, addr.tail_row_words(s, blk, rs, 1)[:, None] + w64)))
        keys.append(key[:, t].astype(jnp.bfloat16))
        gates.append(gate[:, t].astype(jnp.bfloat16))
        q8, scale = nm.compress_pool(keys, gates, [ape[j] for j in range(r)])
        view = _write_pools(view, s, jnp.where(complete, loc, 0), q8, scale, complete)
        stash = live & addr.tail_slot_valid(s, ts)
        rs_now = pos_c % s.ring
        for half, rows in ((0, key[:, t]), (1, gate[:, t])):
            local = addr.tail_row_words(s, blk, rs_now, half)[:, None] + w64
            view = _scatter_words(view, s, local, nm.pack_bf16_words(rows.astype(jnp.bfloat16)),
                                  stash[:, None])
    return view.reshape(-1)


# ---------------------------------------------------------------------------------
# query FWHT + fp8 (spec 2.3)
# ---------------------------------------------------------------------------------
def fwht_quant(q):
    """q: [rows, 128] bf16 -> (q8 [rows, 128] float8_e4m3fn, scale [rows] f32)."""
    return nm.fwht_quant_rows(q)


# ---------------------------------------------------------------------------------
# public signatures (ARCHITECTURE.md): layout + layer instead of strides
# ---------------------------------------------------------------------------------
def seed_tail(cache, layout: CacheLayout, layer: int, key, gate, tslot):
    return seed_tail_strides(cache, layout.strides(layer), key, gate, tslot)


def compress_prefill(cache, layout: CacheLayout, layer: int, key, gate, ape, slot_mapping):
    return compress_prefill_strides(cache, layout.strides(layer), key, gate, ape, slot_mapping)


def decode_update(cache, layout: CacheLayout, layer: int, key, gate, ape, slot_mapping, tslot, positions):
    return decode_update_strides(cache, layout.strides(layer), key, gate, ape, slot_mapping,
                                 tslot, positions)
