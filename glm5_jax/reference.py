"""Golden reference: every op of the kpool indexer cache in plain jax.numpy.

This is docs/semantics.md executable (sections 2, 3, 5.2-5.4). It is jit-able, runs
on any backend, and is the ``implementation="xla"`` of ``glm5_jax.ops``. The
Pallas kernels must write identical bytes.

Every writer takes the flat cache (uint32[total_words]) and returns the new one.
Writes go through ``.at[].set(mode="drop")`` on the [rows, 1024] word view; a
masked-out write is sent to row ``rows`` (past the end) and dropped. All offsets
come from ``pallas_kernels.core.addressing``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.core import addressing as addr
from pallas_kernels.core import numerics as nm
from pallas_kernels.core.strides import CacheStrides

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


# The pooling numerics as one jitted function. Called eagerly (a notebook, a test), the
# reference then compiles it once per shape (~0.7 s on CPU) instead of dispatching its
# few hundred ops one by one (~6 s of small compiles for each new shape); inside a
# caller's jit it is inlined, the same program as the plain call.
_compress_pool = jax.jit(nm.compress_pool)


# ---------------------------------------------------------------------------------
# tail seed (docs/semantics.md 5.3)
# ---------------------------------------------------------------------------------
def seed_tail_strides(cache, s: CacheStrides, key, gate, tslot, request_ends_tokens=None):
    """key, gate: [T, 128] bf16; tslot: [T] int32 token-granular tail slots;
    request_ends_tokens: optional [N] int32, one past each request's last row.

    Token i is seeded iff its tslot is valid and it is among its request's last R
    tokens of the batch: looking R rows ahead finds the end of the batch, padding,
    or another tail block (= another request). With request_ends_tokens, also only
    if it lies in the window [e - R, e) of an entry e > 0 (``end_windows``): the rows
    the kernels visit. For entries that agree with the tail slots (what ``ops``
    checks on concrete input) every seeded row lies in a window, so the bytes are
    those without them.
    """
    t = key.shape[0]
    r = s.kpool
    tslot = tslot.astype(jnp.int32)
    ahead = jnp.concatenate([tslot[r:], jnp.full((min(r, t),), -1, jnp.int32)])[:t]
    valid = addr.tail_slot_valid(s, tslot)
    last_r = (ahead < 0) | (addr.tail_block(s, ahead) != addr.tail_block(s, tslot))
    seeded = valid & last_r                                              # [T]
    if request_ends_tokens is not None:
        seeded = seeded & end_windows(t, r, request_ends_tokens)
    blk = addr.tail_block(s, tslot)
    ring_slot = tslot % s.ring
    view = _view(cache, s)
    w = _iota_words(addr.TAIL_ROW_WORDS)
    for half, rows in ((0, key), (1, gate)):
        local = addr.tail_row_words(s, blk, ring_slot, half)[:, None] + w          # [T, 64]
        view = _scatter_words(view, s, local, nm.pack_bf16_words(rows.astype(jnp.bfloat16)),
                              seeded[:, None])
    return view.reshape(-1)


def end_windows(t: int, r: int, request_ends_tokens):
    """[T] bool: row i lies in [e - r, e) for some entry e > 0 of request_ends_tokens
    (entries <= 0 are padding; rows past the batch do not exist). The rows the seed
    kernels visit in their request-ends mode."""
    e = request_ends_tokens.astype(jnp.int32)                           # [N]
    rows = e[:, None] - r + jnp.arange(r, dtype=jnp.int32)[None, :]     # [N, r]
    ok = (e[:, None] > 0) & (rows >= 0) & (rows < t)
    return jnp.zeros((t,), bool).at[jnp.where(ok, rows, t).reshape(-1)].set(True, mode="drop")


# ---------------------------------------------------------------------------------
# pool record write (shared by both writers)
# ---------------------------------------------------------------------------------
def _write_pools(view, s: CacheStrides, loc, q8, scale, mask):
    """Write fp8 key rows + fp32 scales of pools at slots loc [N] where mask [N]."""
    key_local = addr.pool_key_words(s, loc)[:, None] + _iota_words(addr.KEY_WORDS)   # [N, 32]
    view = _scatter_words(view, s, key_local, nm.pack_fp8_words(q8), mask[:, None])
    return _scatter_words(view, s, addr.pool_scale_words(s, loc), nm.f32_word(scale), mask)


# ---------------------------------------------------------------------------------
# prefill pool compression: the flat-token writer (docs/semantics.md 5.2)
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
    q8, scale = _compress_pool(keys, gates, [ape[j] for j in range(r)])
    loc = jnp.where(mask, loc, 0)
    return _write_pools(_view(cache, s), s, loc, q8, scale, mask).reshape(-1)


# ---------------------------------------------------------------------------------
# batched decode update + pool completion (docs/semantics.md 5.4)
# ---------------------------------------------------------------------------------
def decode_update_strides(cache, s: CacheStrides, key, gate, ape, slot_mapping, tslot, positions):
    """key, gate: [B, n, 128] bf16; ape [R, 128] f32; slot_mapping, tslot, positions: [B, n] int32.

    Per request, tokens are taken in index (= position) order. For each token:
    1. if it completes a pool (pos % R == R-1, valid pool slot and valid tail slot:
       ``addressing.decode_completes``): read the pool's first R-1 members from the
       ring (before this token's stash), pool with the current token, write the record;
    2. then, if pos >= 0 and its tail slot is valid, stash K and gate in ring slot
       pos % ring (gated on the token-granular tail slot, bug B3).
    Requests are independent (distinct tail blocks), so each token step is
    vectorised over the batch.
    """
    view = _view(cache, s)
    for t in range(slot_mapping.shape[1]):
        view = _decode_token(view, s, key[:, t], gate[:, t], ape, slot_mapping[:, t], tslot[:, t], positions[:, t])
    return view.reshape(-1)


@functools.partial(jax.jit, static_argnums=1)
def _decode_token(view, s: CacheStrides, key, gate, ape, loc, ts, pos):
    """One token of every request (steps 1 and 2 above): key, gate [B, 128]; loc, ts, pos [B].

    Jitted, so an eager call compiles one token step per shape and runs it n times
    (instead of dispatching some 400 ops per token); inside a caller's jit it is inlined."""
    r = s.kpool
    ape = ape.astype(jnp.float32)
    w64 = _iota_words(addr.TAIL_ROW_WORDS)
    pos = pos.astype(jnp.int32)
    ts = ts.astype(jnp.int32)
    loc = loc.astype(jnp.int32)
    blk = addr.tail_block(s, ts)                                           # [B] (this token's own)
    pos_c = jnp.maximum(pos, 0)
    complete = addr.decode_completes(s, pos, loc, ts)
    keys, gates = [], []
    for j in range(r - 1):
        rs = (jnp.maximum(pos_c - (r - 1), 0) + j) % s.ring
        keys.append(nm.unpack_bf16_words(_gather_words(
            view, s, addr.tail_row_words(s, blk, rs, 0)[:, None] + w64)))
        gates.append(nm.unpack_bf16_words(_gather_words(
            view, s, addr.tail_row_words(s, blk, rs, 1)[:, None] + w64)))
    keys.append(key.astype(jnp.bfloat16))
    gates.append(gate.astype(jnp.bfloat16))
    q8, scale = nm.compress_pool(keys, gates, [ape[j] for j in range(r)])
    view = _write_pools(view, s, jnp.where(complete, loc, 0), q8, scale, complete)
    stash = addr.decode_stashes(s, pos, ts)
    rs_now = pos_c % s.ring
    for half, rows in ((0, key), (1, gate)):
        local = addr.tail_row_words(s, blk, rs_now, half)[:, None] + w64
        view = _scatter_words(view, s, local, nm.pack_bf16_words(rows.astype(jnp.bfloat16)),
                              stash[:, None])
    return view


# ---------------------------------------------------------------------------------
# query FWHT + fp8 (docs/semantics.md 2.3)
# ---------------------------------------------------------------------------------
def fwht_quant(q):
    """q: [rows, 128] bf16 -> (q8 [rows, 128] float8_e4m3fn, scale [rows] f32)."""
    return nm.fwht_quant_rows(q)


# ---------------------------------------------------------------------------------
# public signatures: layout + layer instead of strides
# ---------------------------------------------------------------------------------
def seed_tail(cache, layout: CacheLayout, layer: int, key, gate, tslot, request_ends_tokens=None):
    return seed_tail_strides(cache, layout.strides(layer), key, gate, tslot, request_ends_tokens)


def compress_prefill(cache, layout: CacheLayout, layer: int, key, gate, ape, slot_mapping):
    return compress_prefill_strides(cache, layout.strides(layer), key, gate, ape, slot_mapping)


def decode_update(cache, layout: CacheLayout, layer: int, key, gate, ape, slot_mapping, tslot, positions):
    return decode_update_strides(cache, layout.strides(layer), key, gate, ape, slot_mapping,
                                 tslot, positions)


# =================================================================================
# READ PATH (docs/semantics.md 1.3, 2.3-2.5, 5.5-5.10): query weights, paged logits, top-k over
# pools, expansion to tokens, and the whole selection for a batch.
# =================================================================================
import numpy as _np
from jax import lax as _lax

from .config import MAX_HEADS  # noqa: E402  (the head limit lives with the config that checks it)
_INT32_MIN = -(2**31)


def padded_heads(n_heads: int) -> int:
    """Head count the logits kernels run with: 32 for H <= 32, else 64 (docs/semantics.md 2.3)."""
    if not isinstance(n_heads, int) or not 1 <= n_heads <= MAX_HEADS:
        raise ValueError(f"indexer heads must be an int in [1, {MAX_HEADS}], got {n_heads!r}")
    return 32 if n_heads <= 32 else 64


def weight_fold_constant(n_heads: int):
    """D**-1/2 * H**-1/2 in f32, with the REAL head count H (docs/semantics.md 2.3)."""
    return _np.float32(128 ** -0.5 * n_heads ** -0.5)


def fold_weights(weights, q_scale):
    """w' = w * qs * (D**-1/2 H**-1/2) in f32, zero-padded along heads (docs/semantics.md 2.3).

    weights, q_scale: [..., H] f32 (H = the real head count). Returns [..., Hp] f32
    with Hp = padded_heads(H); padded heads are exactly 0 and contribute nothing.
    """
    h = weights.shape[-1]
    hp = padded_heads(h)
    w = (weights.astype(jnp.float32) * q_scale.astype(jnp.float32)) * weight_fold_constant(h)
    return jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, hp - h)])


