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


def split_candidates(logits, lengths, k: int, maxima, maxima_pools: int, programs: int = workspace.SPLIT_PROGRAMS):
    """The candidate launch (about `programs` programs, rows x spans,
    ``workspace.split_spans``): (sel_key, sel_id [rows, 2 KP + CAP], count [rows]); row
    r's count candidates, if count <= CAP, are at [2 KP, 2 KP + count) in no fixed order."""
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
    spans, span_pools = workspace.split_spans(rows, n, topk_candidates.BLOCK, programs)
    return _call.run_read(
        topk_candidates.candidates_kernel, (n, n_maxima, span_pools),
        (logits, lengths.astype(jnp.int32), maxima, jnp.zeros((rows,), jnp.int32)),
        (jax.ShapeDtypeStruct((rows, sel_w), jnp.uint32), jax.ShapeDtypeStruct((rows, sel_w), jnp.int32),
         jax.ShapeDtypeStruct((rows,), jnp.int32)),
        grid=(spans, rows), num_warps=4, num_stages=1, name="kpool_topk_candidates",
        input_output_aliases={3: 2},
        constexprs=dict(K=k, KP=kp, CAP=cap, SEL_W=sel_w, POOLS_PER_MAX=maxima_pools,
                        STEP=workspace.MAXIMA_STEP_POOLS, BLOCK=topk_candidates.BLOCK,
                        STAGES=topk_candidates.STAGES,
                        TWO_PASS=span_pools > topk_candidates.TWO_PASS_TILES * topk_candidates.BLOCK,
                        BLOCK_M=min(workspace.FLOOR_MAXIMA, 1 << max(0, n_maxima - 1).bit_length())))


def _rank(logits, lengths, seq_tokens, k, candidates, kpool):
    """The rank launch over split_candidates' output: (ids [rows, k], tokens [rows, k kpool
    + kpool - 1], or [1] without seq_tokens)."""
    rows, n = logits.shape
    kp, cap = padded_k(k), workspace.candidate_cap(k)
    sel_w = 2 * kp + cap
    sel_key, sel_id, count = candidates
    tokens = seq_tokens is not None
    width = k * kpool + kpool - 1
    per_row = workspace.rank_programs(rows, cap, topk_rank.TI)
    out = _call.run_read(
        topk_rank.rank_kernel, (n,),
        (logits, lengths, seq_tokens if tokens else lengths, count, sel_key, sel_id),
        (jax.ShapeDtypeStruct((rows, sel_w), jnp.uint32), jax.ShapeDtypeStruct((rows, sel_w), jnp.int32),
         jax.ShapeDtypeStruct((rows, k), jnp.int32),
         jax.ShapeDtypeStruct((rows, width) if tokens else (1,), jnp.int32)),
        grid=(rows, per_row), num_warps=RANK_WARPS, num_stages=1, name="kpool_topk_rank",
        input_output_aliases={4: 0, 5: 1},
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
    return _rank(logits, lengths, None, k, cand, 1)[0]


@functools.partial(jax.jit, static_argnames=("k", "maxima_pools", "kpool"))
def select_tokens_split(logits, lengths, seq_tokens, k: int, maxima, maxima_pools: int, kpool: int):
    """The split top-k of rows of seq_tokens [rows] i32 tokens (< 0: a padding row, as 0)
    and lengths = seq_tokens // kpool pools, expanded: [rows, k kpool + kpool - 1] i32,
    ``expand.expand_pools`` of ``topk_pools_split``'s ids."""
    rows, n = logits.shape
    lengths, seq_tokens = lengths.astype(jnp.int32), seq_tokens.astype(jnp.int32)
    if rows == 0 or n == 0:
        seq_tokens = jnp.maximum(seq_tokens, 0)
        t = jnp.arange(k * kpool + kpool - 1, dtype=jnp.int32) - k * kpool
        tail = (seq_tokens // kpool * kpool)[:, None] + t
        return jnp.where((t >= 0) & (t < (seq_tokens % kpool)[:, None]), tail, -1)
    cand = split_candidates(logits, lengths, k, maxima, maxima_pools)
    return _rank(logits, lengths, seq_tokens, k, cand, kpool)[1]
