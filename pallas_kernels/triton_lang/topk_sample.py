"""Triton kernel: the sampled floor of the dense top-k (docs/semantics.md 2.5, 5.9).

``dense_topk`` selects the k best of a few long rows of bare scores in three launches
(sample, collect, select). This is the first: one program per row reads a sample of
the row and writes a guess, a key that about TARGET * k of the row's scores reach (TARGET:
``workspace.SAMPLE_TARGET_PER_K``; SAMPLE: ``workspace.sample_pools``, CHUNK:
``workspace.sample_chunk_pools``):

  * the sample: CHUNK consecutive columns at every ``workspace.sample_stride`` columns,
    SAMPLE columns in all (the whole row when it has at most SAMPLE; the first ones
    when the row is too short for the stride);
  * its rank t = ``workspace.sample_rank``: min(k, length) when the sample is the
    whole row, else TARGET * k scaled to the sample and rounded up;
  * the guess: the top 16 bits of the sample's t-th best key, found bit by bit (one
    block-wide count per bit over the keys in registers): at least t sampled keys
    reach it.

A guess is not a bound: the select launch checks that at least min(k, length) scores
reached it (and no more than its buffer holds) and walks the whole row otherwise, so
the result is exact whatever the sample shows. A row sampled whole has an exact
floor: at least min(k, length) of its scores reach it.

The program also zeroes the row's candidate counter for the collect launch.

Reads ONLY its row's sampled scores below the row's length; writes ONLY its row's
guess and counter.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .order_tl import order_key


@triton.jit
def _prefix16(key, take):
    """The largest multiple of 2**16 that at least `take` (>= 1) of the keys reach."""
    prefix = tl.full((), 0, tl.uint32)
    for b in tl.static_range(16):
        trial = prefix | tl.full((), 1 << (31 - b), tl.uint32)
        if tl.sum((key >= trial).to(tl.int32), axis=0) >= take:
            prefix = trial
    return prefix


@triton.jit
def sample_kernel(n_cols, logits_ptr, lengths_ptr, guess_ptr, count_ptr,
                  K: tl.constexpr, TARGET: tl.constexpr, SAMPLE: tl.constexpr, CHUNK: tl.constexpr):
    # n_cols: i32 score columns; logits: [rows, n_cols] f32; lengths: [rows] i32 pools (clamped to
    # [0, n_cols]); guess: [rows] u32; count: [rows] i32, set to 0
    row = tl.program_id(0)
    n = tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), n_cols)
    stride = tl.maximum(n // (SAMPLE // CHUNK) // CHUNK * CHUNK, CHUNK)    # workspace.sample_stride
    i = tl.arange(0, SAMPLE)
    col = (i // CHUNK) * stride + i % CHUNK
    live = col < n
    key = tl.where(live, order_key(tl.load(logits_ptr + row.to(tl.int64) * n_cols + col, mask=live, other=0.0)), 0)
    m = tl.sum(live.to(tl.int32), axis=0)                                  # scores sampled
    t = tl.minimum(n, K)                                                   # workspace.sample_rank
    if m < n:
        t = tl.minimum((TARGET * K * m + n - 1) // n, m)
    guess = tl.full((), 0, tl.uint32)
    if t > 0:
        guess = _prefix16(key, t)
    tl.store(guess_ptr + row, guess)
    tl.store(count_ptr + row, 0)


def warps(sampled_pools: int) -> int:
    """Warps per program: one per 1,024 sampled scores (32 a thread), at least 4 and at
    most 16; 16 at 16,384 measured faster than 8 or 4 (docs/benchmarks.md)."""
    return max(4, min(16, sampled_pools // 1024))