def pad_heads(q8):
    """[..., H, 128] float8_e4m3fn -> [..., Hp, 128], zero rows for the padded heads."""
    h = q8.shape[-2]
    hp = padded_heads(h)
    return jnp.pad(q8, [(0, 0)] * (q8.ndim - 2) + [(0, hp - h), (0, 0)])


def prepare_queries(q, weights):
    """q [..., H, 128] bf16, weights [..., H] f32 -> (q8 [..., Hp, 128] e4m3fn, w' [..., Hp] f32).

    FWHT + fp8 per (token, head) row, the query scale folded into the weights,
    heads zero-padded (docs/semantics.md 2.3, 5.1).
    """
    lead, h = q.shape[:-2], q.shape[-2]
    q8, qs = fwht_quant(q.reshape(-1, 128))
    q8 = q8.reshape(lead + (h, 128))
    return pad_heads(q8), fold_weights(weights, qs.reshape(lead + (h,)))


def unpack_fp8_words(words):
    """[..., 32] uint32 -> [..., 128] float8_e4m3fn (little-endian bytes of each word)."""
    lead = words.shape[:-1]
    b = _lax.bitcast_convert_type(words, jnp.uint8).reshape(lead + (128,))
    return _lax.bitcast_convert_type(b, jnp.float8_e4m3fn)


