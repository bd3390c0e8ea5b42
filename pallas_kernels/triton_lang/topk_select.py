"""Triton kernel: the select launch of the dense top-k (docs/semantics.md 2.5, 5.9).

The last of ``dense_topk``'s three launches, one program per row. A row whose count
of candidates (``topk_collect``) is in [take, W] (W = ``workspace.dense_candidates``),
take = min(k, length), has all of
its k best among them: at least take scores reached the guess, so its take-th best
does, and every better one. The program holds the candidates in registers, finds
the take-th best key p bit by bit (``order_tl.take_th_key``), keeps the keys above p
and, of the ties at p, the ones with the lowest ids (their id bound found bit by bit
too: the candidates are in no fixed order), and writes the take kept ones sorted by
descending key, ties by ascending id, then -1 (``order_tl.write_sorted``).

A row with fewer candidates than take (the guess above its take-th best) or more
than W (a plateau at the guess, or a sample unlike its row) runs the whole-row walk
of ``topk_rows.row_topk`` instead. Either way the ids are the reference's.

Reads ONLY the row's count, candidates and length (and, for the whole-row walk, its
scores below its length); writes ONLY the row's ids and its scratch [0, 2 KP) of the
selection buffers.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .order_tl import take_th_key, write_sorted
from .topk_rows import row_topk


@triton.jit
def _id_bound(ids, eq, need):
    """The need-th smallest id among the entries eq (distinct ids >= 0; 1 <= need <=
    their count): the largest v with fewer than `need` of them below v, bit by bit."""
    v = need * 0
    for j in range(31):
        trial = v + (1 << (30 - j))
        if tl.sum((eq & (ids < trial)).to(tl.int32), axis=0) < need:
            v = trial
    return v


@triton.jit
def select_kernel(n_cols, logits_ptr, lengths_ptr, count_ptr, key_ptr, id_ptr, sel_key_ptr, sel_id_ptr, ids_ptr,
                  W: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, CAP: tl.constexpr, SEL_W: tl.constexpr,
                  GROUP: tl.constexpr, STEP: tl.constexpr, MAXIMA: tl.constexpr, BLOCK: tl.constexpr,
                  NB: tl.constexpr, SMALL: tl.constexpr):
    # n_cols: i32 score columns; logits: [rows, n_cols] f32; lengths: [rows] i32 pools; count: [rows]
    # i32; key / id: [rows, W] u32 / i32, the candidates at [0, count); sel_key / sel_id: [rows, SEL_W]
    # u32 / i32 scratch (SEL_W = 2 KP); ids: [rows, K] i32
    row = tl.program_id(0)
    n = tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), n_cols)
    take = tl.minimum(n, K)
    cnt = tl.load(count_ptr + row)
    out_row = ids_ptr + row.to(tl.int64) * K
    if (cnt >= take) & (cnt <= W):
        i = tl.arange(0, W)
        live = i < cnt
        key = tl.load(key_ptr + row.to(tl.int64) * W + i, mask=live, other=0)      # [W] u32, 0 outside
        ids = tl.load(id_ptr + row.to(tl.int64) * W + i, mask=live, other=0)
        p, reached = take_th_key(key, cnt, take)
        sel = key >= tl.maximum(p, 1)
        if reached != take:
            gt = key > p
            eq = key == p
            need = take - tl.sum(gt.to(tl.int32), axis=0)
            sel = gt | (eq & (ids <= _id_bound(ids, eq, need)))
        ck = sel_key_ptr + row.to(tl.int64) * SEL_W
        ci = sel_id_ptr + row.to(tl.int64) * SEL_W
        pos = tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(ck + pos, key, mask=sel)
        tl.store(ci + pos, ids, mask=sel)
        tl.debug_barrier()
        write_sorted(ck, ci, take, out_row, K, KP)
    else:
        # (without MAXIMA, row_topk reads no maxima and lists no groups: those pointers are unused)
        row_topk(row, n, n_cols, 1, logits_ptr, sel_key_ptr, sel_key_ptr, sel_id_ptr, ids_ptr, out_row,
                 K, KP, CAP, SEL_W, GROUP, STEP, MAXIMA, BLOCK, NB, SMALL)




def warps(candidates: int) -> int:
    """Warps per program for W candidates: 4 up to 2048 (k = 512), then one per 512
    candidates, at most 16 (k = 2048: W = 8192)."""
    return max(4, min(16, candidates // 512))
