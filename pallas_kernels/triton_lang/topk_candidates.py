"""Triton kernel: the candidates of the split top-k, many programs per row (docs/semantics.md 2.5, 5.9).

A row of a small batch (decode) is long (up to 256k pools at 1M tokens) and alone:
one program walking it is latency bound. Here the row is cut into spans, each its
own program, and every program of a row:

  1. reads the row's maxima (the largest order key of each group of 8 or 64 pools,
     written by the logits kernel; ``workspace.split_maxima_pools``) and takes the
     floor: the top 16 bits of the k-th best maximum, found bit by bit (``_floor16``).
     At least k maxima reach it, so at least k scores do, and every score of the
     row's k best does. Rows with fewer than k whole-step maxima take floor 0: every
     valid score is a candidate;
  2. appends the scores of its span below the row's length whose order key reaches
     the floor, (key, id), to the row's candidate buffer, at places taken from the
     row's counter by atomic adds. A span of more than TWO_PASS_TILES tiles is counted
     first, its places taken with one atomic add, and read again (from L2) to write
     them: one atomic round trip per program, not per tile. A shorter span takes one
     atomic add per tile in one pass.

The buffer's order depends on which program's atomic lands first; the count and
the set do not. ``topk_rank`` ranks the buffer by a total order (key, then id), so
the result is deterministic and equals the reference's; a count over the buffer's
capacity, or below min(k, the row's length) (maxima above their scores), sends the
row to the whole-row walk.

Reads ONLY: the row's maxima and its scores below its length. Writes ONLY: the
row's counter (which must be 0 before the launch) and the candidate region of the
row's selection buffers ([2 KP, 2 KP + CAP) of ``sel_key`` / ``sel_id``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .addressing_tl import row_tokens
from .order_tl import append_at_least, order_key


@triton.jit
def _count_at_least(mrow, ng, bound, BLOCK_M: tl.constexpr):
    """How many of the ng keys at mrow are >= bound."""
    c = ng * 0
    for t in range(0, ng, BLOCK_M):
        offs = t + tl.arange(0, BLOCK_M)
        m = offs < ng
        c += tl.sum((m & (tl.load(mrow + offs, mask=m, other=0) >= bound)).to(tl.int32), axis=0)
    return c


@triton.jit
def _floor16(mrow, ng, take, BLOCK_M: tl.constexpr):
    """The largest multiple of 2**16 that at least `take` of the ng keys at mrow reach
    (ng >= take >= 1): the top 16 bits of the take-th best key. Bit by bit from the top,
    each bit kept if enough keys reach the prefix with it set: one count per bit, over
    keys held in registers when ng <= BLOCK_M (the keys of a row are often all in one
    bin of any byte, which a histogram would count one key at a time)."""
    prefix = tl.full((), 0, tl.uint32)
    if ng <= BLOCK_M:
        offs = tl.arange(0, BLOCK_M)
        key = tl.load(mrow + offs, mask=offs < ng, other=0)               # [BLOCK_M], 0 reaches nothing > 0
        for b in tl.static_range(16):
            trial = prefix | tl.full((), 1 << (31 - b), tl.uint32)
            if tl.sum((key >= trial).to(tl.int32), axis=0) >= take:
                prefix = trial
    else:
        for b in tl.static_range(16):
            trial = prefix | tl.full((), 1 << (31 - b), tl.uint32)
            if _count_at_least(mrow, ng, trial, BLOCK_M) >= take:
                prefix = trial
    return prefix


@triton.jit
def candidates_kernel(n_cols, n_maxima, span_pools, logits_ptr, lengths_ptr, maxima_ptr, count_in_ptr,
                      sel_key_ptr, sel_id_ptr, count_ptr,
                      K: tl.constexpr, KP: tl.constexpr, CAP: tl.constexpr, SEL_W: tl.constexpr,
                      POOLS_PER_MAX: tl.constexpr, STEP: tl.constexpr, BLOCK: tl.constexpr,
                      STAGES: tl.constexpr, TWO_PASS: tl.constexpr, BLOCK_M: tl.constexpr, POS_R: tl.constexpr):
    # n_cols, n_maxima, span_pools: i32 score columns, maxima per row, pools per program
    # logits: [rows, n_cols] f32; lengths: [rows] i32 pools, or with POS_R > 0 positions (-1: padding), the
    # row's length (p + 1) // POS_R pools; maxima: [rows, n_maxima] u32 (POOLS_PER_MAX pools
    # each); count_in: [rows] i32 zeros (aliases count); sel_key / sel_id: [rows, SEL_W] u32 / i32,
    # candidates written to [2 KP, 2 KP + CAP); count: [rows] i32 candidates found (may pass CAP)
    s = tl.program_id(0)
    row = tl.program_id(1)
    if POS_R > 0:
        n = tl.minimum(row_tokens(tl.load(lengths_ptr + row)) // POS_R, n_cols)
    else:
        n = tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), n_cols)
    lo = s * span_pools
    hi = tl.minimum(lo + span_pools, n)
    if lo < hi:
        ng = tl.minimum(n // STEP * (STEP // POOLS_PER_MAX), n_maxima)    # maxima of whole steps below n
        floor = tl.full((), 0, tl.uint32)
        if ng >= K:
            floor = _floor16(maxima_ptr + row.to(tl.int64) * n_maxima, ng, K, BLOCK_M)
        base = logits_ptr + row.to(tl.int64) * n_cols
        bkey = sel_key_ptr + row.to(tl.int64) * SEL_W + 2 * KP
        bid = sel_id_ptr + row.to(tl.int64) * SEL_W + 2 * KP
        if TWO_PASS:
            up_n = tl.zeros((BLOCK,), tl.int32)
            for t in tl.range(lo, hi, BLOCK, num_stages=STAGES):
                offs = t + tl.arange(0, BLOCK)
                m = offs < hi
                up_n += (m & (order_key(tl.load(base + offs, mask=m, other=0.0)) >= floor)).to(tl.int32)
            c = tl.sum(up_n, axis=0)
            if c > 0:
                at = tl.atomic_add(count_ptr + row, c)
                for t in tl.range(lo, hi, BLOCK, num_stages=STAGES):
                    offs = t + tl.arange(0, BLOCK)
                    m = offs < hi
                    key = order_key(tl.load(base + offs, mask=m, other=0.0))
                    at += append_at_least(bkey, bid, at, key, offs, m, floor, CAP)
        else:
            for t in range(lo, hi, BLOCK):
                offs = t + tl.arange(0, BLOCK)
                m = offs < hi
                key = order_key(tl.load(base + offs, mask=m, other=0.0))
                up = m & (key >= floor)
                c = tl.sum(up.to(tl.int32), axis=0)
                if c > 0:
                    at = tl.atomic_add(count_ptr + row, c)
                    append_at_least(bkey, bid, at, key, offs, m, floor, CAP)

BLOCK = 1024         # scores per tile of a span
TWO_PASS_TILES = 2   # spans of more tiles count first, then write (one atomic add)
STAGES = 3           # tiles of a span whose loads are in flight
WARPS = 8            # warps per program (docs/benchmarks.md: 8 against 4)
