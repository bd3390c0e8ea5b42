"""The split top-k of few long rows (decode): two launches, each with many programs per row.

A decode batch has few query rows of up to 256k pools: one program per row would walk
a megabyte alone. Here

  1. ``topk_candidates`` cuts each row into spans, one program each, that append the
     scores of their span at or above the row's floor (from the row's maxima) to the
     row's candidate buffer;
  2. ``topk_rank`` ranks every candidate against the row's others, spread over several
     programs per row, and writes the k best by rank, as pool ids and (for
     ``select_tokens_split``) expanded to token indices with the row's tail.

The result equals ``topk_rows.topk_pools``'s, exact whatever the maxima hold: maxima
only set the floor, and a row whose candidates cannot be ranked (fewer than the floor
promised, or more than the buffer holds) runs the whole-row walk in step 2.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..read import workspace
from ..read.workspace import padded_k
from . import _call, topk_candidates, topk_rank
from .topk_rows import WHOLE_ROW, consts

FALLBACK = WHOLE_ROW     # the whole-row walk of a row that cannot be ranked (its warps: RANK_WARPS)
RANK_WARPS = 4


def split_candidates(logits, lengths, k: int, maxima, maxima_pools: int, programs: int = workspace.SPLIT_PROGRAMS,
                     *, kpool: int = 0, counters=None):
    """The candidate launch (about `programs` programs, rows x spans,
    ``workspace.split_spans``): (sel_key, sel_id [rows, 2 KP + CAP], count [rows]); row
    r's count candidates, if count <= CAP, are at [2 KP, 2 KP + count) in no fixed order.
    lengths: [rows] i32 pools, or with ``kpool`` each row's position (the row's length
    (p + 1) // kpool pools). counters: [rows] i32 zeros to count into (the logits
    kernel's, ``prefill_logits.paged_logits(counters=True)``), None for new ones."""
    rows, n = logits.shape
    kp, cap = padded_k(k), workspace.candidate_cap(k)
    sel_w = 2 * kp + cap
    n_maxima = workspace.maxima_cols(n, maxima_pools)
    if maxima.shape != (rows, n_maxima) or maxima.dtype != jnp.uint32:
        raise ValueError(f"maxima must be [{rows}, {n_maxima}] uint32, got {maxima.shape} {maxima.dtype}")
    if rows == 0 or n == 0:
        return (jnp.zeros((rows, sel_w), jnp.uint32), jnp.zeros((rows, sel_w), jnp.int32),
                jnp.zeros((rows,), jnp.int32))
    if rows > workspace.MAX_GRID_ROWS:
        raise ValueError(f"the split top-k takes at most {workspace.MAX_GRID_ROWS} rows per call, got {rows}")
    if counters is None:
        counters = jnp.zeros((rows,), jnp.int32)
    elif counters.shape != (rows,) or counters.dtype != jnp.int32:
        raise ValueError(f"counters must be [{rows}] int32, got {counters.shape} {counters.dtype}")
    spans, span_pools = workspace.split_spans(rows, n, topk_candidates.BLOCK, programs)
    return _call.run_read(
        topk_candidates.candidates_kernel, (n, n_maxima, span_pools),
        (logits, lengths.astype(jnp.int32), maxima, counters),
        (jax.ShapeDtypeStruct((rows, sel_w), jnp.uint32), jax.ShapeDtypeStruct((rows, sel_w), jnp.int32),
         jax.ShapeDtypeStruct((rows,), jnp.int32)),
        grid=(spans, rows), num_warps=topk_candidates.WARPS, num_stages=1, name="kpool_topk_candidates",
        input_output_aliases={3: 2},
        constexprs=dict(K=k, KP=kp, CAP=cap, SEL_W=sel_w, POOLS_PER_MAX=maxima_pools,
                        STEP=workspace.MAXIMA_STEP_POOLS, BLOCK=topk_candidates.BLOCK,
                        STAGES=topk_candidates.STAGES,
                        TWO_PASS=span_pools > topk_candidates.TWO_PASS_TILES * topk_candidates.BLOCK,
                        BLOCK_M=min(workspace.FLOOR_MAXIMA, 1 << max(0, n_maxima - 1).bit_length()),
                        POS_R=kpool))