def gather_pools(cache, s: CacheStrides, page_table_pages):
    """Every pool a request's page table can reach, as the logits kernels read it.

    page_table_pages: [B, max_pages] i32 page ids. Returns (k8 [B, M, 128] e4m3fn,
    scale [B, M] f32, page_ok [B, M] bool) with M = max_pages * page_rows and pool
    m of request b read from page table[b, m // P], row m % P. A pool on an invalid
    page id (< 0 or >= num_pages) is never read (zeros, page_ok False).
    """
    view = _view(cache, s)
    m = jnp.arange(addr.pools_in_pages(s, page_table_pages.shape[1]), dtype=jnp.int32)
    col, row = addr.pool_page_row(s, m)                                       # [M]
    page = page_table_pages.astype(jnp.int32)[:, col]                          # [B, M]
    ok = addr.page_valid(s, page)
    page = jnp.where(ok, page, 0)
    kw = addr.page_key_words(s, page, row)[..., None] + _iota_words(addr.KEY_WORDS)
    k8 = unpack_fp8_words(jnp.where(ok[..., None], _gather_words(view, s, kw), 0))
    sw = _gather_words(view, s, addr.page_scale_words(s, page, row))
    scale = jnp.where(ok, _lax.bitcast_convert_type(sw, jnp.float32), 0.0)
    return k8, scale, ok


