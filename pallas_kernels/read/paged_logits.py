"""Kernel: paged indexer logits, decode and prefill (docs/semantics.md 2.4, 5.7, 5.8).

    logit[b, j, m] = sum_h w'[b, j, h] * relu(dot(q8[b, j, h], K8[m]) * kscale[m])

for request-relative pool m < context_pools[b, j], -inf elsewhere. Pool m of
request b is row m % P of page page_table[b, m // P] (P = page_rows, page units).

Reads ONLY: the query rows, weights, context lengths and page-table entries of
its programs, and the 128 key bytes + 4 scale bytes of every pool a row can see
(pages whose id is out of range are never read; their pools score -inf).
Writes ONLY its output [B, n, max_pages * P] f32. The cache is not modified.

Grid: (B, ceil(n / BN), ceil(max_pages / (pages_per_step * steps))). A program
holds BN query rows of one request (the next_n rows of a decode request share
every page read) and walks `steps` steps of `pages_per_step` (G) page-table
columns (``Tuning``). Per step it gathers the G pages' key rows at once (more
bytes in flight than one page at a time) and their G*P scales, computes the dot
[BN*Hp, 128] x [128, G*P] -> f32 (fp8 operands, or f16 from 64 dot rows:
``pages_logits``), scales, applies ReLU, sums the weighted heads and stores
[BN, G*P] logits. Columns past the block's longest context store -inf without
touching the cache.

Keys are read through a u8 byte view of the cache (an XLA bitcast of the u32
word view, no copy) as 16-byte groups, [G*P, 128] fp8 as stored, wherever that
is safe (``key_source``); else as u32 words, transposed and unpacked into
K-major bytes in the kernel (``load_pages``).

The helpers ``load_query_block``, ``load_pages`` and ``pages_logits`` (through
``score_pages``) are shared with the fused logits -> top-k kernel
(paged_topk.py), so both score a pool with the same operations.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ..core import backend as B
from ..core import addressing as addr
from ..core import numerics as nm
from ..core.strides import CacheStrides

PAGES_PER_STEP = 4          # page-table columns gathered at once (defaults of Tuning:
STEPS = 1                   # the fastest shape on the H200 with the byte view,
NUM_WARPS = 4               # docs/benchmarks.md; bench_read --sweep)
SMALL_DOT_ROWS = 32         # up to this many dot rows (decode, one query row of 32 heads): 2 warps
SMALL_DOT_WARPS = 2         # (Nsight Compute at B = 64 x 128k: 104-108 us against 111-122 us at
                            # 4 warps, docs/benchmarks.md; at 128 rows 2 warps take 2.2x longer)
MAX_DOT_ROWS = 128          # BN * Hp: query rows per program times padded heads
WGMMA_DOT_ROWS = 64         # from this many dot rows the f16 dot (wgmma): 4 rows x 32 heads at
                            # 4 pages x 4 warps 1.06x / 1.03x the fp8 dot (docs/benchmarks.md)


def _iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def check_geometry(s: CacheStrides, hp: int):
    """The kernels need power-of-two tiles: P in {16, 32, 64}, Hp in {32, 64}."""
    if s.page_rows not in (16, 32, 64):
        raise ValueError(f"the Pallas read kernels need page_rows in (16, 32, 64), got {s.page_rows}")
    if hp not in (32, 64):
        raise ValueError(f"the Pallas read kernels need 32 or 64 (padded) heads, got {hp}")


def rows_per_block(n: int, hp: int) -> int:
    """BN: query rows per program, a power of two with BN * Hp <= MAX_DOT_ROWS."""
    return max(1, min(next_pow2(n), MAX_DOT_ROWS // hp))


class QueryBlock(NamedTuple):
    q8: jax.Array          # [BN*Hp, 128] e4m3fn (rows past n: a copy of row n-1)
    w: jax.Array           # [BN*Hp] f32        (zero past n)
    ctx: jax.Array         # [BN] i32 context pools (0 past n)
    row_ok: jax.Array      # [BN] bool: row r0 + i < n
    flat: jax.Array        # [BN] i32 flat row b*n + r (clamped into range)


def load_query_block(ctx_ref, q_ref, w_ref, b, r0, *, n: int, hp: int, bn: int) -> QueryBlock:
    """Rows r0 .. r0+BN-1 of request b.

    ctx_ref: [B*n] i32; q_ref: [B*n*Hp, 128] e4m3fn; w_ref: [B*n, Hp] f32.
    """
    r = r0 + _iota((bn,), 0)
    row_ok = r < n
    flat = b * n + jnp.minimum(r, n - 1)                                           # [BN]
    ctx = B.load(ctx_ref.at[flat], mask=row_ok, other=0)
    ctx = jnp.where(row_ok, jnp.maximum(ctx, 0), 0)
    d = _iota((bn * hp,), 0)                                                       # dot row
    i, h = d // hp, d % hp
    qflat = b * n + jnp.minimum(r0 + i, n - 1)
    d_ok = (r0 + i) < n                                                            # [BN*Hp]
    col = _iota((bn * hp, nm.HEAD_DIM), 1)
    # rows past n re-read row n-1 (in range, unmasked: fp8 has no masked-load fill on
    # Triton); their weights are 0 and their logits are never stored
    q8 = B.gather(q_ref, (qflat * hp + h)[:, None] + 0 * col, col)                # [BN*Hp, 128]
    w = B.gather(w_ref, qflat, h, mask=d_ok, other=0.0)                            # [BN*Hp]
    return QueryBlock(q8, w, ctx, row_ok, flat)


def unpack_fp8_words_t(w):
    """[32, N] uint32 (word w of pool r at [w, r]) -> [128, N] float8_e4m3fn (byte d of
    pool r at [d, r]): the keys transposed, K-major, as the B operand of the dot."""
    n = w.shape[1]
    shift = (_iota((addr.KEY_WORDS, 4, n), 1) * 8).astype(jnp.uint32)
    b = ((w[:, None, :] >> shift) & 0xFF).astype(jnp.uint8).reshape(nm.HEAD_DIM, n)
    return lax.bitcast_convert_type(b, nm.FP8)


def key_source(s: CacheStrides, byte_view=None) -> bool:
    """Whether the read kernels load keys through the byte view (True) or the
    word view (False). byte_view None: the byte view wherever it is safe, i.e.
    key rows 16-byte aligned (``addressing.key_rows_16b_aligned``) and a buffer
    size whose byte offsets the backend indexes correctly
    (``_backend.narrow_offsets_safe``: not between 2 and 4 GiB). True where unsafe
    is an error."""
    safe = addr.key_rows_16b_aligned(s) and B.narrow_offsets_safe(s.total_bytes)
    if byte_view is None:
        return safe
    if byte_view and not safe:
        raise ValueError(f"the byte view cannot read this layout (16-byte aligned key rows: "
                         f"{addr.key_rows_16b_aligned(s)}, {s.total_bytes} bytes in the buffer)")
    return bool(byte_view)


def cache_views(cache, s: CacheStrides, byte_view: bool):
    """The kernel inputs for the cache: the u32 word view, plus the u8 byte view
    of the same buffer when keys are read as bytes (an XLA bitcast: no copy)."""
    view = cache.reshape(addr.view_shape(s))
    if not byte_view:
        return (view,)
    return view, lax.bitcast_convert_type(view, jnp.uint8).reshape(addr.byte_view_shape(s))


def load_pages(cache_ref, bytes_ref, s: CacheStrides, pages, ok):
    """Keys and scales of G pages at once (more bytes in flight per program).

    pages: [G] i32 page ids; ok: [G] bool (nothing of a page is read unless ok).
    Returns (k8t [128, G*P] e4m3fn, column g*P + r = row r of pages[g], transposed;
    kscale [G*P] f32).

    bytes_ref (the byte view) given: each key row is loaded as 8 aligned 16-byte
    groups, [G*P, 128] e4m3fn as stored, and handed to the dot transposed (Triton
    puts it in shared memory as loaded; 19 instead of 31 warp instructions per pool,
    1.5x faster on the H200, docs/benchmarks.md). bytes_ref None: the
    [G*P, 32] u32 key words (neighbouring lanes read neighbouring words), transposed
    and unpacked into K-major bytes.
    """
    g, p = pages.shape[0], s.page_rows
    gp = addr.pools_in_pages(s, g)
    page_r = jnp.broadcast_to(jnp.where(ok, pages, 0)[:, None], (g, p)).reshape(gp)   # [G*P]
    ok_r = jnp.broadcast_to(ok[:, None], (g, p)).reshape(gp)
    row_r = _iota((gp,), 0) % p
    rs, cs = addr.split_word(s, addr.page_scale_words(s, page_r, row_r))
    kscale = lax.bitcast_convert_type(B.gather(cache_ref, rs, cs, mask=ok_r, other=0), jnp.float32)
    if bytes_ref is not None:
        rb, cb = addr.page_key_bytes(s, page_r, row_r)                             # [G*P, 8, 16]
        kb = B.gather(bytes_ref, rb, cb, mask=jnp.broadcast_to(ok_r[:, None, None], rb.shape), other=0)
        return lax.bitcast_convert_type(kb.reshape(gp, nm.HEAD_DIM), nm.FP8).T, kscale
    w = _iota((gp, addr.KEY_WORDS), 1)
    rr, cc = addr.split_word(s, addr.page_key_words(s, page_r, row_r)[:, None] + w)
    words = B.gather(cache_ref, rr, cc, mask=ok_r[:, None] & (w >= 0), other=0).T     # [32, G*P]
    return unpack_fp8_words_t(words), kscale


DOT_FORMS = ("fp8", "f16")


def pages_logits(qb: QueryBlock, k8t, kscale, *, bn: int, hp: int, dot: str = "fp8"):
    """[BN, G*P] f32 logits of G pages for the block's rows (no context masking):
    the dot [BN*Hp, 128] x [128, G*P], scaled, ReLU, weighted sum over heads.

    Dot forms (``Tuning.dot_for``: "fp8" below WGMMA_DOT_ROWS dot rows, "f16" from
    there): "fp8" on the fp8 operands, which Triton runs as mma.sync on f16
    converted in registers: its wgmma path refuses fp8 with f32 accumulation unless
    the dot allows imprecise accumulation, which the Pallas lowering does not set.
    "f16": the same dot on f16 operands (fp8 -> f16 is exact), which Triton runs as
    wgmma where the dot has >= 64 rows and the program >= 4 warps (prefill blocks;
    1.03-1.06x at 4 rows x 32 heads on the H200). There is no decode form with the pools
    as the wgmma's 128 rows: with f16 operands and 4 or 8 warps it takes 1.45-1.76x
    longer than "fp8" at 2 warps (58-79M instructions against 36.6M).
    """
    if dot == "f16":
        sc = jnp.dot(qb.q8.astype(jnp.float16), k8t.astype(jnp.float16),
                     preferred_element_type=jnp.float32)                           # [BN*Hp, G*P]
    else:
        sc = jnp.dot(qb.q8, k8t, preferred_element_type=jnp.float32)               # [BN*Hp, G*P]
    sc = jnp.maximum(sc * kscale[None, :], 0.0)
    sc = sc * qb.w[:, None]
    return jnp.sum(sc.reshape(bn, hp, sc.shape[-1]), axis=1)                      # [BN, G*P]


def score_pages(cache_ref, bytes_ref, table_ref, s: CacheStrides, qb: QueryBlock, b, col0, enabled, *,
                n_pages: int, bn: int, hp: int, max_pages: int, dot: str = "fp8"):
    """Logits of page-table columns col0 .. col0 + n_pages - 1 of request b.

    Returns (logits [BN, G*P] f32 with -inf outside context or on an invalid page,
    pools [G*P] i32 request-relative pool ids, live [BN, G*P] bool = pool < context).
    Reads a page only if `enabled` (scalar, or [G]: per page) and its id is valid; keys
    through bytes_ref (the byte view) unless it is None (``load_pages``).
    """
    g, p = n_pages, s.page_rows
    gp = addr.pools_in_pages(s, g)
    cols = col0 + _iota((g,), 0)                                                   # [G]
    in_table = cols < max_pages
    pages = B.gather(table_ref, b + 0 * cols, jnp.minimum(cols, max_pages - 1))    # [G]
    page_ok = enabled & in_table & addr.page_valid(s, pages)
    k8t, kscale = load_pages(cache_ref, bytes_ref, s, pages, page_ok)
    lg = pages_logits(qb, k8t, kscale, bn=bn, hp=hp, dot=dot)                      # [BN, G*P]
    pools = addr.table_pool(s, col0, _iota((gp,), 0))                              # [G*P]
    ok_r = jnp.broadcast_to((in_table & page_ok)[:, None], (g, p)).reshape(gp)
    live = (pools[None, :] < qb.ctx[:, None]) & (pools < addr.pools_in_pages(s, max_pages))[None, :]
    return jnp.where(live & ok_r[None, :], lg, -jnp.inf), pools, live


def _kernel(ctx_ref, table_ref, q_ref, w_ref, cache_ref, *refs,
            s: CacheStrides, n: int, hp: int, bn: int, max_pages: int, tune: "Tuning", byte_view: bool):
    # ctx_ref: [B*n] i32; table_ref: [B, max_pages] i32; q_ref: [B*n*Hp, 128] e4m3fn;
    # w_ref: [B*n, Hp] f32; cache_ref: [rows, 1024] u32; (bytes_ref: [rows, 4096] u8, the
    # same buffer, if byte_view); out_ref: [B*n, max_pages*P] f32
    bytes_ref, out_ref = refs if byte_view else (None,) + refs
    b, rb, g = B.program_id(0), B.program_id(1), B.program_id(2)
    gp = addr.pools_in_pages(s, tune.pages_per_step)
    qb = load_query_block(ctx_ref, q_ref, w_ref, b, rb * bn, n=n, hp=hp, bn=bn)
    need = addr.pages_for_pools(s, jnp.max(qb.ctx))                               # columns in use
    rows2 = qb.flat[:, None] + 0 * _iota((bn, gp), 1)                              # [BN, G*P]
    ok_rows = qb.row_ok[:, None] & (_iota((bn, gp), 1) >= 0)

    def step(j, carry):
        col0 = (g * tune.steps + j) * tune.pages_per_step
        pools = addr.table_pool(s, col0, _iota((bn, gp), 1))                       # [BN, G*P]
        store_ok = ok_rows & (pools < addr.pools_in_pages(s, max_pages))

        @B.when(col0 < need)
        def _score():
            lg, _, _ = score_pages(cache_ref, bytes_ref, table_ref, s, qb, b, col0, col0 < need,
                                   n_pages=tune.pages_per_step, bn=bn, hp=hp, max_pages=max_pages,
                                   dot=tune.dot_for(bn * hp))
            B.scatter(out_ref, rows2, pools, lg, store_ok)

        @B.when(col0 >= need)
        def _empty():
            B.scatter(out_ref, rows2, pools, jnp.full((bn, gp), -jnp.inf, jnp.float32), store_ok)

        return carry

    lax.fori_loop(0, tune.steps, step, 0)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Launch shape of the logits kernel: a program walks `steps` steps of
    `pages_per_step` page-table columns each (all pages of a step are gathered at
    once). Chosen by ``benchmarks/bench_read.py --sweep`` on the H200. num_warps
    and dot None: by the dot's rows (``warps_for``, ``dot_for``)."""
    pages_per_step: int = PAGES_PER_STEP
    steps: int = STEPS
    num_warps: int | None = None
    byte_view: bool | None = None       # keys through the byte view: None = wherever safe (key_source)
    dot: str | None = None              # the dot's form (pages_logits, DOT_FORMS)

    def __post_init__(self):
        if (self.pages_per_step not in (1, 2, 4, 8, 16) or self.steps < 1
                or self.num_warps not in (None, 1, 2, 4, 8) or self.dot not in (None,) + DOT_FORMS):
            raise ValueError(f"bad paged_logits tuning {self}")

    def warps_for(self, dot_rows: int) -> int:
        """Warps of a program whose dot has `dot_rows` rows (BN * Hp): num_warps if set,
        else SMALL_DOT_WARPS up to SMALL_DOT_ROWS rows, NUM_WARPS above."""
        if self.num_warps is not None:
            return self.num_warps
        return SMALL_DOT_WARPS if dot_rows <= SMALL_DOT_ROWS else NUM_WARPS

    def dot_for(self, dot_rows: int) -> str:
        """The dot's form: `dot` if set, else "f16" (wgmma) from WGMMA_DOT_ROWS rows,
        "fp8" below (decode)."""
        if self.dot is not None:
            return self.dot
        return "f16" if dot_rows >= WGMMA_DOT_ROWS else "fp8"


