"""The top-k driver: ``topk_pools`` and its mode dispatch (docs/semantics.md 2.5, 5.9).

``topk_pools`` runs the streaming path of ``common`` in mode "stream" (``Tuning.mode``).
Mode "filter" (the default) runs five lean kernels instead, each in its own file:
``maxima`` (the row's run maxima), ``floor`` (the key floor of
``bucket_floor``, by a radix k-th search of the maxima in place of an XLA sort,
and the list of runs whose maximum reaches it; it also zeroes the filter's
counters), ``filter`` (reads only those runs, ~an eighth of the row: each
program reserves room in its row's candidate list with one atomic add and writes
its keys >= floor there; a count > CAP means overflow) and ``select`` (each
candidate ranked against the row's others, ids by rank), then ``fallback``
(a row whose list overflowed runs the streaming path, with the same floor; the
other rows return at once).

The package imports one way: ``common`` (order keys, the streaming core,
``Tuning``, the constants) <- the stage modules (``maxima``, ``floor``,
``filter``, ``select``, ``fallback``: one kernel each, importing only ``common``
and the backend) <- this module, which chains them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..core import backend as B
from . import maxima
from .common import (RADIX_BITS, ROW_WARPS, Geometry, Tuning, _call, bucket_floor, choose_splits, filter_cap,
                     has_floor, merge_candidates, next_pow2, order_key)
from .fallback import stream_overflowed
from .filter import filter_candidates
from .floor import floor_of_maxima
from .select import rank_candidates


def key_floor(scores, lengths, k: int, buckets: int, *, bits: int = 32, radix_bits: int = RADIX_BITS,
              interpret=None, num_warps: int = ROW_WARPS):
    """scores [rows, n] f32, lengths [rows] i32 -> (floor [rows] u32 == ``common.bucket_floor``,
    zeros [rows] i32, runs [rows, MP] i32, n_runs [rows] i32); needs ``common.has_floor``."""
    rows, n_cols = scores.shape
    if not has_floor(n_cols, k, buckets):
        raise ValueError(f"no floor for rows of {n_cols} scores at k = {k}, {buckets} runs")
    top = maxima.run_maxima(scores, lengths, buckets, interpret=interpret)          # [rows, M]
    return floor_of_maxima(top, k, bits=bits, radix_bits=radix_bits, interpret=interpret,
                           num_warps=num_warps)


def select_candidates(scores, lengths, floor, counts, keys, ids, k: int, *, ti: int = 64, tj: int = 64,
                      interpret=None, num_warps: int = 4, num_stages: int = 1):
    """scores [rows, n] f32, lengths [rows] i32, floor [rows] u32 (the filter's), and the
    filter's counts [rows] i32, keys [rows, CAP] u32, ids [rows, CAP] i32 ->
    [rows, k] i32: best ids by (key desc, id asc), -1 padded. Two launches: the
    select kernel (``select.rank_candidates``), then ``fallback`` on the rows whose
    list overflowed."""
    out = rank_candidates(counts, keys, ids, k, ti=ti, tj=tj, interpret=interpret, num_warps=num_warps,
                          num_stages=num_stages)
    return stream_overflowed(scores, lengths, floor, counts, out, cap=keys.shape[1],
                             interpret=B.resolve_interpret(interpret))


def _stream_path(scores, lengths, floor, k: int, splits, interpret, tune: Tuning):
    """The streaming filter (+ merge when a row is split) with the given key floor."""
    rows, n_cols = scores.shape
    g = Geometry(k=k, bn=1, ch=min(tune.score_chunk, next_pow2(n_cols)))
    sp = choose_splits(rows, n_cols, k, splits, tune.target_programs)
    split_cols = -(-(-(-n_cols // sp)) // g.ch) * g.ch               # per split, whole chunks
    sp = -(-n_cols // split_cols)
    final = sp == 1
    res, kbuf, ibuf = _call(g, (lengths, floor, scores),
                            source="scores", b=1, n=rows, splits=sp, final=final,
                            interpret=interpret, name="kpool_topk", n_cols=n_cols,
                            split_cols=split_cols, in_splits=0, num_warps=tune.num_warps)
    if final:
        return res
    return merge_candidates(res, kbuf, ibuf, k, b=1, n=rows, bn=1, in_splits=sp, interpret=interpret)


def _filter_lists(scores, lengths, k: int, interpret, tune: Tuning):
    """Filter mode before the select: (floor [rows] u32, counts [rows] i32, keys [rows, CAP]
    u32, ids [rows, CAP] i32, overflowed [rows] bool). Rows too short for a floor
    (``has_floor``) get every valid key, in id order, from XLA (floor 0)."""
    rows, n_cols = scores.shape
    buckets = tune.buckets_per_k * k
    cap = filter_cap(n_cols, k, tune)
    if not has_floor(n_cols, k, buckets):
        keys = jnp.pad(order_key(scores), ((0, 0), (0, cap - n_cols)))
        ids = jnp.broadcast_to(jnp.arange(cap, dtype=jnp.int32), (rows, cap))
        cnt = jnp.clip(lengths, 0, n_cols)
        return jnp.zeros((rows,), jnp.uint32), cnt, keys, ids, cnt > cap
    floor, zeros, runs, n_runs = key_floor(scores, lengths, k, buckets, bits=tune.floor_bits,
                                           radix_bits=tune.radix_bits, interpret=interpret,
                                           num_warps=tune.row_warps)
    cnt, keys, ids = filter_candidates(scores, lengths, floor, zeros, runs, n_runs, buckets,
                                       cap=cap, interpret=interpret, num_warps=tune.filter_warps)
    return floor, cnt, keys, ids, cnt > cap


def _check_args(scores, lengths):
    return scores.astype(jnp.float32), lengths.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("k", "interpret", "tune"))
def filter_overflowed(scores, lengths, k: int, *, interpret=None, tune: Tuning = Tuning(mode="filter")):
    """() bool: whether filter mode would take the streaming path for some row of these
    inputs (the row's candidates >= floor overflow its candidate list)."""
    scores, lengths = _check_args(scores, lengths)
    return jnp.any(_filter_lists(scores, lengths, k, interpret, tune)[4])


@functools.partial(jax.jit, static_argnames=("k", "splits", "interpret", "tune"))
def topk_pools(scores, lengths, k: int, *, splits=None, interpret=None, tune: Tuning = Tuning()):
    """scores: [rows, n] f32; lengths: [rows] i32 (ids >= length are invalid).
    Returns [rows, k] i32: best ids by (score desc, id asc), -1 padded.

    `splits` (programs per row of the streaming kernel) applies to the stream path
    only (filter mode's fallback streams each overflowed row in one program)."""
    rows, n_cols = scores.shape
    if rows == 0:
        return jnp.zeros((0, k), jnp.int32)
    if n_cols == 0:
        return jnp.full((rows, k), -1, jnp.int32)
    scores, lengths = _check_args(scores, lengths)
    if tune.mode == "filter":
        # Exact: a row whose list did not overflow holds every valid key >= floor (and at
        # least k valid keys are >= floor, or the floor is 0 and the list holds every
        # valid key); the fallback kernel after the select runs the exact streaming path
        # (same floor) on a row whose list overflowed. No host round trip.
        floor, cnt, keys, ids, _ = _filter_lists(scores, lengths, k, interpret, tune)
        return select_candidates(scores, lengths, floor, cnt, keys, ids, k, ti=tune.select_ti,
                                 tj=tune.select_tj, interpret=interpret,
                                 num_warps=tune.select_warps, num_stages=tune.select_stages)
    floor = bucket_floor(scores, lengths, k, tune.buckets_per_k * k)
    return _stream_path(scores, lengths, floor, k, splits, interpret, tune)