def logits_from_pools(q8, weights, k8, kscale, page_ok, context_pools):
    """logit[b, j, m] = sum_h w'[b,j,h] relu(dot(q8[b,j,h], k8[b,m]) * kscale[b,m]) (docs/semantics.md 2.4).

    -inf for m >= context_pools[b, j] and for pools on invalid pages.
    q8 [B, n, Hp, 128] e4m3fn; weights [B, n, Hp] f32; k8 [B, M, 128]; kscale [B, M].
    """
    # bf16 operands: every e4m3 value is exact in bf16, so the products are exact and
    # the dot accumulates in f32. An einsum of the fp8 arrays themselves runs on the
    # H200's fp8 tensor cores with their reduced-precision accumulation: up to 1.6e-3 of
    # a row's largest logit off the f64 golden scores, and different bits for each row
    # count (tests/scripts/gpu_numerics_diag.py measures both).
    sc = jnp.einsum("bnhd,bmd->bnhm", q8.astype(jnp.bfloat16), k8.astype(jnp.bfloat16),
                    preferred_element_type=jnp.float32)
    sc = jnp.maximum(sc * kscale[:, None, None, :], 0.0)
    logit = jnp.sum(weights.astype(jnp.float32)[..., None] * sc, axis=2)       # [B, n, M]
    m = jnp.arange(k8.shape[1], dtype=jnp.int32)
    live = page_ok[:, None, :] & (m < context_pools.astype(jnp.int32)[..., None])
    return jnp.where(live, logit, -jnp.inf)


def paged_logits_strides(cache, s: CacheStrides, q8, weights, page_table_pages, context_pools):
    """Decode (and prefill) logits over each request's own pages (docs/semantics.md 5.7, 5.8).

    q8 [B, n, Hp, 128] e4m3fn; weights [B, n, Hp] f32 (q-scale folded);
    page_table_pages [B, max_pages] i32; context_pools [B, n] i32.
    Returns [B, n, max_pages * page_rows] f32; -inf past each row's context.
    Prefill is the same call with B = 1 and n = the request's query rows.
    """
    k8, kscale, ok = gather_pools(cache, s, page_table_pages)
    return logits_from_pools(q8, weights, k8, kscale, ok, context_pools)


def order_key(x):
    """f32 score -> uint32 key whose unsigned order is the score order (exact).

    -0.0 and +0.0 get the same key; every NaN gets key 1 (below -inf, 0x007FFFFF);
    key 0 is never produced (it marks "no element").
    """
    x = x.astype(jnp.float32)
    u = _lax.bitcast_convert_type(x, jnp.uint32)
    u = jnp.where(x == 0.0, jnp.uint32(0), u)
    key = jnp.where((u >> 31) != 0, ~u, u | jnp.uint32(0x80000000))
    return jnp.where(jnp.isnan(x), jnp.uint32(1), key)


def topk_pools(logits, lengths, k: int):
    """Exact, deterministic top-k pools per row (docs/semantics.md 2.5, 5.9).

    logits [rows, n] f32; lengths [rows] i32: pools >= length are invalid.
    Returns [rows, k] i32 pool ids ordered by descending score, ties by ascending
    pool id, then -1 for the slots a row with fewer than k valid pools leaves.
    """
    rows, n = logits.shape
    key = order_key(logits)
    valid = jnp.arange(n, dtype=jnp.int32)[None, :] < lengths.astype(jnp.int32)[:, None]
    # signed view of the key; invalid -> INT32_MIN, below every real key (>= 1)
    skey = _lax.bitcast_convert_type(key ^ jnp.uint32(0x80000000), jnp.int32)
    skey = jnp.where(valid, skey, _INT32_MIN)
    if n < k:
        skey = jnp.pad(skey, ((0, 0), (0, k - n)), constant_values=_INT32_MIN)
    top, idx = _lax.top_k(skey, k)          # documented: equal values -> lower index first
    return jnp.where(top == _INT32_MIN, -1, idx).astype(jnp.int32)


ORDERS = ("score", "pool")     # select_tokens' orders of the selected pools


def pool_order(ids):
    """ids [..., m] i32 (pool ids or their token indices, -1 = empty) in ascending order,
    the -1 entries after the others: the order ``select_tokens(order="pool")`` gives
    the selected pools. Pools expand to disjoint runs of consecutive tokens, so sorting
    the tokens of a row's pool columns sorts its pools."""
    big = jnp.iinfo(jnp.int32).max
    srt = jnp.sort(jnp.where(ids < 0, big, ids.astype(jnp.int32)), axis=-1)
    return jnp.where(srt == big, -1, srt)


