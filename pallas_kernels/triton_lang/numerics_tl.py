"""Triton-language port of ``pallas_kernels.core.numerics``: the same float operations
in the same order, so the Triton kernels write the bytes of the XLA reference.

Every function takes tiles of shape [M, 128] (M a power of two; a single row is
[1, 128]) and is a ``@triton.jit`` helper inlined into the kernels. What makes
the bits match across backends (see numerics.py and docs/design.md):

* every product that reaches an add in ``exp_f32``, ``recip_f32`` and ``mac_bf16``
  passes through ``rounded`` (an unsigned min of its bits with a NaN pattern: the
  value is unchanged, but the multiply must round on its own), so an FMA cannot
  form; the other products that reach an add are exact (k * ln2/64 parts). ``mac``
  (c + a*b from four exact 12 x 12-bit partial products, the split from the bits,
  ``split12``, since Triton contracted the old ``lo = a - hi`` with the product
  that made ``a``: 21 of 65,536 pools off on the H200) mirrors ``numerics.mac``.
  On top of that the launches turn Triton's FMA contraction off
  (``_call.Launch.fp_fusion``), like the Pallas path; the GPU tests check both
  settings against the golden model.
* no Triton ``exp``, ``exp2``, ``log2`` or f32 division: ``exp_f32`` (reduction by
  ln2/64, the 64-entry table ``numerics.EXP_TABLE`` read from memory, a cubic with
  rounded products, exponent bits) and ``recip_f32`` (bit seed + 4 Newton steps)
  are built from add, mul, floor, loads and integer bit operations;
* bf16 rounding and the power-of-two scale are integer bit operations, bf16 -> f32
  is a 16-bit shift of the bits, and the e4m3 code is the fp8 conversion of values
  already clipped to +-448 (round to nearest even, like XLA's);
* the Hadamard transform pairs (a + b, a - b) per stage in constant-geometry order
  (the same adds as ``numerics.hadamard128``'s in-place stages); each output is
  canonicalised with ``+ 0.0`` (Triton does not fold it), so no -0 appears, like the
  reference, which turns -0 inputs into +0 before its first stage;
* min/max clamps propagate NaN like ``jnp.clip`` / ``jnp.maximum``;
* the non-finite rule (``numerics.rotate_quant``): a row whose inputs or rotated
  values are not all finite is all-zero codes with scale 2**-22, decided from the
  exponent bits (``abs_bits``, integer ops), never from NaN arithmetic.

Constants are the float32 values the reference uses (its Python floats rounded
to f32 once, here, with numpy), so Triton never has to round a literal.
"""
from __future__ import annotations

import numpy as np
import triton
import triton.language as tl

from ..core import numerics as nm


def _f32c(v) -> tl.constexpr:
    """A float32-exact Python float as a Triton constexpr."""
    return tl.constexpr(float(np.float32(v)))


EXP_SCALE = _f32c(nm.EXP_SCALE)
EXP_L1 = _f32c(nm.EXP_L1)
EXP_L2 = _f32c(nm.EXP_L2)
EXP_L3 = _f32c(nm.EXP_L3)
EXP_C6 = _f32c(nm.EXP_C6)
EXP_TABLE_BITS = tl.constexpr(nm.EXP_TABLE_BITS)
EXP_TABLE_MASK = tl.constexpr(nm.EXP_TABLE_SIZE - 1)
INV_SQRT_128 = _f32c(nm.INV_SQRT_128)
FP8_MAX = _f32c(nm.FP8_MAX)
AMAX_FLOOR = _f32c(nm.AMAX_FLOOR)
INV_FP8_MAX = _f32c(1.0 / nm.FP8_MAX)
EXP_LO = _f32c(-87.0)
EXP_HI = _f32c(88.0)
NAN_ALL = tl.constexpr(tl.PropagateNan.ALL)
ROUNDED_MAX_BITS = tl.constexpr(0xFFFFFFFE)          # numerics.rounded: min(bits, this) keeps every non-NaN value
F32_FINITE_MAX_BITS = tl.constexpr(nm.F32_FINITE_MAX_BITS)
F32_INF_BITS = tl.constexpr(nm.F32_INF_BITS)


# ---- bit views ----------------------------------------------------------------
@triton.jit
def as_u32(x):
    return x.to(tl.uint32, bitcast=True)


@triton.jit
def as_f32(u):
    return u.to(tl.float32, bitcast=True)


@triton.jit
def abs_bits(x):
    """numerics.abs_bits: the bits of |x| as int32 (> F32_FINITE_MAX_BITS iff inf / NaN)."""
    return (as_u32(x) & 0x7FFFFFFF).to(tl.int32, bitcast=True)


@triton.jit
def bf16_to_f32(x):
    """Exact bf16 -> f32 of a bf16 tile (the bits shifted into the high half)."""
    return as_f32(x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)


# ---- exact-product multiply-add, exp, reciprocal ---------------------------------
@triton.jit
def split12(a):
    """numerics._split12: a = hi + lo exactly from a's bits (never ``a - hi``, which
    Triton's FMA contraction computes from the unrounded product)."""
    u = as_u32(a)
    hi = as_f32(u & 0xFFFFF000)
    lo = as_f32(u & 0xFF800FFF) - as_f32(u & 0xFF800000)
    return hi, lo


@triton.jit
def mac(c, a, b):
    """c + a*b from four exact partial products (numerics.mac)."""
    ah, al = split12(a)
    bh, bl = split12(b)
    return ((c + ah * bh) + (ah * bl + al * bh)) + al * bl


@triton.jit
def rounded(p):
    """numerics.rounded: p unchanged, but rounded on its own before the add it feeds."""
    return as_f32(tl.minimum(as_u32(p), ROUNDED_MAX_BITS))


