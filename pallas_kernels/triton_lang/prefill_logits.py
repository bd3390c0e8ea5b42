"""Triton kernel: paged indexer logits on Hopper's tensor cores (docs/semantics.md 2.4, 5.7).

    logit[b, i, m] = sum_h w'[b, f + i, h] * relu(dot(q8[b, f + i, h], K8[m]) * kscale[m])   for m < ctx[b, i]

(f: the first query row of a window of rows, ``first_row``; 0 for all of them.)

Pool m of request b is row m % P of page page_table[b, m // P].

Reads ONLY: the query rows, weights and context lengths (or positions) of its programs, the
page-table entries of the pages a row can see (``addressing.page_entries``), and
those pages' 128-byte keys and 4-byte scales. Writes ONLY its output
[B, n, max_pages * P] f32: with ``fill`` every element (-inf outside a row's
context); without it only the columns below each program's longest context (the
top-k that follows reads a row only below its length). With ``maxima`` it also
writes, beside the logits of every step, the largest order key of each group of 8
of the step's 64 columns (``workspace.group_columns``), or with maxima_pools 64 of
the whole step, from which the Triton top-k takes its floor. With ``counters`` it
writes a zero per query row for the split top-k's candidate counters.

Grid: (ceil(n / BQ), ceil(max_pages / PAGES), B), PAGES shrinking for small decode
grids (``launch_shape``). A program holds BQ query rows of
one request, their BQ * Hp q8 rows resident as the B operand, and walks PAGES
page-table columns, G pages per step (software-pipelined loads): the keys of a
step are [G*P, 128] fp8 (a page's key rows are contiguous), the dot
keys x q^T -> [G*P, BQ*Hp] f32 puts the pools on the MMA's M side, so the head
sum stays in each thread's registers and lanes and the [rows * heads, pools]
products never reach memory.

The dot (``Tuning.dot``): "f16" converts the fp8 keys and queries to f16 (exact)
and runs wgmma with f32 accumulation: every product exact, sums rounded in f32,
which is what the accuracy contract in docs/design.md bounds. "fp8" runs the fp8
wgmma directly (Hopper accumulates fp8 products with fewer bits than f32: faster,
outside that bound; not a default).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from ..core import addressing as addr
from ..core import numerics as nm
from ..core.strides import VIEW_COLS as _VIEW_COLS, CacheStrides
from ..read import workspace
from . import _call
from .addressing_tl import row_tokens
from .order_tl import NEG_INF_KEY, order_key

DOTS = ("f16", "fp8")


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Launch shape: BQ query rows per program (BQ * Hp <= 256 dot columns), G pages per
    step (G * P = 64 pool rows: one warpgroup's M), PAGES page-table columns per
    program, software-pipeline depth, warps. Defaults: the fastest f16 shape of
    ``benchmarks/bench_read.py --prefill-tc`` on the H200 (docs/benchmarks.md)."""
    rows: int = 8
    pages_per_step: int = 2
    pages: int = 64
    stages: int = 2
    num_warps: int = 4
    dot: str = "f16"
    min_programs: int = 0          # pages per program halve while the grid is smaller (0: never)

    def __post_init__(self):
        pow2 = lambda v: isinstance(v, int) and v >= 1 and not v & (v - 1)   # noqa: E731
        if not (pow2(self.rows) and pow2(self.pages_per_step) and pow2(self.pages) and self.stages >= 1
                and self.num_warps in (4, 8) and self.dot in DOTS and self.pages >= self.pages_per_step
                and isinstance(self.min_programs, int) and self.min_programs >= 0):
            raise ValueError(f"bad prefill logits tuning {self}")


# prefill rows (select_tokens' chunks; read when select_tokens is traced)
PREFILL = Tuning()
# decode rows (the split top-k's logits): more, shorter programs (docs/benchmarks.md)
DECODE = Tuning(pages=16, min_programs=workspace.LOGITS_MIN_PROGRAMS)


@triton.jit
def _word_index(row, col, VIEW_COLS: tl.constexpr):
    return row.to(tl.int64) * VIEW_COLS + col


