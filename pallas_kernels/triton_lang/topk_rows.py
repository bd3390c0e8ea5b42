"""Triton kernel: exact, deterministic top-k of each row (docs/semantics.md 2.5, 5.9).

Result per row: the k best ids by descending score, ties by ascending id, then -1
for the slots a row with fewer than k valid candidates leaves; the same contract
and the same order key as ``pallas_kernels.topk`` (an exact uint32 image of the f32
order: -0 == +0, NaN lowest), so the result equals the reference's bit for bit.

Reads ONLY its row of scores below the row's length; writes ONLY its row of the
output and of its private candidate buffers (outputs of the call).

One program per row, rows taken longest first (``reverse``: prefill chunks hold
rows in causal order). The program walks its row four times, the later walks
mostly from L2:
  1. the row's key range [kmin, kmax];
  2. a histogram of NB monotone bins of that range (``_bin``: the key's offset
     scaled to [0, NB), an order-preserving map), which finds the bin holding the
     k-th best key;
  3. a histogram of NB sub-bins of that bin (the bin's fractional part, scaled);
  4. the ids of every key in a higher (bin, sub-bin) to the front of the candidate
     buffer, in id order, and the first KP of the edge sub-bin's ids beside them.
The edge sub-bin's best `need` come from one sort of its <= SMALL (or <= KP)
candidates; when the edge holds more than KP distinct keys (many distinct keys
in one of NB * NB sub-bins: scores spread over a huge range) an exact radix
select over the edge's key bits takes over, one walk per byte; when all of the
edge's keys tie, the first ids by id are the answer. A final sort of the <= KP
selected (key, id) pairs orders them.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from ..read.workspace import padded_k
from . import _call


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Launch shape: BLOCK scores per step of a walk, warps per program, NB bins per
    level, SMALL the edge size sorted in the short form. Defaults: the fastest shape of
    ``benchmarks/bench_read.py --prefill-tc`` on the H200 (docs/benchmarks.md)."""
    block: int = 1024
    num_warps: int = 4
    bins: int = 64
    small: int = 128
    reverse: bool = True

    def __post_init__(self):
        pow2 = lambda v: isinstance(v, int) and v >= 16 and not v & (v - 1)   # noqa: E731
        if not (pow2(self.block) and self.num_warps in (1, 2, 4, 8, 16) and pow2(self.bins) and pow2(self.small)):
            raise ValueError(f"bad triton top-k tuning {self}")


@triton.jit
def order_key(x):
    """f32 -> u32 with the f32 order (-0 == +0 -> 0x80000000, NaN -> 1, never 0)."""
    u = x.to(tl.uint32, bitcast=True)
    u = tl.where(x == 0.0, 0, u)
    key = tl.where((u >> 31) != 0, ~u, u | 0x80000000)
    return tl.where(x != x, 1, key)


@triton.jit
def _bin(key, kmin, scale, NB: tl.constexpr):
    """Monotone bin of a key in [kmin, kmax]: floor((key - kmin) * scale) clamped to NB - 1
    (scale = NB / (kmax - kmin + 1)); also returns the position inside the bin."""
    f = (key - kmin).to(tl.float32) * scale
    b = tl.minimum(f.to(tl.int32), NB - 1)
    return b, f - b.to(tl.float32)


@triton.jit
def _tile(base, t, n, kmin, scale, BLOCK: tl.constexpr, NB: tl.constexpr):
    """Scores t .. t + BLOCK - 1 of a walk: (ids [BLOCK], in-row mask, keys, bin, sub-bin)."""
    offs = t + tl.arange(0, BLOCK)
    m = offs < n
    key = order_key(tl.load(base + offs, mask=m, other=0.0))
    b1, fr = _bin(key, kmin, scale, NB)
    b2 = tl.minimum((fr * NB).to(tl.int32), NB - 1)
    return offs, m, key, b1, b2


