"""The Triton top-k of bare scores (``ops.topk_pools(implementation="triton")``).

Rows of scores come without the group maxima the logits kernel writes inside
``select_tokens``. Rows the row top-k holds in registers take it (``topk_rows``, one
program per row); longer rows would leave most SMs idle one program each, walking
megabytes, so they take three launches (``workspace.dense_topk_takes``):

  1. ``topk_sample``: one program per row reads a sample of the row and writes a
     guess, a key about 2 k of its scores reach;
  2. ``topk_collect``: many programs per row read it once, each a span held in
     registers, and append the scores reaching the guess to the row's candidate
     buffer (``workspace.dense_candidates``: 4 KP entries);
  3. ``topk_select``: one program per row selects the k best of its candidates in
     registers and sorts them, or walks the whole row when the candidates cannot hold
     them (fewer than k, or more than the buffer).

Both forms give the reference's ids bit for bit.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..read import workspace
from ..read.workspace import padded_k
from . import _call, topk_collect, topk_rows, topk_sample, topk_select
from .topk_rows import WHOLE_ROW, consts

FALLBACK = WHOLE_ROW     # the whole-row walk of a row whose candidates cannot hold its k best


def sample_guesses(logits, lengths, k: int):
    """The sample launch: (guess [rows] u32, count [rows] i32 zeros)."""
    rows, n = logits.shape
    sampled_pools = workspace.sample_pools(n, k)
    return _call.run_read(
        topk_sample.sample_kernel, (n,), (logits, lengths),
        (jax.ShapeDtypeStruct((rows,), jnp.uint32), jax.ShapeDtypeStruct((rows,), jnp.int32)),
        grid=(rows,), num_warps=topk_sample.warps(sampled_pools), num_stages=1, name="kpool_topk_sample",
        constexprs=dict(K=k, TARGET=workspace.SAMPLE_TARGET_PER_K, SAMPLE=sampled_pools,
                        CHUNK=workspace.sample_chunk_pools(sampled_pools)))


def collect_candidates(logits, lengths, guess, count, k: int):
    """The collect launch: (key [rows, W] u32, id [rows, W] i32, count [rows] i32), W =
    ``workspace.dense_candidates(k)``; row r's candidates, if count <= W, at [0, count)."""
    rows, n = logits.shape
    w = workspace.dense_candidates(k)
    return _call.run_read(
        topk_collect.collect_kernel, (n,), (logits, lengths, guess, count),
        (jax.ShapeDtypeStruct((rows, w), jnp.uint32), jax.ShapeDtypeStruct((rows, w), jnp.int32),
         jax.ShapeDtypeStruct((rows,), jnp.int32)),
        grid=(-(-n // topk_collect.SPAN), rows), num_warps=topk_collect.WARPS, num_stages=1,
        name="kpool_topk_collect", input_output_aliases={3: 2},
        constexprs=dict(W=w, SPAN=topk_collect.SPAN))


def select_candidates(logits, lengths, candidates, k: int):
    """The select launch: [rows, k] i32 ids."""
    rows, n = logits.shape
    key, ids, count = candidates
    kp = padded_k(k)
    return _call.run_read(
        topk_select.select_kernel, (n,), (logits, lengths, count, key, ids),
        (jax.ShapeDtypeStruct((rows, 2 * kp), jnp.uint32), jax.ShapeDtypeStruct((rows, 2 * kp), jnp.int32),
         jax.ShapeDtypeStruct((rows, k), jnp.int32)),
        grid=(rows,), num_warps=topk_select.warps(workspace.dense_candidates(k)), num_stages=1,
        name="kpool_topk_dense_select",
        constexprs=dict(consts(k, workspace.candidate_cap(k), 2 * kp, FALLBACK, False),
                        W=workspace.dense_candidates(k)))[2]


@functools.partial(jax.jit, static_argnames=("k",))
def topk_pools(logits, lengths, k: int):
    """logits: [rows, n] f32; lengths: [rows] i32 pools (ids >= length are invalid).
    Returns [rows, k] i32: descending score, ties by ascending id, -1 padded."""
    rows, n = logits.shape
    if not workspace.dense_topk_takes(rows, n, k):
        return topk_rows.topk_pools(logits, lengths, k)
    lengths = lengths.astype(jnp.int32)
    guess, count = sample_guesses(logits, lengths, k)
    return select_candidates(logits, lengths, collect_candidates(logits, lengths, guess, count, k), k)