@triton.jit
def paged_logits_kernel(n, n_q, n_cols, n_pages, n_groups,
                        ctx_ptr, first_ptr, q_ptr, w_ptr, pages_ptr, cache_ptr, out_ptr, max_ptr, zero_ptr,
                        HP: tl.constexpr, P: tl.constexpr, G: tl.constexpr, BQ: tl.constexpr,
                        PAGES: tl.constexpr, DOT: tl.constexpr, STAGES: tl.constexpr, FILL: tl.constexpr,
                        MAXIMA: tl.constexpr, MG: tl.constexpr, POS_R: tl.constexpr, ZEROS: tl.constexpr,
                        KEY_WORDS: tl.constexpr, VIEW_COLS: tl.constexpr):
    # n, n_q, n_cols, n_pages, n_groups: i32 query rows per request (the window), rows per
    # request of q and w, output columns (n_pages * P), page-table columns, group maxima
    # per row (workspace.maxima_cols(n_cols))
    # ctx: [B, n] i32 visible pools, or with POS_R > 0 positions (-1: padding), the row seeing
    # (p + 1) // POS_R pools; first: [1] i32, the window's first row in q and w (window row i
    # is q row first + i); q: [B * n_q * HP, 128] u8 (e4m3 codes); w: [B * n_q * HP] f32;
    # pages: [B, n_pages, 4] i32 (addressing.page_entries); cache: [total_words] u32 (read only);
    # out: [B, n, n_cols] f32; max: [B, n, n_groups] u32 (written with MAXIMA); zero: [B, n] i32
    # (written with ZEROS, by the programs of the first page-table columns: 0 per row)
    N: tl.constexpr = BQ * HP
    M: tl.constexpr = G * P
    b = tl.program_id(2)
    row0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BQ    # the longest rows first
    rows = row0 + tl.arange(0, BQ)
    row_ok = rows < n
    brow = b.to(tl.int64) * n
    qbase = b.to(tl.int64) * n_q + tl.load(first_ptr)          # q and w row of window row 0
    if POS_R > 0:
        ctx = row_tokens(tl.load(ctx_ptr + brow + rows, mask=row_ok, other=-1)) // POS_R        # [BQ]
    else:
        ctx = tl.maximum(tl.load(ctx_ptr + brow + rows, mask=row_ok, other=0), 0)               # [BQ]
    if ZEROS:
        if tl.program_id(1) == 0:
            tl.store(zero_ptr + brow + rows, tl.zeros((BQ,), tl.int32), mask=row_ok)
    need = tl.minimum((tl.max(ctx, axis=0) + P - 1) // P, n_pages)
    c0 = tl.program_id(1) * PAGES
    c1 = tl.minimum(c0 + PAGES, need)
    r = tl.arange(0, M)
    g = r // P
    rp = r % P
    out_rows = out_ptr + (brow + rows).to(tl.int64)[None, :] * n_cols     # [1, BQ]
    # MG maxima per step of M = 64 pools: 8 (groups, workspace.group_columns) or 1 (the step)
    max_rows = max_ptr + (brow + rows).to(tl.int64)[None, :] * n_groups             # [1, BQ]
    mg = tl.arange(0, MG)
    if c0 < c1:
        c = tl.arange(0, N)
        qrow = tl.minimum(row0 + c // HP, n - 1)               # rows past n re-read row n - 1, weight 0
        d = tl.arange(0, 128)
        qb = tl.load(q_ptr + ((qbase + qrow) * HP + c % HP)[:, None] * 128 + d[None, :])
        q = qb.to(tl.float8e4nv, bitcast=True)                  # [N, 128]
        w = tl.load(w_ptr + (qbase + qrow) * HP + c % HP, mask=(row0 + c // HP) < n, other=0.0)   # [N]
        if DOT == 0:
            qd = q.to(tl.float16)
        else:
            qd = q
        bytes_ptr = cache_ptr.to(tl.pointer_type(tl.uint8))
        f32_ptr = cache_ptr.to(tl.pointer_type(tl.float32))
        tab = pages_ptr + b.to(tl.int64) * n_pages * 4
        gi = tl.arange(0, G)
        for col in tl.range(c0, c1, G, num_stages=STAGES):
            has = (col + gi) < c1
            e = tab + (col + gi) * 4
            kw = _word_index(tl.load(e, mask=has, other=-1), tl.load(e + 1, mask=has, other=0), VIEW_COLS)
            sw = _word_index(tl.load(e + 2, mask=has, other=0), tl.load(e + 3, mask=has, other=0), VIEW_COLS)
            okg = kw >= 0                                           # [G] a page of the layer
            kb = tl.reshape(tl.broadcast_to(tl.maximum(kw, 0)[:, None] * 4, (G, P)), (M,))
            sb = tl.reshape(tl.broadcast_to(sw[:, None], (G, P)), (M,))
            ok = tl.reshape(tl.broadcast_to(okg[:, None], (G, P)), (M,))
            kb = tl.multiple_of(kb + rp * (KEY_WORDS * 4), 16)    # [M] first key byte of each pool
            k = tl.load(bytes_ptr + kb[:, None] + d[None, :], mask=ok[:, None], other=0)
            k = k.to(tl.float8e4nv, bitcast=True)                   # [M, 128]
            ks = tl.load(f32_ptr + sb + rp, mask=ok, other=0.0)      # [M] power-of-two scales
            if DOT == 0:
                acc = tl.dot(k.to(tl.float16), tl.trans(qd), out_dtype=tl.float32)     # [M, N]
            else:
                acc = tl.dot(k, tl.trans(qd), out_dtype=tl.float32)
            # sum_h w * relu(acc * ks) == ks * sum_h w * relu(acc): ks is a power of two
            sc = tl.maximum(acc, 0.0) * w[None, :]
            lg = tl.sum(tl.reshape(sc, (M, BQ, HP)), axis=2) * ks[:, None]           # [M, BQ]
            pools = (col + g) * P + rp                                                # [M]
            lg = tl.where((pools[:, None] < ctx[None, :]) & ok[:, None], lg, float("-inf"))
            st = ((col + g) < c1)[:, None] & row_ok[None, :]
            tl.store(out_rows + pools[:, None], lg, mask=st)
            if MAXIMA and MG == 8:
                # the largest order key of each group (workspace.group_columns): rows
                # 16 w + 8 h + 4 a + i of the step (pools col * P + r) are group 2 w + a
                kk = tl.reshape(order_key(lg), (4, 2, 2, 4, BQ))                          # [w, h, a, i, BQ]
                gmax = tl.reshape(tl.max(tl.max(kk, axis=3), axis=1), (MG, BQ))           # [2 w + a, BQ]
                gst = ((col + (mg // 2) * 16 // P) < c1)[:, None] & row_ok[None, :]
                tl.store(max_rows + ((col * P) // M * MG + mg)[:, None], gmax, mask=gst)
            if MAXIMA and MG == 1:
                # one maximum per step (pools past c1 are -inf above)
                smax = tl.max(order_key(lg), axis=0)                                      # [BQ]
                tl.store(max_rows + (col * P) // M, smax[None, :], mask=row_ok[None, :])
    if FILL:
        # -inf in the program's columns past its rows' longest context
        f0 = tl.maximum(c0, need)
        for col in range(f0, tl.minimum(c0 + PAGES, n_pages), G):
            pools = (col + g) * P + rp
            st = ((col + g) < tl.minimum(c0 + PAGES, n_pages))[:, None] & row_ok[None, :]
            tl.store(out_rows + pools[:, None], tl.full((M, BQ), float("-inf"), tl.float32), mask=st)
        if MAXIMA and MG == 8:                                     # whole steps: their groups' pages >= f0
            for col in range(c0 + (f0 - c0) // G * G, tl.minimum(c0 + PAGES, n_pages), G):
                page = col + (mg // 2) * 16 // P
                gst = ((page >= f0) & (page < tl.minimum(c0 + PAGES, n_pages)))[:, None] & row_ok[None, :]
                tl.store(max_rows + ((col * P) // M * MG + mg)[:, None],
                         tl.full((MG, BQ), NEG_INF_KEY, tl.uint32), mask=gst)
        if MAXIMA and MG == 1:                                     # steps that start at or past f0
            for col in range(c0 + (f0 - c0 + G - 1) // G * G, tl.minimum(c0 + PAGES, n_pages), G):
                tl.store(max_rows + (col * P) // M,
                         tl.full((1, BQ), NEG_INF_KEY, tl.uint32), mask=row_ok[None, :])


def check_geometry(s: CacheStrides, hp: int):
    """The kernel's tiles (``workspace.check_tc_geometry``)."""
    workspace.check_tc_geometry(s.page_rows, hp, addr.key_rows_16b_aligned(s))


def launch_shape(s: CacheStrides, hp: int, n: int, max_pages: int, tune: Tuning, batch: int = 1):
    """(grid, constexprs) of one call: the pages per step make a 64-row M (G * P = 64);
    rows per program shrink so that BQ * Hp <= 256 (the MMA's widest N) and to the
    rows there are (a decode row alone: BQ = 1); with ``tune.min_programs`` page-table
    columns per program shrink while the grid would leave SMs idle
    (``workspace.logits_pages_per_program``)."""
    g = max(1, 64 // s.page_rows)
    bq = max(1, min(tune.rows, 256 // hp, 1 << max(0, n - 1).bit_length()))
    row_blocks = -(-n // bq)
    pages = workspace.logits_pages_per_program(max_pages, row_blocks * batch, g, tune.pages, tune.min_programs)
    grid = (row_blocks, -(-max_pages // pages))
    return grid, dict(HP=hp, P=s.page_rows, G=g, BQ=bq, PAGES=pages, DOT=DOTS.index(tune.dot),
                      STAGES=tune.stages, KEY_WORDS=addr.KEY_WORDS, VIEW_COLS=_VIEW_COLS)


@functools.partial(jax.jit, static_argnames=("s", "fill", "maxima", "maxima_pools", "tune", "positions_kpool",
                                             "counters"))
def paged_logits(cache, s: CacheStrides, q8, weights, page_table_pages, context_pools, *, fill: bool = True,
                 maxima: bool = False, maxima_pools: int = workspace.MAXIMA_GROUP_POOLS, tune: Tuning = Tuning(),
                 positions_kpool: int = 0, counters: bool = False, first_row=None):
    """cache: [total_words] u32; q8: [B, n_q, Hp, 128] e4m3fn; weights: [B, n_q, Hp] f32;
    page_table_pages: [B, max_pages] i32; context_pools: [B, n] i32 for the query rows
    first_row .. first_row + n - 1 of q8 and weights (first_row: an integer scalar, traced
    or not, clamped to 0 .. n_q - n as ``lax.dynamic_slice`` clamps its start; None:
    n_q = n and the rows from 0), or with
    ``positions_kpool`` = kpool each row's position (-1: padding), the row seeing
    (p + 1) // kpool pools (the decode path reads positions as they come: no XLA kernel
    computes the contexts).
    Returns logits [B, n, max_pages * page_rows] f32 (see the module docstring for
    ``fill``); with ``maxima`` also [B, n, workspace.maxima_cols(n_cols, maxima_pools)]
    u32 (written where the logits are): with maxima_pools 8, entry g the largest
    ``order_key`` of the logits in ``workspace.group_columns(g)``; with 64, entry s that
    of columns 64 s .. 64 s + 63; with ``counters`` last [B, n] i32 zeros, written by
    the kernel: the split top-k's candidate counters, without a launch of their own."""
    b, n_q, hp, _ = q8.shape
    n = context_pools.shape[1]
    if weights.shape != (b, n_q, hp) or context_pools.shape[0] != b or page_table_pages.shape[0] != b:
        raise ValueError(f"weights {weights.shape}, context_pools {context_pools.shape} and page_table_pages "
                         f"{page_table_pages.shape} must follow q8 {q8.shape}: weights [B, n_q, Hp], B rows each")
    if first_row is None:
        if n != n_q:
            raise ValueError(f"context_pools has {n} rows and q8 {n_q}: give first_row for a window of q8's rows")
        first_row = 0
    elif n > n_q:
        raise ValueError(f"a window of {n} rows does not fit q8's {n_q}")
    elif jnp.ndim(first_row) != 0 or not jnp.issubdtype(jnp.result_type(first_row), jnp.integer):
        raise ValueError(f"first_row must be an integer scalar, got {jnp.result_type(first_row)} "
                         f"of shape {jnp.shape(first_row)}")
    max_pages = page_table_pages.shape[1]
    check_geometry(s, hp)
    n_cols = addr.pools_in_pages(s, max_pages)
    n_groups = workspace.maxima_cols(n_cols, maxima_pools)
    if not isinstance(positions_kpool, int) or positions_kpool < 0:
        raise ValueError(f"positions_kpool must be 0 (contexts in pools) or the kpool, got {positions_kpool!r}")
    if b == 0 or n == 0 or max_pages == 0:
        out = (jnp.full((b, n, n_cols), -jnp.inf, jnp.float32),
               jnp.full((b, n, n_groups), NEG_INF_KEY.value, jnp.uint32), jnp.zeros((b, n), jnp.int32))
    else:
        grid, consts = launch_shape(s, hp, n, max_pages, tune, batch=b)
        q_codes = jax.lax.bitcast_convert_type(q8, jnp.uint8).reshape(b * n_q * hp, nm.HEAD_DIM)
        first = jnp.reshape(jnp.clip(jnp.asarray(first_row, jnp.int32), 0, n_q - n), (1,))
        shapes = (jax.ShapeDtypeStruct((b, n, n_cols), jnp.float32),
                  jax.ShapeDtypeStruct((b, n, n_groups) if maxima else (1,), jnp.uint32),
                  jax.ShapeDtypeStruct((b, n) if counters else (1,), jnp.int32))
        out = _call.run_read(
            paged_logits_kernel, (n, n_q, n_cols, max_pages, n_groups),
            (context_pools.astype(jnp.int32), first, q_codes, weights.astype(jnp.float32).reshape(-1),
             addr.page_entries(s, page_table_pages.astype(jnp.int32)), cache),
            shapes, grid=grid + (b,), num_warps=tune.num_warps, num_stages=tune.stages,
            name="kpool_paged_logits_tc",
            constexprs=dict(consts, FILL=fill, MAXIMA=maxima, MG=workspace.MAXIMA_STEP_POOLS // maxima_pools,
                            POS_R=positions_kpool, ZEROS=counters))
    picked = (out[0],) + ((out[1],) if maxima else ()) + ((out[2],) if counters else ())
    return picked if len(picked) > 1 else picked[0]