@triton.jit
def mac_bf16(c, k, e):
    """numerics.mac_bf16: c + (k*e rounded)."""
    return c + rounded(k * e)


@triton.jit
def exp_f32(d, tab_ptr):
    """numerics.exp_f32: e**d, clamped to [-87, 88]; tab_ptr -> numerics.EXP_TABLE [64] f32."""
    d = tl.minimum(tl.maximum(d, EXP_LO, propagate_nan=NAN_ALL), EXP_HI, propagate_nan=NAN_ALL)
    kf = tl.floor(d * EXP_SCALE)
    r = ((d - kf * EXP_L1) - kf * EXP_L2) - kf * EXP_L3
    k = kf.to(tl.int32)
    t = tl.load(tab_ptr + (k & EXP_TABLE_MASK))
    q = r * (1.0 + rounded(r * (0.5 + rounded(r * EXP_C6))))
    e = t + rounded(t * q)
    two_n = as_f32((((k >> EXP_TABLE_BITS) + 127) << 23).to(tl.uint32))
    return e * two_n


@triton.jit
def recip_f32(b):
    """numerics.recip_f32: 1 / b for positive normal b (bit seed + 4 Newton steps)."""
    y = as_f32(0x7EF311C3 - as_u32(b))
    y = y * (2.0 - rounded(b * y))
    y = y * (2.0 - rounded(b * y))
    y = y * (2.0 - rounded(b * y))
    y = y * (2.0 - rounded(b * y))
    return y


# ---- rounding and quantisation --------------------------------------------------
@triton.jit
def round_bf16(x):
    """numerics.round_bf16: f32 -> nearest bf16 (ties to even) -> f32, integer ops."""
    u = as_u32(x)
    u = (u + (0x7FFF + ((u >> 16) & 1))) & 0xFFFF0000
    return as_f32(u)


@triton.jit
def e4m3_code(v):
    """numerics.e4m3_bits as uint32 codes 0..255 of f32 v with |v| <= 448: the fp8
    conversion (cvt.rn.satfinite on sm_90, round to nearest even), as in the Pallas
    kernels: the same bits as building the code from integer bit operations for
    |v| <= 448."""
    return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.uint32)


@triton.jit
def pow2_scale(amax):
    """numerics.pow2_scale: (2**ceil(log2(max(amax, 1e-4) / 448)), its inverse), exact."""
    v = tl.maximum(amax, AMAX_FLOOR, propagate_nan=NAN_ALL) * INV_FP8_MAX
    u = v.to(tl.int32, bitcast=True)
    e = ((u >> 23) & 0xFF) + ((u & 0x7FFFFF) != 0).to(tl.int32)
    scale = (e << 23).to(tl.float32, bitcast=True)
    inv_scale = ((254 - e) << 23).to(tl.float32, bitcast=True)
    return scale, inv_scale


@triton.jit
def hadamard128(x, M: tl.constexpr):
    """numerics.hadamard128 of x [M, 128] f32: 7 stages, each pairing the elements
    that differ in the lowest index bit into (a + b, a - b), new bit on top."""
    for _ in tl.static_range(7):
        a, b = tl.split(tl.reshape(x, [M, 64, 2]))                   # [M, 64] each
        y = tl.join((a + b) + 0.0, (a - b) + 0.0)                    # [M, 64, 2]
        x = tl.reshape(tl.permute(y, (0, 2, 1)), [M, 128])           # [M, 2, 64] -> [M, 128]
    return x


@triton.jit
def rotate_quant_words(x, flag, M: tl.constexpr):
    """numerics.rotate_quant of bf16-rounded f32 x [M, 128], packed for the cache.
    flag [M, 128] int32: abs_bits of the pool's inputs, max-combined (the non-finite rule).

    Returns (words [M, 32] uint32: fp8 byte 4w+i at bits 8i, scale [M] f32).
    """
    y0 = hadamard128(x, M) * INV_SQRT_128                             # [M, 128]
    y = round_bf16(y0)
    flag = tl.maximum(flag, abs_bits(y0))
    bits = tl.where(flag > F32_FINITE_MAX_BITS, F32_INF_BITS, abs_bits(y))
    amax_bits = tl.max(bits, axis=1)                                  # [M]: max |y| of a finite row
    finite = amax_bits <= F32_FINITE_MAX_BITS
    amax = tl.where(finite, amax_bits, 0).to(tl.float32, bitcast=True)
    scale, inv_scale = pow2_scale(amax)
    q = tl.where(finite[:, None], y * inv_scale[:, None], 0.0)
    q = tl.minimum(tl.maximum(q, -FP8_MAX, propagate_nan=NAN_ALL), FP8_MAX, propagate_nan=NAN_ALL)
    codes = tl.reshape(e4m3_code(q), [M, 32, 4])                      # [M, 32, 4] u32
    shift = (tl.arange(0, 4) * 8).to(tl.uint32)                       # [4]
    words = tl.sum(codes << shift[None, None, :], axis=2)             # disjoint bits: sum == or
    return words.to(tl.uint32), scale


@triton.jit
def pool_finish(acc, den):
    """x = bf16_round(acc / den) of the gated softmax, as numerics.compress_pool."""
    return round_bf16(acc * recip_f32(den))


# ---- ring words -> values ---------------------------------------------------------
# (The other direction needs no code: a bf16 row read as 64 little-endian uint32
# words IS numerics.pack_bf16_words of it, so the kernels copy words.)
@triton.jit
def unpack_words_f32(w, M: tl.constexpr):
    """[M, 64] uint32 ring words -> the [M, 128] bf16 values as exact f32 (element 2w low)."""
    lo = as_f32(w << 16)
    hi = as_f32(w & 0xFFFF0000)
    return tl.reshape(tl.join(lo, hi), [M, 128])
