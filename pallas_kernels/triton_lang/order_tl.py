"""Triton-language helpers for comparing scores: the uint32 order key of ``pallas_kernels.topk``.

``order_key`` maps f32 to u32 with the f32 order (-0 == +0, NaN lowest, never 0), so
the Triton top-k and the group maxima the logits kernel writes compare scores
exactly as the reference's ``order_key`` does.
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
