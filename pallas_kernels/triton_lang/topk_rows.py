"""Triton kernel: exact, deterministic top-k of each row (docs/semantics.md 2.5, 5.9).

Result per row: the k best ids by descending score, ties by ascending id, then -1
for the slots a row with fewer than k valid candidates leaves; the same contract
and the same order key as ``pallas_kernels.topk`` (an exact uint32 image of the f32
order: -0 == +0, NaN lowest), so the result equals the reference's bit for bit.
With ``order="pool"`` (``BY_POOL``) the same ids come by ascending id
(``reference.pool_order``).

Reads ONLY its row of scores below the row's length (and of its group maxima);
writes ONLY its row of the output and of its private buffers (outputs of the call).

One program per row, rows taken longest first (``reverse``: prefill chunks hold
rows in causal order).

A row of at most REG scores (``Tuning.reg_pools``; 0 turns the form off) is read once,
into registers, and never again: its take-th best key comes from a bit-by-bit search
(the largest key that at least take of the row's keys reach; one block-wide count per
bit between the row's least and largest key, ending early when exactly take keys
reach the prefix), the keys above it and the first ties at it by id go to the
selected buffer in id order, and one sort of the <= KP selected (key, id) pairs orders
them. Longer rows take the walks below, in a second launch (``LONG``): each launch
writes only its own rows, and each compiles with its own registers (the register
form needs many; sharing one kernel would hold the walks to its occupancy). The two
outputs are merged by row length, not written in place through an aliased output:
inside lax.map XLA's dynamic-slice fusion loses the first launch's rows of an
aliased chain (docs/design.md).

With group maxima (the largest order key of each group of 8 columns, written by
the logits kernel) and a row of at least k whole groups, the program
first finds a floor: a key that at least k of the row's whole-group maxima reach,
so at least k scores reach it and every one of the k best does. A row of at most
``Tuning.floor_maxima`` maxima reads them once into registers and takes the k-th
best maximum itself (``take_th_key``); a row of more places the k-th best maximum
with two histograms of the maxima (the binned search below, over the maxima) and
takes the least maximum at or above its sub-bin. The groups whose
maximum reaches the floor (about k of them) are listed, and only their scores are
read: those >= the floor go to the candidate buffer in group order (a group's 8
columns, ``workspace.group_columns``, are two runs of 4). The selection below then
runs over the candidates instead of the row. A row without maxima, shorter than k
groups, whose listed groups or candidates overflow their buffers (maxima tied at
the floor: a plateau), with fewer than k candidates (maxima above their columns'),
or whose edge sub-bin among the candidates holds more than KP of them (the edge's
ties then go to the lowest ids, which the row holds in id order) runs it over the
whole row.

``row_topk`` is the body for one row; the split top-k (``split_topk``) runs it as
the fallback of a row whose candidates it cannot rank.

The selection over a source (the row, or the candidate buffer) walks it four
times, the later walks mostly from L2:
  1. the source's key range [kmin, kmax];
  2. a histogram of NB monotone bins of that range (``_bin``: the key's offset
     scaled to [0, NB), an order-preserving map), which finds the bin holding the
     k-th best key;
  3. a histogram of NB sub-bins of that bin (the bin's fractional part, scaled);
  4. the ids of every key in a higher (bin, sub-bin) to the front of the selected
     buffer, in id order, and the first KP of the edge sub-bin's ids beside them.
The edge sub-bin's best `need` come from one sort of its <= SMALL (or <= KP)
candidates; when the edge holds more than KP distinct keys (many distinct keys
in one of NB * NB sub-bins: scores spread over a huge range) an exact radix
select over the edge's key bits takes over, one walk per byte; when all of the
edge's keys tie, the first ids by id are the answer. A final sort of the <= KP
selected (key, id) pairs orders them; by pool id, a sort of the ids alone (the
register form has them in id order already and sorts nothing).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from ..read import workspace
from ..read.workspace import padded_k
from . import _call
from .order_tl import append_at_least, order_key, take_th_key, write_by_pool, write_sorted


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Launch shape: BLOCK scores per step of a walk (at most 2**14: a step's two counts
    share a signed 32-bit word, the second shifted by 16 bits), warps per program, NB
    bins per level, SMALL the edge size sorted in the short form, REG the longest row
    held in registers (0: none), floor_maxima the most group maxima of a row held in
    registers for its floor (0: none). Defaults: the fastest shape measured for prefill
    chunks (docs/benchmarks.md), but for ``reg_pools``, which ``DEFAULT`` turns off."""
    block: int = 512
    num_warps: int = 4
    bins: int = 32
    small: int = 128
    reverse: bool = True
    reg_pools: int = workspace.REGISTER_ROW_POOLS
    floor_maxima: int = 4096

    def __post_init__(self):
        pow2 = lambda v: isinstance(v, int) and v >= 16 and not v & (v - 1)   # noqa: E731
        if not (pow2(self.block) and self.block <= 1 << 14 and self.num_warps in (1, 2, 4, 8, 16)
                and pow2(self.bins) and pow2(self.small) and (self.reg_pools == 0 or pow2(self.reg_pools))
                and (self.floor_maxima == 0 or pow2(self.floor_maxima))):
            raise ValueError(f"bad triton top-k tuning {self}")


