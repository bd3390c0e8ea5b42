"""Triton-language helpers for comparing scores: the uint32 order key of ``pallas_kernels.topk``.

``order_key`` maps f32 to u32 with the f32 order (-0 == +0, NaN lowest, never 0), so
the Triton top-k and the group maxima the logits kernel writes compare scores
exactly as the reference's ``order_key`` does. The Triton top-k kernels share
``append_at_least`` (the candidate collection), ``take_th_key`` (the exact take-th
best of keys held in registers), ``write_sorted`` (the final order by score) and
``write_by_pool`` (the final order by pool id).
"""
import triton
import triton.language as tl


@triton.jit
def order_key(x):
    """f32 -> u32 with the f32 order (-0 == +0 -> 0x80000000, NaN -> 1, never 0)."""
    u = x.to(tl.uint32, bitcast=True)
    u = tl.where(x == 0.0, 0, u)
    key = tl.where((u >> 31) != 0, ~u, u | 0x80000000)
    return tl.where(x != x, 1, key)


NEG_INF_KEY = tl.constexpr(0x007FFFFF)     # order_key(-inf)


@triton.jit
def append_at_least(bkey, bid, at, key, col, live, floor, CAP: tl.constexpr):
    """Append the tile's live entries whose key is >= floor, in tile order, to the
    candidate buffers (bkey[i], bid[i]) = (key, column) at places at, at + 1, ...;
    places past CAP - 1 are not written. Returns how many entries qualified (written
    or not), so a caller sees an overflow as a count above CAP."""
    up = live & (key >= floor)
    pos = at + tl.cumsum(up.to(tl.int32), axis=0) - 1
    ok = up & (pos < CAP)
    tl.store(bkey + pos, key, mask=ok)
    tl.store(bid + pos, col, mask=ok)
    return tl.sum(up.to(tl.int32), axis=0)


@triton.jit
def take_th_key(key, n, take):
    """(p, reached): p the largest value that at least `take` of the keys reach (the
    take-th best key), reached how many keys reach p. key: [B] u32 in registers, n of
    them valid (>= 1), the rest 0; 1 <= take <= n, or take == n == 0 (then p = 0). Fixed
    from the top bit down, one block-wide count per bit between the least and the
    largest valid key, ending as soon as exactly `take` keys reach the prefix; a count
    against a value above the least valid key sees only valid keys."""
    kmin = tl.min(tl.where(key == 0, 0xFFFFFFFF, key), axis=0)
    kmax = tl.max(key, axis=0)
    p = kmin * 0
    reached = n
    bit = n * 0 + 31
    while (bit >= 0) & (reached != take):
        cand = p | (tl.full((), 1, tl.uint32) << bit.to(tl.uint32))
        if (cand > kmin) & (cand <= kmax):
            c = tl.sum((key >= cand).to(tl.int32), axis=0)
        else:
            c = tl.where(cand <= kmin, n, 0)
        up = c >= take
        p = tl.where(up, cand, p)
        reached = tl.where(up, c, reached)
        bit -= 1
    return p, reached


@triton.jit
def write_sorted(ck, ci, take, out_row, K: tl.constexpr, KP: tl.constexpr):
    """The `take` selected (key, id) pairs at ck / ci[0, take) into out_row[0, K): by
    descending key, ties by ascending id, then -1."""
    i = tl.arange(0, KP)
    ok = i < take
    v = (tl.load(ck + i, mask=ok, other=0).to(tl.uint64) << 32) | \
        (~tl.load(ci + i, mask=ok, other=0).to(tl.uint32)).to(tl.uint64)
    v = tl.sort(tl.where(ok, v, 0), descending=True)
    ids = tl.where(ok, (~v.to(tl.uint32)).to(tl.int32), -1)
    tl.store(out_row + i, ids, mask=i < K)


@triton.jit
def write_by_pool(ci, take, out_row, K: tl.constexpr, KP: tl.constexpr):
    """The ids of the `take` selected pairs at ci[0, take) into out_row[0, K) by ascending
    id, then -1 (``reference.pool_order``)."""
    i = tl.arange(0, KP)
    ok = i < take
    v = tl.sort(tl.where(ok, tl.load(ci + i, mask=ok, other=0).to(tl.uint32), 0xFFFFFFFF))
    tl.store(out_row + i, tl.where(ok, v.to(tl.int32), -1), mask=i < K)