def _rank(logits, lengths, k, candidates, kpool, tokens: bool):
    """The rank launch over split_candidates' output: (ids [rows, k], tokens [rows, k kpool
    + kpool - 1], or [1] without ``tokens``). lengths: [rows] i32 pools, or with ``tokens``
    positions."""
    rows, n = logits.shape
    kp, cap = padded_k(k), workspace.candidate_cap(k)
    sel_w = 2 * kp + cap
    sel_key, sel_id, count = candidates
    width = k * kpool + kpool - 1
    per_row = workspace.rank_programs(rows, cap, topk_rank.TI)
    out = _call.run_read(
        topk_rank.rank_kernel, (n,),
        (logits, lengths, count, sel_key, sel_id),
        (jax.ShapeDtypeStruct((rows, sel_w), jnp.uint32), jax.ShapeDtypeStruct((rows, sel_w), jnp.int32),
         jax.ShapeDtypeStruct((rows, k), jnp.int32),
         jax.ShapeDtypeStruct((rows, width) if tokens else (1,), jnp.int32)),
        grid=(rows, per_row), num_warps=RANK_WARPS, num_stages=1, name="kpool_topk_rank",
        input_output_aliases={3: 0, 4: 1},
        constexprs=dict(consts(k, cap, sel_w, FALLBACK, False), R=kpool, RP=1 << max(0, kpool - 1).bit_length(),
                        W=width, TOKENS=tokens, TI=topk_rank.TI, TJ=topk_rank.TJ,
                        STAGES=topk_rank.STAGES))
    return out[2], out[3]


@functools.partial(jax.jit, static_argnames=("k", "maxima_pools"))
def topk_pools_split(logits, lengths, k: int, maxima, maxima_pools: int):
    """logits: [rows, n] f32; lengths: [rows] i32 pools; maxima: [rows,
    workspace.maxima_cols(n, maxima_pools)] u32, entry g the largest ``order_key`` of its
    columns (``prefill_logits.paged_logits(maxima_pools=...)``). Returns [rows, k] i32,
    ``topk_rows.topk_pools``'s result: descending score, ties by ascending id, -1 padded."""
    rows, n = logits.shape
    if rows == 0:
        return jnp.zeros((0, k), jnp.int32)
    if n == 0:
        return jnp.full((rows, k), -1, jnp.int32)
    lengths = lengths.astype(jnp.int32)
    cand = split_candidates(logits, lengths, k, maxima, maxima_pools)
    return _rank(logits, lengths, k, cand, 1, False)[0]


@functools.partial(jax.jit, static_argnames=("k", "maxima_pools", "kpool"))
def select_tokens_split(logits, positions, k: int, maxima, maxima_pools: int, kpool: int, counters=None):
    """The split top-k of rows at positions [rows] i32 (-1: a padding row), row p holding
    p + 1 tokens and (p + 1) // kpool pools, expanded: [rows, k kpool + kpool - 1] i32,
    ``expand.expand_pools`` of ``topk_pools_split``'s ids. The kernels read the
    positions themselves (no XLA kernel computes lengths). counters: as for
    ``split_candidates``."""
    rows, n = logits.shape
    positions = positions.astype(jnp.int32)
    if rows == 0 or n == 0:
        seq_tokens = jnp.maximum(positions + 1, 0)
        t = jnp.arange(k * kpool + kpool - 1, dtype=jnp.int32) - k * kpool
        tail = (seq_tokens // kpool * kpool)[:, None] + t
        return jnp.where((t >= 0) & (t < (seq_tokens % kpool)[:, None]), tail, -1)
    cand = split_candidates(logits, positions, k, maxima, maxima_pools, kpool=kpool, counters=counters)
    return _rank(logits, positions, k, cand, kpool, True)[1]