@triton.jit
def _bin(key, kmin, scale, NB: tl.constexpr):
    """Monotone bin of a key in [kmin, kmax]: floor((key - kmin) * scale) clamped to NB - 1
    (scale = NB / (kmax - kmin + 1)); also returns the position inside the bin."""
    f = (key - kmin).to(tl.float32) * scale
    b = tl.minimum(f.to(tl.int32), NB - 1)
    return b, f - b.to(tl.float32)


@triton.jit
def _source(base, bkey, bid, from_buf, t, n, BLOCK: tl.constexpr):
    """Entries t .. t + BLOCK - 1 of a source: (ids [BLOCK], in-source mask, keys). The
    source is the row of scores (ids = columns) or, with ``from_buf``, the candidate
    buffer's keys and ids."""
    offs = t + tl.arange(0, BLOCK)
    m = offs < n
    if from_buf:
        key = tl.load(bkey + offs, mask=m, other=0)
        ids = tl.load(bid + offs, mask=m, other=0)
    else:
        key = order_key(tl.load(base + offs, mask=m, other=0.0))
        ids = offs
    return ids, m, key


@triton.jit
def _tile(base, bkey, bid, from_buf, t, n, kmin, scale, BLOCK: tl.constexpr, NB: tl.constexpr):
    """_source's entries with their bin and sub-bin."""
    ids, m, key = _source(base, bkey, bid, from_buf, t, n, BLOCK)
    b1, fr = _bin(key, kmin, scale, NB)
    b2 = tl.minimum((fr * NB).to(tl.int32), NB - 1)
    return ids, m, key, b1, b2


@triton.jit
def _key_range(base, bkey, bid, from_buf, n, BLOCK: tl.constexpr):
    kmin = tl.full((), 0xFFFFFFFF, tl.uint32)
    kmax = tl.full((), 0, tl.uint32)
    for t in range(0, n, BLOCK):
        ids, m, key = _source(base, bkey, bid, from_buf, t, n, BLOCK)
        lo, hi = tl.reduce((tl.where(m, key, 0xFFFFFFFF), tl.where(m, key, 0)), 0, _min_max)
        kmin = tl.minimum(kmin, lo)
        kmax = tl.maximum(kmax, hi)
    return tl.minimum(kmin, kmax), kmax