@triton.jit
def topk_kernel(n_rows, n_cols, logits_ptr, lengths_ptr, cand_key_ptr, cand_id_ptr, out_ptr,
                K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
                SMALL: tl.constexpr, REVERSE: tl.constexpr):
    # logits: [n_rows, n_cols] f32; lengths: [n_rows] i32; cand_key / cand_id: [n_rows, 2 * KP]
    # u32 / i32 scratch (each row its own: [0, KP) the answer, [KP, 2 KP) the edge bin);
    # out: [n_rows, K] i32
    pid = tl.program_id(0)
    row = (n_rows - 1 - pid) if REVERSE else pid
    n = tl.minimum(tl.maximum(tl.load(lengths_ptr + row), 0), n_cols)
    base = logits_ptr + row.to(tl.int64) * n_cols
    take = tl.minimum(n, K)
    ck = cand_key_ptr + row.to(tl.int64) * (2 * KP)
    ci = cand_id_ptr + row.to(tl.int64) * (2 * KP)
    # walk 1: the key range
    kmin = tl.full((), 0xFFFFFFFF, tl.uint32)
    kmax = tl.full((), 0, tl.uint32)
    for t in range(0, n, BLOCK):
        offs = t + tl.arange(0, BLOCK)
        m = offs < n
        key = order_key(tl.load(base + offs, mask=m, other=0.0))
        kmin = tl.minimum(kmin, tl.min(tl.where(m, key, 0xFFFFFFFF), axis=0))
        kmax = tl.maximum(kmax, tl.max(tl.where(m, key, 0), axis=0))
    scale = NB / ((kmax - tl.minimum(kmin, kmax)).to(tl.float32) + 1.0)
    bins = tl.arange(0, NB)
    # walk 2: histogram of the level-1 bins
    hist = tl.zeros((NB,), tl.int32)
    for t in range(0, n, BLOCK):
        offs, m, key, b1, _ = _tile(base, t, n, kmin, scale, BLOCK, NB)
        hist += tl.histogram(b1, NB, mask=m)
    ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    c1 = tl.max(tl.where(ge >= take, bins, 0), axis=0)
    above1 = tl.sum(tl.where(bins > c1, hist, 0), axis=0)
    # walk 3: histogram of the level-2 bins inside bin c1
    hist = tl.zeros((NB,), tl.int32)
    for t in range(0, n, BLOCK):
        offs, m, key, b1, b2 = _tile(base, t, n, kmin, scale, BLOCK, NB)
        hist += tl.histogram(b2, NB, mask=m & (b1 == c1))
    ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
    need1 = take - above1
    c2 = tl.max(tl.where(ge >= need1, bins, 0), axis=0)
    above = above1 + tl.sum(tl.where(bins > c2, hist, 0), axis=0)     # surely selected
    edge = tl.sum(tl.where(bins == c2, hist, 0), axis=0)              # the bin of the k-th best
    need = take - above                                               # taken from the edge bin
    # walk 4: the sure ones to [0, above) in id order, the first KP of the edge bin to [KP, 2 KP)
    cnt_s = n * 0
    cnt_e = n * 0
    emin = tl.full((), 0xFFFFFFFF, tl.uint32)
    emax = tl.full((), 0, tl.uint32)
    for t in range(0, n, BLOCK):
        offs, m, key, b1, b2 = _tile(base, t, n, kmin, scale, BLOCK, NB)
        sure = m & ((b1 > c1) | ((b1 == c1) & (b2 > c2)))
        onedge = m & (b1 == c1) & (b2 == c2)
        ps = cnt_s + tl.cumsum(sure.to(tl.int32), axis=0) - 1
        pe = cnt_e + tl.cumsum(onedge.to(tl.int32), axis=0) - 1
        keep_e = onedge & (pe < KP)
        pos = tl.where(sure, ps, KP + pe)
        sel = sure | keep_e
        tl.store(ck + pos, key, mask=sel)
        tl.store(ci + pos, offs, mask=sel)
        cnt_s += tl.sum(sure.to(tl.int32), axis=0)
        cnt_e += tl.sum(onedge.to(tl.int32), axis=0)
        emin = tl.minimum(emin, tl.min(tl.where(onedge, key, 0xFFFFFFFF), axis=0))
        emax = tl.maximum(emax, tl.max(tl.where(onedge, key, 0), axis=0))
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
        # exact k-th key of the edge bin by radix digits over the row (keys are in bin c1, c2)
        prefix = (n * 0).to(tl.uint32)
        pmask = (n * 0).to(tl.uint32)
        rem = need
        rb = tl.arange(0, 256)
        for p in tl.static_range(4):
            shift = (24 - 8 * p)
            h = tl.zeros((256,), tl.int32)
            for t in range(0, n, BLOCK):
                offs, m, key, b1, b2 = _tile(base, t, n, kmin, scale, BLOCK, NB)
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
        for t in range(0, n, BLOCK):
            offs, m, key, b1, b2 = _tile(base, t, n, kmin, scale, BLOCK, NB)
            e = m & (b1 == c1) & (b2 == c2)
            gt = e & (key > prefix)
            eq = e & (key == prefix)
            pg = cg + tl.cumsum(gt.to(tl.int32), axis=0) - 1
            pq = cq + tl.cumsum(eq.to(tl.int32), axis=0) - 1
            pos = above + tl.where(gt, pg, n_gt + pq)
            sel = gt | (eq & (pq < rem))
            tl.store(ck + pos, key, mask=sel)
            tl.store(ci + pos, offs, mask=sel)
            cg += tl.sum(gt.to(tl.int32), axis=0)
            cq += tl.sum(eq.to(tl.int32), axis=0)
    tl.debug_barrier()
    i = tl.arange(0, KP)
    ok = i < take
    v = (tl.load(ck + i, mask=ok, other=0).to(tl.uint64) << 32) | \
        (~tl.load(ci + i, mask=ok, other=0).to(tl.uint32)).to(tl.uint64)
    v = tl.sort(tl.where(ok, v, 0), descending=True)
    ids = tl.where(ok, (~v.to(tl.uint32)).to(tl.int32), -1)
    tl.store(out_ptr + row.to(tl.int64) * K + i, ids, mask=i < K)




@functools.partial(jax.jit, static_argnames=("k", "tune"))
def topk_pools(logits, lengths, k: int, *, tune: Tuning = Tuning()):
    """logits: [rows, n] f32; lengths: [rows] i32 (ids >= length are invalid).
    Returns [rows, k] i32: descending score, ties by ascending id, -1 padded."""
    rows, n = logits.shape
    kp = padded_k(k)
    if rows == 0:
        return jnp.zeros((0, k), jnp.int32)
    if n == 0:
        return jnp.full((rows, k), -1, jnp.int32)
    out = _call.run_read(
        topk_kernel, (rows, n), (logits, lengths.astype(jnp.int32)),
        (jax.ShapeDtypeStruct((rows, 2 * kp), jnp.uint32), jax.ShapeDtypeStruct((rows, 2 * kp), jnp.int32),
         jax.ShapeDtypeStruct((rows, k), jnp.int32)),
        grid=(rows,), num_warps=tune.num_warps, num_stages=1, name="kpool_topk_rows",
        constexprs=dict(K=k, KP=kp, BLOCK=tune.block, NB=tune.bins, SMALL=min(tune.small, kp),
                        REVERSE=tune.reverse))
    return out[2]