def check_order(op: str, order) -> None:
    if order not in ORDERS:
        raise ValueError(f"{op}: order must be one of {ORDERS}, got {order!r}")


def expand_pools(pool_ids, seq_lens_tokens, kpool: int):
    """Pool ids -> token indices, then the row's incomplete-pool tail (docs/semantics.md 5.10).

    pool_ids [rows, k] i32; seq_lens_tokens [rows] i32 (= p + 1 for a query at
    position p; <= 0 for padding). Returns [rows, k*kpool + kpool - 1] i32:
    column g*kpool + o holds pool_ids[g]*kpool + o, then columns k*kpool + t hold
    tail token (seq_len // kpool)*kpool + t for t < seq_len % kpool; -1 elsewhere.
    A pool id < 0 or >= seq_len // kpool (not a complete pool of this row) is
    rejected: -1 in all its columns (docs/semantics.md B13), never expanded.
    """
    r = kpool
    rows, k = pool_ids.shape
    seq = jnp.maximum(seq_lens_tokens.astype(jnp.int32), 0)
    n_pools = seq // r
    pid = pool_ids.astype(jnp.int32)
    ok = (pid >= 0) & (pid < n_pools[:, None])
    o = jnp.arange(r, dtype=jnp.int32)
    tok = jnp.where(ok[..., None], pid[..., None] * r + o, -1).reshape(rows, k * r)
    t = jnp.arange(r - 1, dtype=jnp.int32)
    tail = jnp.where(t < (seq % r)[:, None], (n_pools * r)[:, None] + t, -1)
    return jnp.concatenate([tok, tail], axis=1)


def causal_fill(positions, width: int):
    """Short-context path (docs/semantics.md 5.5): row at position p -> [0, 1, ..., p, -1, ...].

    positions [...] i32 (< 0 = padding: all -1). Returns [..., width] i32.
    """
    c = jnp.arange(width, dtype=jnp.int32)
    return jnp.where(c <= positions.astype(jnp.int32)[..., None], c, -1)


def seq_lens_from_positions(positions):
    """Token-granular sequence length of each query row: p + 1, 0 for padding (p < 0)."""
    p = positions.astype(jnp.int32)
    return jnp.where(p >= 0, p + 1, 0)


def _is_concrete(x):
    return not isinstance(x, jax.core.Tracer)


def use_short_path(positions, topk_tokens: int, short_context):
    """True/False (Python) when decidable now, else a traced bool (docs/semantics.md 5.5)."""
    if short_context is not None:
        return bool(short_context)
    longest = jnp.max(seq_lens_from_positions(positions)) if positions.size else jnp.int32(0)
    if _is_concrete(longest):
        return bool(longest <= topk_tokens)
    return longest <= topk_tokens


def branch_short(short, fill, sparse):
    """Run the short-context fill or the sparse path: a Python choice when `short`
    is known now, a lax.cond on the device otherwise (same output shape). On the
    H200 with jax 0.11.2 a conditional does not make the call wait for the device
    (docs/benchmarks.md; ``glm5_jax.serving.sharding.host_waits`` finds the instructions
    that would)."""
    if isinstance(short, bool):
        return fill() if short else sparse()
    return _lax.cond(short, fill, sparse)


# Prefill scoring materialises [rows, Hp, pools] f32 scores; the XLA path walks
# the query rows in chunks that keep that under this budget (vLLM: 512 MiB).
LOGITS_BUDGET_BYTES = 512 * 2**20