@triton.jit
def _edge_bin(base, bkey, bid, from_buf, n, take, kmin, scale, BLOCK: tl.constexpr, NB: tl.constexpr):
    """The (bin, sub-bin) (c1, c2) holding the take-th best key of a source, the count of
    keys in higher ones and the count in it."""
    bins = tl.arange(0, NB)
    hist = tl.zeros((NB,), tl.int32)
    for t in range(0, n, BLOCK):
        ids, m, key, b1, _ = _tile(base, bkey, bid, from_buf, t, n, kmin, scale, BLOCK, NB)
        hist += tl.histogram(b1, NB, mask=m)
    ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    c1 = tl.max(tl.where(ge >= take, bins, 0), axis=0)
    above1 = tl.sum(tl.where(bins > c1, hist, 0), axis=0)
    hist = tl.zeros((NB,), tl.int32)
    for t in range(0, n, BLOCK):
        ids, m, key, b1, b2 = _tile(base, bkey, bid, from_buf, t, n, kmin, scale, BLOCK, NB)
        hist += tl.histogram(b2, NB, mask=m & (b1 == c1))
    ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    c2 = tl.max(tl.where(ge >= take - above1, bins, 0), axis=0)
    above = above1 + tl.sum(tl.where(bins > c2, hist, 0), axis=0)
    edge = tl.sum(tl.where(bins == c2, hist, 0), axis=0)
    return c1, c2, above, edge


@triton.jit
def _min_max(a0, a1, b0, b1):
    return tl.minimum(a0, b0), tl.maximum(a1, b1)


@triton.jit
def _sum_min_max(a0, a1, a2, b0, b1, b2):
    return a0 + b0, tl.minimum(a1, b1), tl.maximum(a2, b2)