@functools.partial(jax.jit, static_argnames=("s", "interpret", "tune"))
def paged_logits(cache, s: CacheStrides, q8, weights, page_table_pages, context_pools, *, interpret=None,
                 tune: Tuning = Tuning()):
    """cache: [total_words] u32; q8: [B, n, Hp, 128] e4m3fn; weights: [B, n, Hp] f32;
    page_table_pages: [B, max_pages] i32; context_pools: [B, n] i32.
    Returns [B, n, max_pages * page_rows] f32."""
    b, n, hp, _ = q8.shape
    max_pages = page_table_pages.shape[1]
    check_geometry(s, hp)
    m = addr.pools_in_pages(s, max_pages)
    if b == 0 or n == 0 or max_pages == 0:
        return jnp.full((b, n, m), -jnp.inf, jnp.float32)
    bn = rows_per_block(n, hp)
    byte_view = key_source(s, tune.byte_view)
    per_program = tune.pages_per_step * tune.steps
    out = B.pallas_call(
        functools.partial(_kernel, s=s, n=n, hp=hp, bn=bn, max_pages=max_pages, tune=tune, byte_view=byte_view),
        grid=(b, -(-n // bn), -(-max_pages // per_program)),
        out_shape=jax.ShapeDtypeStruct((b * n, m), jnp.float32),
        input_output_aliases={},
        interpret=interpret, name="kpool_paged_logits", num_warps=tune.warps_for(bn * hp),
    )(context_pools.astype(jnp.int32).reshape(b * n), page_table_pages.astype(jnp.int32),
      q8.reshape(b * n * hp, nm.HEAD_DIM), weights.astype(jnp.float32).reshape(b * n, hp),
      *cache_views(cache, s, byte_view))
    return out.reshape(b, n, m)
