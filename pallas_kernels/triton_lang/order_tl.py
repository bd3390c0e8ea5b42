"""Triton-language helpers for comparing scores: the uint32 order key of ``pallas_kernels.topk``.

``order_key`` maps f32 to u32 with the f32 order (-0 == +0, NaN lowest, never 0), so
the Triton top-k and the group maxima the logits kernel writes compare scores
exactly as the reference's ``order_key`` does. ``append_at_least`` is the candidate
collection both Triton top-k kernels share.
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