@triton.jit
def _group_column(gid, lane, GROUP: tl.constexpr, STEP: tl.constexpr):
    """The logit column of lane `lane` (0 .. GROUP - 1) of group `gid`, elementwise
    (workspace.group_columns: two runs of 4 columns, 8 apart)."""
    NS: tl.constexpr = STEP // GROUP
    return (gid // NS) * STEP + ((gid % NS) // 2) * 16 + (gid % 2) * 4 + (lane // 4) * 8 + lane % 4


@triton.jit
def _maxima_floor(mrow, ng, take, BLOCK: tl.constexpr, NB: tl.constexpr):
    """A key that at least `take` of the ng maxima at mrow reach (ng >= take): the least
    maximum in or above the sub-bin of the take-th best."""
    as_f32 = mrow.to(tl.pointer_type(tl.float32))            # (the row form of the source, not taken)
    as_i32 = mrow.to(tl.pointer_type(tl.int32))
    kmin, kmax = _key_range(as_f32, mrow, as_i32, True, ng, BLOCK)
    scale = NB / ((kmax - kmin).to(tl.float32) + 1.0)
    c1, c2, _, _ = _edge_bin(as_f32, mrow, as_i32, True, ng, take, kmin, scale, BLOCK, NB)
    floor = tl.full((), 0xFFFFFFFF, tl.uint32)
    for t in range(0, ng, BLOCK):
        ids, m, key, b1, b2 = _tile(as_f32, mrow, as_i32, True, t, ng, kmin, scale, BLOCK, NB)
        up = m & ((b1 > c1) | ((b1 == c1) & (b2 >= c2)))
        floor = tl.minimum(floor, tl.min(tl.where(up, key, 0xFFFFFFFF), axis=0))
    return floor


@triton.jit
def row_topk(row, n, n_cols, n_groups, logits_ptr, maxima_ptr, sel_key_ptr, sel_id_ptr, group_ptr, out_row,
             K: tl.constexpr, KP: tl.constexpr, CAP: tl.constexpr, SEL_W: tl.constexpr, GROUP: tl.constexpr,
             STEP: tl.constexpr, MAXIMA: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr, SMALL: tl.constexpr,
             FLOOR_TILE: tl.constexpr = 0, BY_POOL: tl.constexpr = False):
    """The top-k of one row of n valid scores (0 <= n <= n_cols) into out_row[0, K) (the
    module's docstring; ``topk_kernel``'s arguments, ``row`` the row), by descending
    score or with BY_POOL by ascending pool id. Also the split top-k's fallback
    (``topk_rank``)."""
    base = logits_ptr + row.to(tl.int64) * n_cols
    take = tl.minimum(n, K)
    ck = sel_key_ptr + row.to(tl.int64) * SEL_W
    ci = sel_id_ptr + row.to(tl.int64) * SEL_W
    bkey = ck + 2 * KP
    bid = ci + 2 * KP
    src_n = n
    from_buf = n < 0                                  # a runtime False
    if MAXIMA:
        ng = tl.minimum(n // STEP * (STEP // GROUP), n_groups)    # the groups of whole steps below n
        if ng >= K:
            mrow = maxima_ptr + row.to(tl.int64) * n_groups
            if FLOOR_TILE == 0:
                floor = _maxima_floor(mrow, ng, K, BLOCK, NB)
            elif ng <= FLOOR_TILE:
                offs = tl.arange(0, FLOOR_TILE)                      # the maxima in registers: the k-th best
                floor, _ = take_th_key(tl.load(mrow + offs, mask=offs < ng, other=0), ng, K)
            else:
                floor = _maxima_floor(mrow, ng, K, BLOCK, NB)
            # the groups whose maximum reaches the floor, in id order
            grow = group_ptr + row.to(tl.int64) * CAP
            n_listed = n * 0
            for t in range(0, ng, BLOCK):
                offs = t + tl.arange(0, BLOCK)
                m = offs < ng
                up = m & (tl.load(mrow + offs, mask=m, other=0) >= floor)
                pos = n_listed + tl.cumsum(up.to(tl.int32), axis=0) - 1
                tl.store(grow + pos, offs, mask=up & (pos < CAP))
                n_listed += tl.sum(up.to(tl.int32), axis=0)
            tl.debug_barrier()
            if n_listed <= CAP:
                # their scores >= the floor, then those of the partial step past the whole ones;
                # entry i of a tile is lane i % GROUP of the tile's group i // GROUP (a 1-D
                # tile: a [groups, GROUP] one costs a reshape and layout moves per tile)
                BG: tl.constexpr = BLOCK // GROUP
                NS: tl.constexpr = STEP // GROUP
                i = tl.arange(0, BLOCK)
                lane = i % GROUP
                n_cand = n * 0
                for t in range(0, n_listed + NS, BG):
                    slot = t + i // GROUP
                    live = slot < n_listed
                    gid = tl.where(live, tl.load(grow + slot, mask=live, other=0), ng + (slot - n_listed))
                    offs = _group_column(gid, lane, GROUP, STEP)
                    m = (slot < n_listed + NS) & (offs < n)
                    key = order_key(tl.load(base + offs, mask=m, other=0.0))
                    n_cand += append_at_least(bkey, bid, n_cand, key, offs, m, floor, CAP)
                if (n_cand <= CAP) & (n_cand >= K):        # (>= K: maxima that overstate fall back)
                    src_n = n_cand
                    from_buf = n >= 0                 # a runtime True
            tl.debug_barrier()
    # the selection over the source: the candidates or the whole row
    kmin, kmax = _key_range(base, bkey, bid, from_buf, src_n, BLOCK)
    scale = NB / ((kmax - kmin).to(tl.float32) + 1.0)
    c1, c2, above, edge = _edge_bin(base, bkey, bid, from_buf, src_n, take, kmin, scale, BLOCK, NB)
    if from_buf:
        if edge > KP:
            # ties past the edge buffer go to the lowest ids, which the row holds in id order
            # (the candidates are in group order)
            from_buf = n < 0
            src_n = n
            kmin, kmax = _key_range(base, bkey, bid, from_buf, src_n, BLOCK)
            scale = NB / ((kmax - kmin).to(tl.float32) + 1.0)
            c1, c2, above, edge = _edge_bin(base, bkey, bid, from_buf, src_n, take, kmin, scale, BLOCK, NB)
    need = take - above                                               # taken from the edge bin
    # walk 4: the sure ones to [0, above) in id order, the first KP of the edge bin to [KP, 2 KP)
    cnt_s = n * 0
    cnt_e = n * 0
    emin = tl.full((), 0xFFFFFFFF, tl.uint32)
    emax = tl.full((), 0, tl.uint32)
    for t in range(0, src_n, BLOCK):
        ids, m, key, b1, b2 = _tile(base, bkey, bid, from_buf, t, src_n, kmin, scale, BLOCK, NB)
        sure = m & ((b1 > c1) | ((b1 == c1) & (b2 > c2)))
        onedge = m & (b1 == c1) & (b2 == c2)
        # both counts in one word (a tile's counts are <= 2**14): one scan and one reduction
        both = sure.to(tl.int32) + (onedge.to(tl.int32) << 16)
        upto = tl.cumsum(both, axis=0)
        ps = cnt_s + (upto & 0xFFFF) - 1
        pe = cnt_e + (upto >> 16) - 1
        keep_e = onedge & (pe < KP)
        pos = tl.where(sure, ps, KP + pe)
        sel = sure | keep_e
        tl.store(ck + pos, key, mask=sel)
        tl.store(ci + pos, ids, mask=sel)
        tot, lo, hi = tl.reduce((both, tl.where(onedge, key, 0xFFFFFFFF), tl.where(onedge, key, 0)), 0,
                                _sum_min_max)
        cnt_s += tot & 0xFFFF
        cnt_e += tot >> 16
        emin = tl.minimum(emin, lo)
        emax = tl.maximum(emax, hi)
    tl.debug_barrier()
    # the edge bin's best `need`: sorted when it holds <= KP, the first by id when all tie,
    # else (rare: many distinct keys in one bin of NB * NB) one exact radix walk per digit
    if edge <= SMALL:
        j = tl.arange(0, SMALL)
        okj = j < edge
        v = (tl.load(ck + KP + j, mask=okj, other=0).to(tl.uint64) << 32) | \
            (~tl.load(ci + KP + j, mask=okj, other=0).to(tl.uint32)).to(tl.uint64)
        v = tl.sort(tl.where(okj, v, 0), descending=True)
        tl.store(ck + above + j, (v >> 32).to(tl.uint32), mask=j < need)
        tl.store(ci + above + j, (~v.to(tl.uint32)).to(tl.int32), mask=j < need)
    elif (edge <= KP) | (emin == emax):
        j = tl.arange(0, KP)
        okj = j < tl.minimum(edge, KP)
        v = (tl.load(ck + KP + j, mask=okj, other=0).to(tl.uint64) << 32) | \
            (~tl.load(ci + KP + j, mask=okj, other=0).to(tl.uint32)).to(tl.uint64)
        v = tl.sort(tl.where(okj, v, 0), descending=True)
        tl.store(ck + above + j, (v >> 32).to(tl.uint32), mask=j < need)
        tl.store(ci + above + j, (~v.to(tl.uint32)).to(tl.int32), mask=j < need)
    else:
        # exact k-th key of the edge bin by radix digits over the source (keys in bin c1, c2)
        prefix = (n * 0).to(tl.uint32)
        pmask = (n * 0).to(tl.uint32)
        rem = need
        rb = tl.arange(0, 256)
        for p in tl.static_range(4):
            shift = (24 - 8 * p)
            h = tl.zeros((256,), tl.int32)
            for t in range(0, src_n, BLOCK):
                ids, m, key, b1, b2 = _tile(base, bkey, bid, from_buf, t, src_n, kmin, scale, BLOCK, NB)
                mm = m & (b1 == c1) & (b2 == c2) & ((key & pmask) == prefix)
                h += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=mm)
            g2 = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h
            d = tl.max(tl.where(g2 >= rem, rb, 0), axis=0)
            rem = rem - tl.sum(tl.where(rb > d, h, 0), axis=0)
            prefix = prefix | (d.to(tl.uint32) << shift)
            pmask = pmask | (tl.full((), 255, tl.uint32) << shift)
        # edge keys above the k-th, then `rem` ties at it, lowest ids first
        n_gt = need - rem
        cg = n * 0
        cq = n * 0
        for t in range(0, src_n, BLOCK):
            ids, m, key, b1, b2 = _tile(base, bkey, bid, from_buf, t, src_n, kmin, scale, BLOCK, NB)
            e = m & (b1 == c1) & (b2 == c2)
            gt = e & (key > prefix)
            eq = e & (key == prefix)
            pg = cg + tl.cumsum(gt.to(tl.int32), axis=0) - 1
            pq = cq + tl.cumsum(eq.to(tl.int32), axis=0) - 1
            pos = above + tl.where(gt, pg, n_gt + pq)
            sel = gt | (eq & (pq < rem))
            tl.store(ck + pos, key, mask=sel)
            tl.store(ci + pos, ids, mask=sel)
            cg += tl.sum(gt.to(tl.int32), axis=0)
            cq += tl.sum(eq.to(tl.int32), axis=0)
    tl.debug_barrier()
    if BY_POOL:
        write_by_pool(ci, take, out_row, K, KP)
    else:
        write_sorted(ck, ci, take, out_row, K, KP)


@triton.jit
def register_topk(base, n, take, ck, ci, out_row, K: tl.constexpr, KP: tl.constexpr, REG: tl.constexpr,
                  BY_POOL: tl.constexpr = False):
    """The top-k of a row of n <= REG scores at base into out_row[0, K), the row read once
    into registers (the module's docstring); ck / ci: the row's selected buffer, >= KP.
    With BY_POOL the selected ids, already in id order, go out as they are."""
    offs = tl.arange(0, REG)
    m = offs < n
    key = tl.where(m, order_key(tl.load(base + offs, mask=m, other=0.0)), 0)     # [REG] u32, 0 outside
    p, reached = take_th_key(key, n, take)
    # the keys above p, then the first ties at p by id (all of them when exactly take reach p);
    # p is 0 only when take == n: then every key of the row, none outside
    sel = key >= tl.maximum(p, 1)
    if reached != take:
        gt = key > p
        eq = key == p
        need = take - tl.sum(gt.to(tl.int32), axis=0)
        sel = gt | (eq & (tl.cumsum(eq.to(tl.int32), axis=0) <= need))
    pos = tl.cumsum(sel.to(tl.int32), axis=0) - 1
    if BY_POOL:
        tl.store(out_row + pos, offs, mask=sel)
        j = tl.arange(0, KP)
        tl.store(out_row + j, tl.full((KP,), -1, tl.int32), mask=(j >= take) & (j < K))
    else:
        tl.store(ck + pos, key, mask=sel)
        tl.store(ci + pos, offs, mask=sel)
        tl.debug_barrier()
        write_sorted(ck, ci, take, out_row, K, KP)


@triton.jit
def topk_kernel(n_rows, n_cols, n_groups, logits_ptr, lengths_ptr, maxima_ptr, sel_key_ptr, sel_id_ptr,
                group_ptr, out_ptr, K: tl.constexpr, KP: tl.constexpr, CAP: tl.constexpr, SEL_W: tl.constexpr,
                GROUP: tl.constexpr, STEP: tl.constexpr, MAXIMA: tl.constexpr, BLOCK: tl.constexpr,
                NB: tl.constexpr, SMALL: tl.constexpr, REVERSE: tl.constexpr, REG: tl.constexpr,
                LONG: tl.constexpr, FLOOR_TILE: tl.constexpr, BY_POOL: tl.constexpr):
    # logits: [n_rows, n_cols] f32; lengths: [n_rows] i32; maxima: [n_rows, n_groups] u32 (the
    # order key's maximum of the columns workspace.group_columns(g); read only with MAXIMA);
    # sel_key / sel_id: [n_rows, SEL_W] u32 / i32 scratch (each row its own: [0, KP) the answer,
    # [KP, 2 KP) the edge bin, with MAXIMA [2 KP, 2 KP + CAP) the candidates); group:
    # [n_rows, CAP] i32 scratch with MAXIMA (the listed groups); out: [n_rows, K] i32.
    # REG > 0: LONG False takes the rows of at most REG scores (the register form), LONG True
    # the others; each leaves the other's rows of out unwritten. BY_POOL: each row's ids by
    # ascending id, not by descending score; a row of at most K scores (all of them selected)
    # then takes no walk, in both launches.
    pid = tl.program_id(0)
    row = (n_rows - 1 - pid) if REVERSE else pid
    out_row = out_ptr + row.to(tl.int64) * K
    n = tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), n_cols)
    if BY_POOL:
        if n <= K:                            # every valid id is selected: in id order, no walk
            j = tl.arange(0, KP)
            tl.store(out_row + j, tl.where(j < n, j, -1), mask=j < K)
        else:
            _launch_row(row, n, n_cols, n_groups, logits_ptr, maxima_ptr, sel_key_ptr, sel_id_ptr, group_ptr,
                        out_row, K, KP, CAP, SEL_W, GROUP, STEP, MAXIMA, BLOCK, NB, SMALL, REG, LONG, FLOOR_TILE,
                        BY_POOL)
    else:
        _launch_row(row, n, n_cols, n_groups, logits_ptr, maxima_ptr, sel_key_ptr, sel_id_ptr, group_ptr, out_row,
                    K, KP, CAP, SEL_W, GROUP, STEP, MAXIMA, BLOCK, NB, SMALL, REG, LONG, FLOOR_TILE, BY_POOL)