def query_row_chunk(n_rows: int, hp: int, n_pools: int, batch: int = 1, budget_bytes: int | None = None) -> int:
    """Query rows per chunk so that [batch, rows, hp, pools] f32 stays within budget_bytes
    (default LOGITS_BUDGET_BYTES); at least one row."""
    budget = LOGITS_BUDGET_BYTES if budget_bytes is None else budget_bytes
    per_row = max(1, batch * hp * max(n_pools, 1) * 4)
    return max(1, min(n_rows, budget // per_row))


def map_query_rows(fn, chunk: int, *arrays, window_start: bool = False):
    """fn over windows of rows of [B, n, ...] arrays (axis 1), written into one [B, n, ...]
    result: no padded copy of the inputs, no sliced copy of the output.

    The n rows go in ceil(n / chunk) windows of w = ceil(n / windows) <= chunk rows each,
    window i at rows min(i * w, n - w) .. + w: the last window may repeat fewer than
    `windows` rows of the one before it, so fn must give each row the same result
    whatever other rows share its window (every read path's rows are independent).
    fn maps [B, w, ...] arrays to one [B, w, ...] array; with ``window_start`` it is
    called as fn(first_row, *windows), first_row the window's first row (int32; 0 for
    one call over all rows), so that it can read other [B, n, ...] arrays at those rows
    itself.
    """
    n = arrays[0].shape[1]
    lead = (jnp.int32(0),) if window_start else ()
    if chunk >= n:
        return fn(*lead, *arrays)
    n_windows = -(-n // chunk)
    window_rows = -(-n // n_windows)
    part = jax.eval_shape(fn, *(jax.ShapeDtypeStruct((), jnp.int32),) * window_start,
                          *(jax.ShapeDtypeStruct(a.shape[:1] + (window_rows,) + a.shape[2:], a.dtype)
                            for a in arrays))
    if not isinstance(part, jax.ShapeDtypeStruct) or part.shape[1] != window_rows:
        raise ValueError(f"map_query_rows: fn must return one [B, {window_rows}, ...] array, got {part}")

    def window(i, out):                                  # out: [B, n, ...]
        first_row = jnp.minimum(i * window_rows, n - window_rows).astype(jnp.int32)
        y = fn(*((first_row,) if window_start else ()),
               *(_lax.dynamic_slice_in_dim(a, first_row, window_rows, axis=1) for a in arrays))
        return _lax.dynamic_update_slice_in_dim(out, y, first_row, axis=1)

    out = jnp.zeros(part.shape[:1] + (n,) + part.shape[2:], part.dtype)
    return _lax.fori_loop(0, n_windows, window, out)


def select_tokens_strides(cache, s: CacheStrides, q8, weights, page_table_pages, positions,
                          topk_tokens: int, short_context=None, budget_bytes: int | None = None,
                          order: str = "score"):
    """The whole read path of one indexer layer for a batch (docs/semantics.md 1.3, appendix C).

    q8 [B, n, Hp, 128] e4m3fn; weights [B, n, Hp] f32 (folded); page_table_pages
    [B, max_pages] i32; positions [B, n] i32 (absolute token position of each query
    row; -1 = padding). Returns [B * n, topk_tokens + kpool - 1] i32 request-relative
    token indices, rows in (b, j) order: the top topk_tokens/kpool pools expanded to
    tokens (descending score, ties by lower pool id; with order="pool" the same pools
    by ascending pool id, ``pool_order``), then the incomplete-pool tail; -1 marks
    empty columns. When every row's context is <= topk_tokens (short path,
    docs/semantics.md 5.5) a row holds all causal tokens 0..p instead, then -1.
    """
    check_order("select_tokens", order)
    r = s.kpool
    b, n = positions.shape
    width = topk_tokens + r - 1
    k = topk_tokens // r
    hp = q8.shape[2]

    def fill():
        return causal_fill(positions, width).reshape(b * n, width)

    def sparse():
        n_pools = addr.pools_in_pages(s, page_table_pages.shape[1])
        k8, kscale, ok = gather_pools(cache, s, page_table_pages)

        def rows(q, w, p):                      # [B, c, ...] -> [B, c, width]
            seq = seq_lens_from_positions(p)
            logits = logits_from_pools(q, w, k8, kscale, ok, seq // r)
            bb, c = p.shape
            ids = topk_pools(logits.reshape(bb * c, -1), (seq // r).reshape(-1), k)
            if order == "pool":
                ids = pool_order(ids)
            return expand_pools(ids, seq.reshape(-1), r).reshape(bb, c, width)

        chunk = query_row_chunk(n, hp, n_pools, b, budget_bytes)
        return map_query_rows(rows, chunk, q8, weights, positions).reshape(b * n, width)

    return branch_short(use_short_path(positions, topk_tokens, short_context), fill, sparse)


def paged_logits(cache, layout: CacheLayout, layer: int, q8, weights, page_table_pages, context_pools):
    return paged_logits_strides(cache, layout.strides(layer), q8, weights, page_table_pages, context_pools)


def select_tokens(cache, layout: CacheLayout, layer: int, q8, weights, page_table_pages, positions,
                  topk_tokens: int | None = None, short_context=None, order: str = "score"):
    t = layout.config.topk if topk_tokens is None else topk_tokens
    return select_tokens_strides(cache, layout.strides(layer), q8, weights, page_table_pages,
                                 positions, t, short_context, order=order)
