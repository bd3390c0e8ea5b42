"""Kernel: fused paged logits -> exact top-k pools (docs/semantics.md 2.4, 2.5, 5.8, 5.9).

Same result as ``topk.topk_pools`` applied to ``paged_logits.paged_logits``
(best k pools per query row by descending logit, ties by ascending pool id, -1
padded; pools >= the row's context are never selected), but the [rows, pools]
logits never reach memory: each page's logits live in registers only, from the
dot to the selection filter.

Reads ONLY: the query rows, weights, context lengths, page-table entries, and
the key + scale bytes of the pages inside each row's context (as paged_logits).
Writes ONLY its outputs: the [B, n, k] i32 pool ids and per-program candidate
buffers (keys/ids [buffer rows, CAP], counts) private to each program. The
cache is not modified.

Grid: (B, ceil(n / BN), splits). A program holds BN query rows of one request
(their BN*Hp query rows are the M side of each dot, so the next_n rows of a
decode request share every page read) and one contiguous range of page-table
columns. For each step of `pages` page-table columns (ids ascending) it computes
the [BN, pages*P] logits as paged_logits does (``paged_logits.score_pages``) and
feeds them to the streaming selection of topk/common.py: a candidate is buffered only if
it beats the row's current k-th best; the buffer is compacted (exact radix
threshold search) when it could overflow. With one split the program sorts its k survivors and writes the ids;
with several (long contexts over few rows, to occupy the GPU) each split keeps
its exact top-k survivors and a merge pass (topk.common.merge_candidates) streams them
in split order through the same selection. A split spans at least
MIN_SPLIT_FACTOR * KP pools, so the survivors (k per split) are at most 1/8 of
the pools and the merge input stays small.

Prefill is the same call with B = 1 and n = the request's query rows; calls with
more than MAX_ROWS_PER_CALL rows walk the rows in chunks (lax.map) so the
candidate buffers stay bounded.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..core import addressing as addr
from ..core import backend as B
from ..core import numerics as nm
from ..core.strides import CacheStrides
from ..topk import common as tk
from .paged_logits import (DOT_FORMS, WGMMA_DOT_ROWS, cache_views, check_geometry, key_source,
                           load_query_block, rows_per_block, score_pages)

MAX_ROWS_PER_CALL = 8192
# Program shape by the dot's rows (BN * Hp): (dot form, pages per step, warps). From
# WGMMA_DOT_ROWS = 64 rows (prefill blocks: 4 rows x 32 heads) the f16 dot (wgmma) over
# 2 pages per step: on the H200 (8192 rows; docs/benchmarks.md) 1.06x / 1.13x faster than
# (fp8, 1, 4) at 32k / 128k context; 4 pages or 8 warps 0.71-0.89x. Below 64 rows
# (decode) the fp8 dot over one page per step at 4 warps, unmeasured at these rows: decode
# takes the unfused path.
PREFILL_SHAPE = ("f16", 2, 4)
DECODE_SHAPE = ("fp8", 1, 4)


def default_shape(dot_rows: int):
    """(dot, pages, num_warps) of a program whose dot has `dot_rows` rows."""
    return PREFILL_SHAPE if dot_rows >= WGMMA_DOT_ROWS else DECODE_SHAPE


def _kernel(ctx_ref, table_ref, q_ref, w_ref, cache_ref, *refs,
            s: CacheStrides, g: tk.Geometry, n: int, hp: int, max_pages: int, row_blocks: int,
            splits: int, split_pages: int, final: bool, interpret: bool, byte_view: bool, dot: str,
            pages: int):
    # ctx_ref: [B*n] i32; table_ref: [B, max_pages] i32; q_ref: [B*n*Hp, 128] e4m3fn;
    # w_ref: [B*n, Hp] f32; cache_ref: [rows, 1024] u32; (bytes_ref: [rows, 4096] u8 if byte_view);
    # res_ref: [B*n, k] i32 (final) or [n_buf] i32 counts; kbuf/ibuf: [n_buf, CAP] u32/i32
    bytes_ref, res_ref, kbuf, ibuf = refs if byte_view else (None,) + refs
    b, rb, sp = B.program_id(0), B.program_id(1), B.program_id(2)
    bn = g.bn
    rows = tk.Rows(b, rb, n=n, bn=bn, row_blocks=row_blocks)
    qb = load_query_block(ctx_ref, q_ref, w_ref, b, rb * bn, n=n, hp=hp, bn=bn)
    need = jnp.minimum(addr.pages_for_pools(s, jnp.max(qb.ctx)), max_pages)      # columns in use
    lo = sp * split_pages                                   # split_pages: a multiple of `pages`
    n_chunks = (jnp.maximum(jnp.minimum(lo + split_pages, need) - lo, 0) + pages - 1) // pages
    brow = rows.padded * splits + sp

    def produce(c, active):                                 # chunk c: `pages` page-table columns,
        col0 = lo + c * pages                               # none read past the rows' context
        on = active & (col0 + tk._iota((pages,), 0) < need)                         # [pages]
        lg, pools, live = score_pages(cache_ref, bytes_ref, table_ref, s, qb, b, col0, on, n_pages=pages,
                                      bn=bn, hp=hp, max_pages=max_pages, dot=dot)  # [BN, pages*P]
        ids = pools[None, :] + 0 * live.astype(jnp.int32)
        return tk.order_key(lg), ids, live & active & rows.ok[:, None]

    st = tk.stream(g, kbuf, ibuf, brow, n_chunks, produce, interpret)
    tk.finish(g, st, kbuf, ibuf, brow, rows, (res_ref,), final=final, interpret=interpret)


def _call(cache, s, q8, weights, page_table_pages, context_pools, k, splits, interpret, dot, pages, num_warps):
    b, n, hp, _ = q8.shape
    max_pages = page_table_pages.shape[1]
    bn = rows_per_block(n, hp)
    row_blocks = -(-n // bn)
    g = tk.Geometry(k=k, bn=bn, ch=addr.pools_in_pages(s, pages))
    sp = tk.choose_splits(b * row_blocks, addr.pools_in_pages(s, max_pages), k, splits)
    split_pages = -(-max_pages // min(sp, max_pages))
    split_pages = -(-split_pages // pages) * pages          # whole chunks: no chunk crosses a split
    sp = -(-max_pages // split_pages)
    final = sp == 1
    n_buf = b * row_blocks * bn * sp
    res = (jax.ShapeDtypeStruct((b * n, k), jnp.int32) if final
           else jax.ShapeDtypeStruct((n_buf,), jnp.int32))
    interpret = B.resolve_interpret(interpret)
    byte_view = key_source(s)
    out, kbuf, ibuf = B.pallas_call(
        functools.partial(_kernel, s=s, g=g, n=n, hp=hp, max_pages=max_pages, row_blocks=row_blocks,
                          splits=sp, split_pages=split_pages, final=final, interpret=interpret,
                          byte_view=byte_view, dot=dot, pages=pages),
        grid=(b, row_blocks, sp),
        out_shape=(res,) + tk.buffer_shapes(g, n_buf),
        input_output_aliases={}, interpret=interpret, name="kpool_paged_topk", num_warps=num_warps,
    )(context_pools.astype(jnp.int32).reshape(b * n), page_table_pages.astype(jnp.int32),
      q8.reshape(b * n * hp, nm.HEAD_DIM), weights.astype(jnp.float32).reshape(b * n, hp),
      *cache_views(cache, s, byte_view))
    if not final:
        out = tk.merge_candidates(out, kbuf, ibuf, k, b=b, n=n, bn=bn, in_splits=sp,
                                  interpret=interpret)
    return out.reshape(b, n, k)


@functools.partial(jax.jit, static_argnames=("s", "k", "splits", "interpret", "dot", "pages", "num_warps"))
def paged_topk(cache, s: CacheStrides, q8, weights, page_table_pages, context_pools, k: int, *,
               splits=None, interpret=None, dot: str | None = None, pages: int | None = None,
               num_warps: int | None = None):
    """cache: [total_words] u32; q8: [B, n, Hp, 128] e4m3fn; weights: [B, n, Hp] f32
    (q-scale folded); page_table_pages: [B, max_pages] i32; context_pools: [B, n] i32.
    Returns [B, n, k] i32 pool ids (score desc, id asc; -1 padded).
    `splits` overrides the number of programs sharing one row's pages; `dot` is the
    form of the logits dot (``paged_logits.DOT_FORMS``); `pages` the page-table columns
    scored per step of the selection (a power of two), `num_warps` the program's warps;
    each None: ``default_shape`` of the program's dot rows."""
    b, n, hp, _ = q8.shape
    d_dot, d_pages, d_warps = default_shape(rows_per_block(max(n, 1), hp) * hp)
    dot = d_dot if dot is None else dot
    pages = d_pages if pages is None else pages
    num_warps = d_warps if num_warps is None else num_warps
    if dot not in DOT_FORMS:
        raise ValueError(f"paged_topk: dot must be one of {DOT_FORMS}, got {dot!r}")
    if pages not in (1, 2, 4, 8) or num_warps not in (1, 2, 4, 8):
        raise ValueError(f"paged_topk: pages and num_warps must be 1, 2, 4 or 8, got {pages}, {num_warps}")
    check_geometry(s, hp)
    if b == 0 or n == 0:
        return jnp.zeros((b, n, k), jnp.int32)
    if page_table_pages.shape[1] == 0:
        return jnp.full((b, n, k), -1, jnp.int32)
    if n <= MAX_ROWS_PER_CALL:
        return _call(cache, s, q8, weights, page_table_pages, context_pools, k, splits, interpret, dot, pages,
                     num_warps)
    # long prefill: walk the query rows in chunks (padding rows have context 0)
    chunk = MAX_ROWS_PER_CALL
    nc = -(-n // chunk)
    pad = nc * chunk - n

    def split(a):
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape((b, nc, chunk) + a.shape[2:]), 1, 0)

    def one(xs):
        q, w, c = xs
        return _call(cache, s, q, w, page_table_pages, c, k, splits, interpret, dot, pages, num_warps)

    out = jax.lax.map(one, (split(q8), split(weights), split(context_pools.astype(jnp.int32))))
    return jnp.moveaxis(out, 0, 1).reshape(b, nc * chunk, k)[:, :n]