@triton.jit
def _launch_row(row, n, n_cols, n_groups, logits_ptr, maxima_ptr, sel_key_ptr, sel_id_ptr, group_ptr, out_row,
                K: tl.constexpr, KP: tl.constexpr, CAP: tl.constexpr, SEL_W: tl.constexpr, GROUP: tl.constexpr,
                STEP: tl.constexpr, MAXIMA: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
                SMALL: tl.constexpr, REG: tl.constexpr, LONG: tl.constexpr, FLOOR_TILE: tl.constexpr,
                BY_POOL: tl.constexpr):
    """One row of ``topk_kernel``: the walks (REG 0, or LONG and a row of more than REG
    scores) or the register form (not LONG, at most REG scores)."""
    if REG == 0:
        row_topk(row, n, n_cols, n_groups, logits_ptr, maxima_ptr, sel_key_ptr, sel_id_ptr, group_ptr, out_row,
                 K, KP, CAP, SEL_W, GROUP, STEP, MAXIMA, BLOCK, NB, SMALL, FLOOR_TILE, BY_POOL)
    elif LONG:
        if n > REG:
            row_topk(row, n, n_cols, n_groups, logits_ptr, maxima_ptr, sel_key_ptr, sel_id_ptr, group_ptr, out_row,
                     K, KP, CAP, SEL_W, GROUP, STEP, MAXIMA, BLOCK, NB, SMALL, FLOOR_TILE, BY_POOL)
    else:
        if n <= REG:
            register_topk(logits_ptr + row.to(tl.int64) * n_cols, n, tl.minimum(n, K),
                          sel_key_ptr + row.to(tl.int64) * SEL_W, sel_id_ptr + row.to(tl.int64) * SEL_W, out_row,
                          K, KP, REG, BY_POOL)


