"""Triton kernel: the split top-k's selection by rank, and the expansion to tokens.

docs/semantics.md 2.5, 5.9 (the top-k) and 5.10 (the expansion).

The candidate launch (``topk_candidates``) leaves each row's candidates, (key, id)
pairs in whatever order its programs' atomics landed, and their count. The place of
candidate i in the row's answer is its rank

    rank(i) = #{j : key_j > key_i, or key_j == key_i and id_j < id_i},

distinct because ids are, so the candidates of rank < k are the row's k best in the
reference's order (descending score, ties by ascending id), whatever order the buffer
holds them in: no k-th key search, no sort. Program (r, t) of T per row ranks the
candidate tiles t, t + T, t + 2T, ... of row r (TI candidates each) against all of the
row's candidates, TJ at a time (the comparisons gather in a [TI, TJ] tile summed once
per tile; the loop's loads run STAGES steps ahead, as the buffer is read from L2),
and writes each candidate of rank < k to slot rank of the row's ids and,
with TOKENS, to its kpool token columns.

Program (r, 0) also writes -1 to the slots a row with fewer than k valid pools
leaves and, with TOKENS, the row's tail columns. A row whose count is not in
[min(k, length), CAP] cannot be ranked: fewer candidates than the floor promised
(maxima above their scores) or more than the buffer holds (a plateau at the floor).
Its program (r, 0) runs ``topk_rows.row_topk`` over the whole row instead, then
expands the ids it wrote.

Tokens (``expand.py``'s rule): slot s of pool id p fills columns s R .. s R + R - 1
with p R + o when 0 <= p < L // R (L the row's token count), else -1; the tail
columns k R + u hold (L // R) R + u for u < L % R, else -1.

Reads ONLY the row's count, candidates, length or position (and, for a row that
cannot be ranked, its scores below its length). Writes ONLY the row's ids and token
columns, and for a row that cannot be ranked its scratch [0, 2 KP) of the selection
buffers (aliased in place).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .addressing_tl import row_tokens
from .topk_rows import row_topk


@triton.jit
def _store_tokens(tok_row, slot, pool, ok, n_pools, R: tl.constexpr, RP: tl.constexpr):
    """Token columns of the [S] slots `slot` (mask ok) holding pool ids `pool`."""
    o = tl.arange(0, RP)
    col = slot[:, None] * R + o[None, :]                                  # [S, RP]
    good = (pool >= 0) & (pool < n_pools)
    val = tl.where(good[:, None], pool[:, None] * R + o[None, :], -1)
    tl.store(tok_row + col, val, mask=ok[:, None] & (o[None, :] < R))


@triton.jit
def rank_kernel(n_cols, logits_ptr, lengths_ptr, count_ptr, sel_key_in, sel_id_in,
                sel_key_ptr, sel_id_ptr, ids_ptr, tok_ptr,
                K: tl.constexpr, KP: tl.constexpr, CAP: tl.constexpr, SEL_W: tl.constexpr, GROUP: tl.constexpr,
                STEP: tl.constexpr, MAXIMA: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
                SMALL: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, W: tl.constexpr, TOKENS: tl.constexpr,
                TI: tl.constexpr, TJ: tl.constexpr, STAGES: tl.constexpr):
    # n_cols: i32 score columns; logits: [rows, n_cols] f32; lengths: [rows] i32 pools, or with TOKENS
    # positions (-1: padding), the row holding L = p + 1 tokens and L // R pools; count: [rows] i32;
    # sel_key_in / sel_id_in: [rows, SEL_W] u32 / i32, the candidates at [2 KP, 2 KP + count), aliased by sel_key / sel_id; ids: [rows, K] i32;
    # tok: [rows, W] i32, W = K R + R - 1 (written with TOKENS)
    row = tl.program_id(0)
    t0 = tl.program_id(1)
    nt = tl.num_programs(1)
    if TOKENS:
        seq = row_tokens(tl.load(lengths_ptr + row))
        n = tl.minimum(seq // R, n_cols)
    else:
        n = tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), n_cols)
        seq = n * R
    n_pools = seq // R
    take = tl.minimum(n, K)
    cnt = tl.load(count_ptr + row)
    ids_row = ids_ptr + row.to(tl.int64) * K
    tok_row = tok_ptr + row.to(tl.int64) * W
    if (cnt >= take) & (cnt <= CAP):
        bkey = sel_key_ptr + row.to(tl.int64) * SEL_W + 2 * KP
        bid = sel_id_ptr + row.to(tl.int64) * SEL_W + 2 * KP
        for t in range(t0 * TI, cnt, nt * TI):
            ii = t + tl.arange(0, TI)
            live = ii < cnt
            ki = tl.load(bkey + ii, mask=live, other=0)
            pi = tl.load(bid + ii, mask=live, other=0)
            beat = tl.zeros((TI, TJ), tl.int32)
            for j in tl.range(0, cnt, TJ, num_stages=STAGES):
                jj = j + tl.arange(0, TJ)
                mj = jj < cnt
                kj = tl.load(bkey + jj, mask=mj, other=0)     # 0: no order key, beats nothing
                pj = tl.load(bid + jj, mask=mj, other=0)
                gt = kj[None, :] > ki[:, None]
                tie = (kj[None, :] == ki[:, None]) & (pj[None, :] < pi[:, None])
                beat += (gt | tie).to(tl.int32)
            rank = tl.sum(beat, axis=1)
            sel = live & (rank < take)
            tl.store(ids_row + rank, pi, mask=sel)
            if TOKENS:
                _store_tokens(tok_row, rank, pi, sel, n_pools, R, RP)
        if t0 == 0:
            s = tl.arange(0, KP)
            empty = (s >= take) & (s < K)
            tl.store(ids_row + s, tl.full((KP,), -1, tl.int32), mask=empty)
            if TOKENS:
                _store_tokens(tok_row, s, tl.full((KP,), -1, tl.int32), empty, n_pools, R, RP)
    elif t0 == 0:
        # (without MAXIMA, row_topk reads no maxima and lists no groups: those pointers are unused)
        row_topk(row, n, n_cols, 1, logits_ptr, sel_key_ptr, sel_key_ptr, sel_id_ptr, ids_ptr, ids_row,
                 K, KP, CAP, SEL_W, GROUP, STEP, MAXIMA, BLOCK, NB, SMALL)
        if TOKENS:
            tl.debug_barrier()
            s = tl.arange(0, KP)
            _store_tokens(tok_row, s, tl.load(ids_row + s, mask=s < K, other=-1), s < K, n_pools, R, RP)
    if TOKENS:
        if t0 == 0:
            u = tl.arange(0, RP)
            tail = tl.where(u < seq % R, n_pools * R + u, -1)
            tl.store(tok_row + K * R + u, tail, mask=u < R - 1)


TI = 32          # candidates ranked per tile
TJ = 64          # candidates compared per step
STAGES = 3       # steps of the comparison loop whose loads are in flight
