"""Triton kernel: the collecting read of the dense top-k (docs/semantics.md 2.5, 5.9).

The second of ``dense_topk``'s three launches. Each row is cut into spans of SPAN
columns, one program each; a program reads its span once, into registers, counts the
scores below the row's length whose order key reaches the row's guess
(``topk_sample``), takes that many places of the row's candidate buffer with one
atomic add on the row's counter, and writes them there as (key, column), in column
order. Places past the buffer's W are not written; the counter still counts them, so
the select launch sees the overflow.

The buffer's order depends on which program's atomic lands first; the count and the
set do not, and the select launch orders by (key, id), so the result is
deterministic.

Reads ONLY its span's scores below the row's length and the row's guess; writes ONLY
the row's counter and candidate buffer.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .order_tl import append_at_least, order_key


@triton.jit
def collect_kernel(n_cols, logits_ptr, lengths_ptr, guess_ptr, count_in_ptr, key_ptr, id_ptr, count_ptr,
                   W: tl.constexpr, SPAN: tl.constexpr):
    # n_cols: i32 score columns; logits: [rows, n_cols] f32; lengths: [rows] i32 pools; guess: [rows]
    # u32; count_in: [rows] i32 zeros (aliases count); key / id: [rows, W] u32 / i32, the candidates
    # at [0, count) in no fixed order when count <= W; count: [rows] i32 candidates found
    s = tl.program_id(0)
    row = tl.program_id(1)
    n = tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), n_cols)
    offs = s * SPAN + tl.arange(0, SPAN)
    live = offs < n
    key = order_key(tl.load(logits_ptr + row.to(tl.int64) * n_cols + offs, mask=live, other=0.0))
    guess = tl.load(guess_ptr + row)
    c = tl.sum((live & (key >= guess)).to(tl.int32), axis=0)
    if c > 0:
        at = tl.atomic_add(count_ptr + row, c)
        append_at_least(key_ptr + row.to(tl.int64) * W, id_ptr + row.to(tl.int64) * W, at, key, offs, live,
                        guess, W)


SPAN = 1024          # columns per program, read at once
WARPS = 2            # warps per program