# the prefill chunks' shape (select_tokens): the register form off, faster through the
# whole select_tokens at 32k and 128k (docs/benchmarks.md)
DEFAULT = Tuning(reg_pools=0)
WHOLE_ROW = Tuning(block=1024, bins=64)      # without maxima: every walk covers the whole row


def needs_maxima(n_cols: int, tune: Tuning) -> bool:
    """Whether rows of up to n_cols scores take group maxima: only rows longer than the
    register form's REG walk through the maxima's floor."""
    return n_cols > tune.reg_pools


def consts(k, cap, sel_w, tune, maxima):
    """``row_topk``'s constexprs."""
    return dict(K=k, KP=padded_k(k), CAP=cap, SEL_W=sel_w, GROUP=workspace.MAXIMA_GROUP_POOLS,
                STEP=workspace.MAXIMA_STEP_POOLS, MAXIMA=maxima, BLOCK=tune.block, NB=tune.bins,
                SMALL=min(tune.small, padded_k(k)))


@functools.partial(jax.jit, static_argnames=("k", "tune", "order"))
def topk_pools(logits, lengths, k: int, maxima=None, *, tune: Tuning | None = None, order: str = "score"):
    """logits: [rows, n] f32; lengths: [rows] i32 (ids >= length are invalid); maxima:
    None or [rows, workspace.maxima_cols(n)] u32, entry g the largest ``order_key`` of
    the columns ``workspace.group_columns(g)`` (two runs of 4, not 8 consecutive
    columns; ``prefill_logits`` writes them). An entry below its columns' maximum makes
    the result wrong; entries above it only cost time. Returns [rows, k] i32:
    descending score, ties by ascending id, -1 padded; ``order="pool"``: the same ids
    by ascending id, -1 padded (no final sort by score).
    Rows of at most ``tune.reg_pools`` scores take the register form whether or not
    maxima come. ``tune`` None: DEFAULT with maxima, WHOLE_ROW without (docs/benchmarks.md)."""
    if order not in ("score", "pool"):
        raise ValueError(f"topk_pools: order must be 'score' or 'pool', got {order!r}")
    rows, n = logits.shape
    kp = padded_k(k)
    cap = workspace.candidate_cap(k)
    if rows == 0:
        return jnp.zeros((0, k), jnp.int32)
    if n == 0:
        return jnp.full((rows, k), -1, jnp.int32)
    n_groups = workspace.maxima_cols(n)
    if tune is None:
        tune = WHOLE_ROW if maxima is None else DEFAULT
    if maxima is None:
        maxima_in, sel_w, groups = jnp.zeros((1,), jnp.uint32), 2 * kp, 1
    else:
        if maxima.shape != (rows, n_groups) or maxima.dtype != jnp.uint32:
            raise ValueError(f"maxima must be [{rows}, {n_groups}] uint32, got {maxima.shape} {maxima.dtype}")
        maxima_in, sel_w, groups = maxima, 2 * kp + cap, rows * cap
    lengths = lengths.astype(jnp.int32)
    reg = min(tune.reg_pools, 1 << (n - 1).bit_length())   # >= n: the register launch takes every row
    floor_tile_maxima = min(tune.floor_maxima, max(16, 1 << (n_groups - 1).bit_length()))   # n_groups >= 1

    def launch(reg_, long_, with_maxima):
        mx_, sel_w_, groups_ = (maxima_in, sel_w, groups) if with_maxima else (jnp.zeros((1,), jnp.uint32), 2 * kp, 1)
        return _call.run_read(
            topk_kernel, (rows, n, n_groups), (logits, lengths, mx_),
            (jax.ShapeDtypeStruct((rows, sel_w_), jnp.uint32), jax.ShapeDtypeStruct((rows, sel_w_), jnp.int32),
             jax.ShapeDtypeStruct((groups_,), jnp.int32), jax.ShapeDtypeStruct((rows, k), jnp.int32)),
            grid=(rows,), num_warps=tune.num_warps, num_stages=1, name="kpool_topk_rows",
            constexprs=dict(consts(k, cap, sel_w_, tune, with_maxima), REVERSE=tune.reverse, REG=reg_, LONG=long_,
                            FLOOR_TILE=floor_tile_maxima if with_maxima else 0, BY_POOL=order == "pool"))[3]

    if reg == 0:
        return launch(0, False, maxima is not None)
    out = launch(reg, False, False)                                # the rows of at most reg scores
    if reg < n:                                                    # the longer rows, merged by length
        short = (jnp.clip(lengths, 0, n) <= reg)[:, None]          # as the kernel clips a row's length
        out = jnp.where(short, out, launch(reg, True, maxima is not None))
    return out
