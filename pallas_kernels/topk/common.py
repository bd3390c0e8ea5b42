"""Kernel: exact, deterministic top-k over rows of scores (docs/semantics.md 2.5, 5.9).

The shared floor of the ``topk`` package: order keys, the streaming core (also
used by ``pallas_kernels.read.paged_topk``), ``Tuning`` and the constants. The stage
modules import it and nothing else of the package; ``driver`` sits on top.

Result per row: the k best candidates ordered by descending score, ties by
ascending id, then -1 for the slots a row with fewer than k valid candidates
leaves. Scores are compared through ``order_key`` (an exact uint32 image of the
f32 order: -0 == +0, NaN lowest), so there is no float fuzz in the selection.

Reads ONLY its inputs; writes ONLY its outputs: the [rows, k] i32 ids, plus
per-program candidate buffers ([buffer rows, CAP] u32 keys and i32 ids, and a
count per buffer row) that are outputs of the call, private to one program each.

Selection algorithm (a streaming filter, the same core is used by the fused
paged logits -> top-k kernel, paged_topk.py). A program owns BN rows and one
contiguous range of candidate ids, and feeds it chunk by chunk, ids ascending:

  * append: a candidate enters the row's buffer if the row holds fewer than k
    survivors, or if its key beats the row's threshold (the k-th best key at
    the last compaction; a later candidate that only ties it has a higher id,
    so it can never displace a survivor). Positions come from a cumsum, so the
    buffer stays in id order.
  * compact (when a buffer could overflow, CAP - CH): find the exact k-th best
    key by a radix search over the 32 key bits (RADIX_BITS per step, counts by
    comparison), keep every key above it plus the lowest-id ties, and squeeze
    the survivors to the front in id order. The new threshold is that key.
  * finish: compact to <= k survivors, then either sort them by rank
    (rank = #better + #equal-with-lower-id, computed in [BN, TI, KP] tiles) and
    scatter the ids to their output slots, -1 after; or, when the row's ids are
    split over several programs, leave the survivors and their count for a
    merge pass (this kernel with ``source="candidates"``), which streams the
    splits' survivors in split order (ids still ascending) through the same core.

Grid: scores: (1, ceil(rows / BN), splits); candidates (merge): (B, ceil(n / BN)).
Buffer row of padded row p (of B * ceil(n / BN) * BN) in split s: p * splits + s.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from ..core import backend as B

RADIX_BITS = 2             # key bits decided per step of the threshold search
RANK_TILE_ELEMS = 16384    # BN * TI * KP comparisons per rank tile
SCORE_CHUNK = 512          # scores per chunk of the standalone kernel (H200 sweep: best of 512..8192)
TARGET_PROGRAMS = 528      # ~4 programs per SM of an H200 (132 SMs; H200 sweep: 528 > 264 at chunk 512)
MIN_SPLIT_FACTOR = 8       # a split holds at least 8 * KP candidates


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _iota(shape, dim, dtype=jnp.int32):
    return lax.broadcasted_iota(dtype, shape, dim)


def order_key(x):
    """f32 -> uint32 key, unsigned order == score order; -0 == +0, NaN -> 1, 0 unused."""
    x = x.astype(jnp.float32)
    u = lax.bitcast_convert_type(x, jnp.uint32)
    u = jnp.where(x == 0.0, jnp.uint32(0), u)
    key = jnp.where((u >> 31) != 0, ~u, u | jnp.uint32(0x80000000))
    return jnp.where(jnp.isnan(x), jnp.uint32(1), key)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static tile sizes of one selection: k survivors, BN rows, CH candidates per chunk."""

    k: int
    bn: int
    ch: int

    def __post_init__(self):
        if self.k < 1 or self.bn < 1 or self.ch < 1:
            raise ValueError(f"bad selection geometry {self}")
        for name in ("bn", "ch"):
            v = getattr(self, name)
            if v & (v - 1):
                raise ValueError(f"Geometry.{name} must be a power of two, got {v}")

    @property
    def kp(self) -> int:          # k rounded up to a power of two (emit tiles)
        return next_pow2(self.k)

    @property
    def cap(self) -> int:         # buffer columns per row: room for k survivors + one chunk
        return next_pow2(self.kp + self.ch)

    @property
    def ti(self) -> int:          # rows of the rank tile
        return max(1, min(self.kp, RANK_TILE_ELEMS // (self.bn * self.kp)))


class State:
    """Per-row selection state: (count [BN] i32, threshold key [BN] u32, full [BN] i32)."""

    @staticmethod
    def init(bn):
        return (jnp.zeros((bn,), jnp.int32), jnp.zeros((bn,), jnp.uint32), jnp.zeros((bn,), jnp.int32))


def prefilter_state(bn: int, floor):
    """Initial state whose filter admits exactly the keys >= floor [BN] u32 (0: admit
    all). Valid when at least k of the row's keys are >= floor, so that no key of
    the top k is ever filtered out (``bucket_floor`` guarantees it)."""
    cnt, _, _ = State.init(bn)
    on = floor > 0
    return cnt, jnp.where(on, floor - 1, 0).astype(jnp.uint32), on.astype(jnp.int32)


def kth_key(key, live, k, radix_bits: int = RADIX_BITS, bits: int = 32, skip_prefix: bool = False):
    """[BN] u32: the k-th largest key among `live` entries of key [BN, C]; 0 if fewer than k.

    Radix search from the top bit: at each step keep the largest digit d such
    that at least k live keys are >= prefix|d (counted by comparison), deciding
    `radix_bits` bits per step. `k` is static or a traced [BN] i32. With bits < 32
    only the top `bits` bits are searched: the result is the k-th largest key with
    its low 32 - bits bits cleared (at least k live keys are still >= it).

    skip_prefix: first find the bits that every nonzero live key shares (from their
    minimum and maximum: one reduction each) and search only below them, since the
    k-th largest shares them too whenever at least k live keys are nonzero (else
    the result is 0, as without the skip). Same result. On decode logits (positive,
    a few binades) it skips 3 of the floor's 8 steps (Nsight Compute: 0.94M instructions
    where N(0, 1) scores take 1.35M); N(0, 1) maxima straddle 2.0, so
    they share no bit and nothing is skipped.
    """
    bn = key.shape[0]
    if 32 % radix_bits or bits % radix_bits or not 0 < bits <= 32:
        raise ValueError(f"kth_key: {radix_bits} radix bits do not divide {bits} / 32 bits")
    kk = k if isinstance(k, int) else k[:, None]                                     # int or [BN, 1]
    d = _iota((1, 1 << radix_bits, 1), 1).astype(jnp.uint32)                        # [1, D, 1]

    def step(j, t):
        # ONE reduction per step (all D digit counts at once): on the GPU a reduction
        # across warps costs a shared-memory round trip and barrier. With one sum per
        # digit instead, a whole top-k takes 155 us at 4-bit steps (128 sums) and 125 us
        # at 2-bit steps (64 sums) on the H200
        shift = (32 - radix_bits - radix_bits * j).astype(jnp.uint32)
        cand = t[:, None, None] | (d << shift)                                       # [BN, D, 1]
        ge = live[:, None, :] & (key[:, None, :] >= cand)                            # [BN, D, C]
        c = jnp.sum(ge.astype(jnp.int32), axis=2)                                    # [BN, D]
        nd = jnp.sum((c >= kk).astype(jnp.int32), axis=1)                            # [BN]
        return t | (jnp.maximum(nd - 1, 0).astype(jnp.uint32) << shift)

    n_steps = bits // radix_bits
    if not skip_prefix:
        return lax.fori_loop(0, n_steps, step, jnp.zeros((bn,), jnp.uint32))
    nz = live & (key > 0)
    lo = jnp.min(jnp.where(nz, key, jnp.uint32(0xFFFFFFFF)), axis=1)                # [BN]
    hi = jnp.max(jnp.where(nz, key, jnp.uint32(0)), axis=1)
    enough = jnp.sum(nz.astype(jnp.int32), axis=1) >= k                             # [BN]
    shared = lax.clz(lax.bitcast_convert_type(lo ^ hi, jnp.int32))                  # [BN] 0..32 bits
    first = jnp.minimum(jnp.min(shared) // radix_bits, n_steps)                     # scalar: whole steps
    t0 = hi & _top_bits_mask(first * radix_bits)                                    # <= bits bits
    return jnp.where(enough, lax.fori_loop(first, n_steps, step, jnp.where(enough, t0, jnp.uint32(0))),
                     jnp.uint32(0))


def _top_bits_mask(n):
    """u32 mask of the top n bits (traced n in 0..32)."""
    n = n.astype(jnp.uint32)
    low = jnp.where(n >= 32, jnp.uint32(0), jnp.uint32(0xFFFFFFFF) >> jnp.minimum(n, 31))   # the other bits
    return ~low


def keep_top_k(key, live, k: int):
    """(keep [BN, C] bool, thr [BN] u32): the k best `live` entries of key [BN, C] u32,
    ties at the k-th key thr broken by lowest column (columns in id order)."""
    thr = kth_key(key, live, k)                                                      # [BN]
    gt = live & (key > thr[:, None])
    eq = live & (key == thr[:, None])
    n_gt = jnp.sum(gt.astype(jnp.int32), axis=1)
    ei = eq.astype(jnp.int32)
    keep = gt | (eq & ((jnp.cumsum(ei, axis=1) - ei) < (k - n_gt)[:, None]))
    return keep, thr


def append(g: Geometry, kbuf, ibuf, brow, st, key, ids, valid):
    """Append the chunk's passing candidates (key [BN, CH] u32, ids [BN, CH] i32)."""
    cnt, thr, full = st
    cand = valid & ((key > thr[:, None]) | (full[:, None] == 0))                    # [BN, CH]
    ci = cand.astype(jnp.int32)

    @B.when(jnp.sum(ci) > 0)
    def _write():
        pos = cnt[:, None] + jnp.cumsum(ci, axis=1) - ci                             # exclusive
        rows = brow[:, None] + 0 * pos
        B.scatter(kbuf, rows, pos, key, cand)
        B.scatter(ibuf, rows, pos, ids, cand)

    return cnt + jnp.sum(ci, axis=1), thr, full


def compact(g: Geometry, kbuf, ibuf, brow, st, interpret: bool):
    """Keep each row's k best (lowest id among equal keys), in id order, at the front."""
    cnt = st[0]
    B.barrier(interpret)                                   # appends are visible
    cols = _iota((g.bn, g.cap), 1)
    rows = brow[:, None] + 0 * cols
    live = cols < cnt[:, None]
    key = B.gather(kbuf, rows, cols, mask=live, other=0)                             # [BN, CAP]
    ids = B.gather(ibuf, rows, cols, mask=live, other=0)
    keep, thr = keep_top_k(key, live, g.k)                                           # [BN, CAP], [BN]
    ki = keep.astype(jnp.int32)
    pos = jnp.cumsum(ki, axis=1) - ki
    B.barrier(interpret)                                   # every read above is done
    B.scatter(kbuf, rows, pos, key, keep)
    B.scatter(ibuf, rows, pos, ids, keep)
    new = jnp.sum(ki, axis=1)
    return new, thr, (new >= g.k).astype(jnp.int32)


def stream(g: Geometry, kbuf, ibuf, brow, n_chunks, produce, interpret: bool, init=None):
    """Feed chunks 0 .. n_chunks-1 (traced count) through the filter; return the state
    after a final compaction (<= k survivors per row, id order). `init` (default:
    empty, no threshold) may carry a pre-filter threshold (``prefilter_state``).

    The loop runs one extra, empty step whose compaction limit is k: that is the
    final compaction (one traced copy of the compaction code, not two).
    ``produce(c, active) -> (key [BN, CH] u32, ids [BN, CH] i32, valid [BN, CH])``
    must read nothing and return no valid entry when ``active`` is False.
    """
    def body(c, st):
        last = c == n_chunks
        key, ids, valid = produce(jnp.minimum(c, jnp.maximum(n_chunks - 1, 0)), ~last)
        st = append(g, kbuf, ibuf, brow, st, key, ids, valid)
        limit = (g.cap - g.ch) - last.astype(jnp.int32) * (g.cap - g.ch - g.k)   # k on the last step
        return lax.cond(jnp.max(st[0]) > limit,
                        lambda s_: compact(g, kbuf, ibuf, brow, s_, interpret),
                        lambda s_: s_, st)

    return lax.fori_loop(0, n_chunks + 1, body, State.init(g.bn) if init is None else init)


def emit_sorted(g: Geometry, kbuf, ibuf, brow, cnt, out_ref, orow, row_ok, interpret: bool):
    """out_ref[orow, :k] = the survivors' ids by (key desc, id asc), then -1.

    Each survivor's rank is counted (how many survivors beat it), a tile of TI
    survivors at a time; only the tiles that hold survivors run (none for an empty
    row)."""
    B.barrier(interpret)
    kp, ti = g.kp, g.ti
    cj = _iota((g.bn, kp), 1)
    inj = cj < cnt[:, None]
    kj = B.gather(kbuf, brow[:, None] + 0 * cj, cj, mask=inj, other=0)              # [BN, KP]

    def tile(t, carry):
        ci = t * ti + _iota((g.bn, ti), 1)                                           # [BN, TI]
        ini = ci < cnt[:, None]
        rows_i = brow[:, None] + 0 * ci
        ki = B.gather(kbuf, rows_i, ci, mask=ini, other=0)
        ii = B.gather(ibuf, rows_i, ci, mask=ini, other=0)
        kj3, ki3 = kj[:, None, :], ki[:, :, None]
        better = inj[:, None, :] & ((kj3 > ki3) | ((kj3 == ki3) & (cj[:, None, :] < ci[:, :, None])))
        rank = jnp.sum(better.astype(jnp.int32), axis=2)                             # [BN, TI]
        B.scatter(out_ref, orow[:, None] + 0 * rank, rank, ii, ini & row_ok[:, None])
        return carry

    n_tiles = (jnp.minimum(jnp.max(cnt), kp) + ti - 1) // ti                         # tiles with survivors
    lax.fori_loop(0, n_tiles, tile, 0)
    empty = (cj >= cnt[:, None]) & (cj < g.k) & row_ok[:, None]
    B.scatter(out_ref, orow[:, None] + 0 * cj, cj, jnp.full((g.bn, kp), -1, jnp.int32), empty)


def score_producer(g: Geometry, x_ref, flat, length, lo, hi, n_cols: int):
    """``stream``'s producer over scores x_ref [rows, n_cols] f32: chunk c holds the
    columns lo + c * CH .. of rows `flat` [BN], valid below `hi` (scalar) and the
    row's `length` [BN]."""
    def produce(c, active):
        cols = lo + c * g.ch + _iota((g.bn, g.ch), 1)                                 # [BN, CH]
        valid = (cols < hi) & (cols < length[:, None]) & active
        x = B.gather(x_ref, flat[:, None] + 0 * cols, jnp.minimum(cols, n_cols - 1),
                     mask=valid, other=0.0)
        return order_key(x), cols, valid
    return produce


class Rows:
    """Rows r0 .. r0+BN-1 of request b in a (B, n) row space, padded to row blocks."""

    def __init__(self, b, rb, *, n: int, bn: int, row_blocks: int):
        i = _iota((bn,), 0)
        r = rb * bn + i
        self.ok = r < n
        self.flat = b * n + jnp.minimum(r, n - 1)          # output row (clamped)
        self.padded = (b * row_blocks + rb) * bn + i       # row in the padded space


def finish(g: Geometry, st, kbuf, ibuf, brow, rows: Rows, out_refs, *, final: bool, interpret: bool):
    """final: sort + write ids; else store the survivor count of each buffer row."""
    if final:
        (out_ref,) = out_refs
        emit_sorted(g, kbuf, ibuf, brow, st[0], out_ref, rows.flat, rows.ok, interpret)
    else:
        (cnt_ref,) = out_refs
        cnt_ref[brow] = st[0]                              # buffer rows are private: no mask


def buffer_shapes(g: Geometry, n_buf_rows: int):
    return (jax.ShapeDtypeStruct((n_buf_rows, g.cap), jnp.uint32),
            jax.ShapeDtypeStruct((n_buf_rows, g.cap), jnp.int32))


def _kernel(*refs, g: Geometry, source: str, n: int, row_blocks: int, splits: int,
            n_cols: int, split_cols: int, in_splits: int, final: bool, interpret: bool):
    # source "scores":     len_ref [B*n] i32, floor_ref [B*n] u32, x_ref [B*n, n_cols] f32
    # source "candidates": cin_ref [B*n_pad*in_splits] i32, kin_ref/iin_ref [.., CAP_in]
    # outputs: (out [B*n, k] i32 if final else cnt [n_buf] i32), kbuf [n_buf, CAP] u32,
    #          ibuf [n_buf, CAP] i32
    n_in = 3
    ins, (res_ref, kbuf, ibuf) = refs[:n_in], refs[n_in:]
    b, rb, sp = B.program_id(0), B.program_id(1), B.program_id(2)
    rows = Rows(b, rb, n=n, bn=g.bn, row_blocks=row_blocks)
    brow = rows.padded * splits + sp
    init = None
    if source == "scores":
        len_ref, floor_ref, x_ref = ins
        length = jnp.where(rows.ok, B.load(len_ref.at[rows.flat], mask=rows.ok, other=0), 0)
        init = prefilter_state(g.bn, B.load(floor_ref.at[rows.flat], mask=rows.ok, other=0))
        lo = sp * split_cols
        hi = jnp.minimum(jnp.minimum(lo + split_cols, n_cols), jnp.max(length))
        n_chunks = jnp.maximum(hi - lo + g.ch - 1, 0) // g.ch

        produce = score_producer(g, x_ref, rows.flat, length, lo, hi, n_cols)
    else:
        cin_ref, kin_ref, iin_ref = ins
        n_chunks = in_splits

        def produce(c, active):
            src = rows.padded * in_splits + c                                        # [BN]
            cnt_in = B.load(cin_ref.at[src])
            cols = _iota((g.bn, g.ch), 1)
            valid = (cols < cnt_in[:, None]) & rows.ok[:, None] & active
            r2 = src[:, None] + 0 * cols
            return (B.gather(kin_ref, r2, cols, mask=valid, other=0),
                    B.gather(iin_ref, r2, cols, mask=valid, other=0), valid)

    st = stream(g, kbuf, ibuf, brow, n_chunks, produce, interpret, init)
    finish(g, st, kbuf, ibuf, brow, rows, (res_ref,), final=final, interpret=interpret)


def _call(g: Geometry, inputs, *, source, b, n, splits, final, interpret, name, num_warps=4, **static):
    row_blocks = -(-n // g.bn)
    n_buf = b * row_blocks * g.bn * splits
    res = (jax.ShapeDtypeStruct((b * n, g.k), jnp.int32) if final
           else jax.ShapeDtypeStruct((n_buf,), jnp.int32))
    interpret = B.resolve_interpret(interpret)
    kern = functools.partial(_kernel, g=g, source=source, n=n, row_blocks=row_blocks, splits=splits,
                             final=final, interpret=interpret, **static)
    return B.pallas_call(
        kern, grid=(b, row_blocks, splits),
        out_shape=(res,) + buffer_shapes(g, n_buf),
        input_output_aliases={}, interpret=interpret, name=name, num_warps=num_warps,
    )(*inputs)


def merge_candidates(cnt, kbuf, ibuf, k: int, *, b: int, n: int, bn: int, in_splits: int,
                     interpret=None):
    """Merge per-split survivors (count [n_buf], keys/ids [n_buf, CAP]) -> [b*n, k] i32."""
    g = Geometry(k=k, bn=bn, ch=next_pow2(k))
    out, _, _ = _call(g, (cnt, kbuf, ibuf), source="candidates", b=b, n=n, splits=1, final=True,
                      interpret=interpret, name="kpool_topk_merge",
                      n_cols=0, split_cols=0, in_splits=in_splits)
    return out


def choose_splits(programs: int, n_cands: int, k: int, splits=None, target=TARGET_PROGRAMS) -> int:
    """How many programs share one row's candidates: enough programs for the GPU,
    but each split at least MIN_SPLIT_FACTOR * KP candidates (survivors <= 1/8)."""
    if splits is not None:
        return max(1, int(splits))
    by_size = max(1, n_cands // (MIN_SPLIT_FACTOR * next_pow2(k)))
    return max(1, min(-(-target // max(programs, 1)), by_size))


def bucket_floor(scores, lengths, k: int, buckets: int, bits: int = 32):
    """[rows] u32 key floor with at least k valid keys >= it (0: no useful floor).

    The row's columns are cut into M <= `buckets` equal runs (``run_geometry``); the
    k-th largest of the runs' maxima is such a floor (k different runs each hold a
    key >= it). It is a cheap XLA pass (one read of the scores, a sort of [rows, M]);
    on random scores only ~1.1 k keys per row pass it (k = 512, 4096 runs), so the
    streaming filter rarely appends and almost never compacts. Ties and adversarial
    rows stay exact: the floor only ever admits more keys than the top k.

    With bits < 32 the floor keeps only its top `bits` bits (the low ones cleared):
    a lower floor, still valid, that the Pallas floor finds in fewer radix steps.
    """
    rows, n = scores.shape
    if not has_floor(n, k, buckets):
        return jnp.zeros((rows,), jnp.uint32)
    top = run_maxima(scores, lengths, buckets)                                     # [rows, M]
    return lax.sort(top, dimension=1)[:, top.shape[1] - k] & floor_mask(bits)


def floor_mask(bits: int):
    """u32 mask of a key's top `bits` bits."""
    return jnp.uint32((0xFFFFFFFF << (32 - bits)) & 0xFFFFFFFF)


def run_geometry(n_cols: int, buckets: int):
    """(RUN, M): the row's columns cut into M runs of RUN consecutive columns, RUN a power
    of two >= n / buckets (so that the runs tile the row whenever RUN divides it: one
    unmasked, vectorised load per run in the Pallas kernels), M = ceil(n / RUN) <= buckets."""
    run = next_pow2(max(1, -(-n_cols // max(1, buckets))))
    return run, -(-n_cols // run)


def has_floor(n_cols: int, k: int, buckets: int) -> bool:
    """Whether ``bucket_floor`` computes a floor for [rows, n_cols] scores (else 0)."""
    return buckets >= k and n_cols >= 2 * buckets and run_geometry(n_cols, buckets)[1] >= k


def run_maxima(scores, lengths, buckets: int):
    """[rows, M] u32: the largest valid key of each of the row's M runs of RUN columns
    (``run_geometry``; 0 for a run with no valid key). XLA."""
    rows, n = scores.shape
    run, m = run_geometry(n, buckets)
    valid = jnp.arange(n, dtype=jnp.int32)[None, :] < lengths.astype(jnp.int32)[:, None]
    key = jnp.where(valid, order_key(scores), jnp.uint32(0))                       # [rows, n]
    key = jnp.pad(key, ((0, 0), (0, run * m - n)))
    return jnp.max(key.reshape(rows, m, run), axis=2)                              # [rows, M]


MODES = ("stream", "filter")
FILTER_CAP = 0                 # candidate slots per row; 0 = auto (filter_cap)
FILTER_ROOM_PER_K = 4          # auto: room for 4 k candidates per row (the floor admits ~1.15 k)
ROW_WARPS = 8                  # warps of the floor kernel (one program per row)
MAX_SELECT_SLOTS = 8192        # the candidate list (CAP) at most, when the row has a floor


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Launch shape of ``topk_pools`` (chosen by ``benchmarks/bench_read.py --sweep``).

    score_chunk: scores per streaming step; target_programs: how many programs the
    row splits aim for; buckets_per_k: runs of the pre-filter per selected id
    (0 = no pre-filter); num_warps: warps of the streaming kernel.

    mode: "stream" (the streaming filter + merge) or "filter" (Pallas run maxima and
    floor, a filter pass over the runs that reach the floor into a per-row candidate
    list, a select that ranks the candidates pairwise; a row whose list overflowed
    takes the streaming path in a launch of its own). filter_cap: slots of a
    row's candidate list (0 = auto, ``filter_cap``); filter_warps: warps of the
    filter kernel; select_ti / select_tj: candidates a select program ranks /
    compares them with per step; select_warps / select_stages: its warps and Triton
    pipeline stages; radix_bits: bits per step of the floor's radix search;
    floor_bits: how many top bits of the floor are searched (the rest cleared: a
    slightly lower floor in fewer steps); row_warps: warps of the floor kernel.
    Defaults: the H200 sweeps of docs/benchmarks.md; select_ti 32 (Nsight Compute: the
    select takes 11.8 / 11.6 us against 13.1 / 12.9 at 64, [64, 131072] / [64, 32768],
    with the fallback in a launch of its own)."""
    score_chunk: int = SCORE_CHUNK
    target_programs: int = TARGET_PROGRAMS
    buckets_per_k: int = 8
    num_warps: int = 4
    mode: str = "filter"
    filter_cap: int = FILTER_CAP
    filter_warps: int = 8
    select_ti: int = 32
    select_tj: int = 64
    select_warps: int = 4
    select_stages: int = 1
    radix_bits: int = 2
    floor_bits: int = 16
    row_warps: int = ROW_WARPS

    def __post_init__(self):
        def pow2(v, lo):
            return v >= lo and not v & (v - 1)
        if (not pow2(self.score_chunk, 16) or self.buckets_per_k < 0 or self.mode not in MODES
                or not (self.filter_cap == 0 or pow2(self.filter_cap, 16))
                or not pow2(self.select_ti, 1) or not pow2(self.select_tj, 1) or self.select_warps < 1
                or self.select_stages < 1
                or self.radix_bits not in (1, 2, 4, 8)
                or self.floor_bits % self.radix_bits or not 0 < self.floor_bits <= 32
                or self.num_warps < 1 or self.row_warps < 1 or self.filter_warps < 1):
            raise ValueError(f"bad topk tuning {self}")


def filter_cap(n_cols: int, k: int, tune: Tuning) -> int:
    """Slots of a row's candidate list: tune.filter_cap, or with filter_cap == 0 (auto)
    room for FILTER_ROOM_PER_K * k candidates (the floor admits ~1.15 k keys of a
    random row; at most MAX_SELECT_SLOTS), or for every key when the row is too
    short for a floor (n < 2 * buckets: then the list is every valid key, in id
    order, built without a kernel). So a list overflows only on skewed or tied rows.
    """
    if not has_floor(n_cols, k, tune.buckets_per_k * k):
        return max(16, next_pow2(n_cols))
    if tune.filter_cap:
        return tune.filter_cap
    return max(16, min(next_pow2(FILTER_ROOM_PER_K * k), next_pow2(n_cols), MAX_SELECT_SLOTS))
