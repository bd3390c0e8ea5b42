"""Shared numerics of the kpool indexer (docs/semantics.md 2), used verbatim by the
Pallas kernel bodies and by the XLA reference so both perform the same float
operations in the same order.

Everything works on jnp arrays with a trailing dimension of 128 and any leading
shape, inside and outside Pallas kernels. Only ops that the Pallas Triton
lowering supports are used: reshape, broadcast, elementwise, reductions, iota,
same-width bitcasts, integer shifts, the f32 -> float8_e4m3fn conversion, and
transposes with size-2 ``lax.unstack`` / ``lax.stack`` on the last axis.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

HEAD_DIM = 128
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
INV_SQRT_128 = 0.08838834764831845      # fp32 bits 0x3DB504F3
FP8 = jnp.float8_e4m3fn


def _iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def positive_zero(x):
    """x with -0 made +0 (an integer select, which no compiler folds away as it may fold
    ``x + 0.0``); every other value keeps its bits. Compiled kernels pass
    ``_backend.plus_zero_rn`` (one ``add.rn.f32 x, 0``) in its place: the same bits."""
    u = _u32(x)
    return _f32(jnp.where(u == np.uint32(0x80000000), np.uint32(0), u))


def hadamard128(x, zero_plus=None):
    """Unnormalised Walsh-Hadamard transform over the last axis (size 128), f32.

    The in-place butterfly of docs/semantics.md 2.1: the stage with stride s = 1, 2, ..., 64 pairs
    elements i and i + s (bit s of i clear) and writes a + b at i and a - b at i + s.
    Each stage views the values as [..., G, 2, s], moves the pair axis last, takes
    the pair apart (``lax.unstack``: a Triton split) and puts (a + b, a - b) back in
    place (``lax.stack``: a join), so the bits are the butterfly's: one fp32 add or
    subtract of the same operands per output.

    -0 inputs become +0 first (``zero_plus``, default ``positive_zero``). After that no
    stage can make a -0 (a + b and a - b are -0 only for -0 operands), so XLA and Triton
    agree on signed zeros, and the bits equal those of a constant-geometry form that sums
    each pair with an XLA reduction starting from +0 (tests/numerics_forms.py; every
    normal input and signed zero, not subnormals on XLA's CPU backend, which flushes them
    to zero with their sign). The in-place form is 7-8 % faster than that one in the
    compression kernel and 4 % in the decode update on the H200 (docs/benchmarks.md).
    """
    lead = x.shape[:-1]
    x = (positive_zero if zero_plus is None else zero_plus)(x)              # -0 -> +0
    s = 1
    while s < HEAD_DIM:
        v = jnp.swapaxes(x.reshape(lead + (HEAD_DIM // (2 * s), 2, s)), -1, -2)   # [..., G, s, 2]
        a, b = lax.unstack(v, axis=-1)                                          # [..., G, s] each
        y = lax.stack([a + b, a - b], axis=-1)                                  # [..., G, s, 2]
        x = jnp.swapaxes(y, -1, -2).reshape(lead + (HEAD_DIM,))                 # back in place
        s *= 2
    return x


# Every inexact float operation below is built from IEEE add/sub/mul, floor,
# integer bit operations and the round-to-nearest-even fp8 conversion of values
# already clipped to +-448, so XLA (CPU, GPU) and Triton produce the same bits.
# XLA's own exp differs by context even on one backend, XLA may drop a
# f32->bf16->f32 round trip (xla_allow_excess_precision), and Triton's f32
# division is approximate; none of those are used.
LOG2E = 1.4426950408889634


def _short(v, bits=16):
    """v rounded down to `bits` significant bits (so products with small ints are exact)."""
    u = np.float32(v).view(np.uint32)
    return float((u & np.uint32((0xFFFFFFFF << (24 - bits)) & 0xFFFFFFFF)).view(np.float32))


def _f32(bits):
    return lax.bitcast_convert_type(bits, jnp.float32)


def _u32(x):
    return lax.bitcast_convert_type(x, jnp.uint32)


def _split12(a):
    """a = hi + lo exactly, each with at most 12 significant bits, from a's bits only.

    lo is (a with its top 11 mantissa bits cleared) - (a's sign and exponent): a
    difference of two values made by bitcasts, never ``a - hi``. When `a` is a
    product (the Newton steps of ``recip_f32``), a compiler that contracts
    multiply-adds turns ``a - hi`` into fma(x, y, -hi), which subtracts hi from
    the UNROUNDED product: Triton does (jax_triton's default enable_fp_fusion),
    and it changed 21 of 65,536 pools by one fp8 step on the H200. A bitcast
    needs the rounded f32, so this form is exact under any contraction. Same
    bits as ``a - hi`` wherever no contraction happens (both are exact).
    """
    u = _u32(a)
    hi = _f32(u & np.uint32(0xFFFFF000))
    lo = _f32(u & np.uint32(0xFF800FFF)) - _f32(u & np.uint32(0xFF800000))
    return hi, lo


def rounded(p):
    """p, unchanged, as a rounded f32 that no compiler can fuse into the add it feeds.

    An unsigned min of p's bits with 0xFFFFFFFE: the one pattern it changes is a NaN
    (sign set, all exponent and mantissa bits set) that no arithmetic here produces, so
    no compiler can prove it a no-op and drop it, and an integer op sits between the
    multiply and the add: the multiply must round on its own. ``c + rounded(a * b)`` is
    the separately rounded multiply and add on every backend, whatever it contracts
    (XLA on CPU and GPU by fusion context, Triton and NVPTX by default). One integer
    instruction, against the four partial products of ``mac``. Used by ``exp_f32``,
    ``recip_f32`` and ``mac_bf16``.
    """
    return _f32(jnp.minimum(_u32(p), np.uint32(0xFFFFFFFE)))


def mul_rounded(a, b):
    """a * b rounded to f32 on its own, whatever the compiler contracts: ``rounded(a * b)``.

    Every numerics function below that feeds a product into an add takes its multiply as
    ``mul`` (default: this). The Pallas kernels compiled for a GPU pass
    ``_backend.mul_rn``, one ``mul.rn.f32`` instruction (PTX never contracts a multiply
    with an explicit rounding mode, and LLVM cannot look into inline assembly), which
    saves ``rounded``'s integer min. Both are the correctly rounded IEEE product, so they
    give the same bits for every product that is not a NaN.
    """
    return rounded(a * b)


def mac(c, a, b):
    """c + a*b from four exact partial products (12 x 12 bits each).

    A compiler may fuse any of these multiply-adds into an FMA (XLA does so
    depending on fusion context, NVPTX and Triton by default): with exact
    products an FMA and a multiply-then-add round identically, so the result is
    the same on every backend and in every context.
    """
    ah, al = _split12(a)
    bh, bl = _split12(b)
    return ((c + ah * bh) + (ah * bl + al * bh)) + al * bl


# ---- exp: a 64-entry table of 2**(j/64) and a short polynomial ------------------
EXP_TABLE_BITS = 6
EXP_TABLE_SIZE = 1 << EXP_TABLE_BITS                     # 64
EXP_TABLE = np.exp2(np.arange(EXP_TABLE_SIZE) / EXP_TABLE_SIZE).astype(np.float32)   # [64] f32, RN
EXP_SCALE = float(np.float32(EXP_TABLE_SIZE * LOG2E))   # 92.33...: d * this = d / (ln 2 / 64)
# ln2/64 in three 11-bit parts: |k| < 2**13, so every k * part is exact (<= 24 bits)
_EXP_L = math.log(2) / EXP_TABLE_SIZE
EXP_L1 = _short(_EXP_L, 11)
EXP_L2 = _short(_EXP_L - EXP_L1, 11)
EXP_L3 = _short(_EXP_L - EXP_L1 - EXP_L2, 11)
EXP_C6 = _short(1.0 / 6.0, 12)                          # 1/6 to 12 bits (r**3 term only)


def exp_table_lookup(j):
    """EXP_TABLE[j] for int32 j in [0, 64), as an XLA gather of a constant.

    Kernel bodies cannot close over arrays: they pass the table in as an input and
    give ``exp_f32`` a lookup that gathers from it (same values, same bits)."""
    return jnp.take(jnp.asarray(EXP_TABLE), j, mode="clip")


def exp_table_input():
    """EXP_TABLE as the [1, 64] f32 kernel input that ``_backend.table_lookup`` reads."""
    return jnp.asarray(EXP_TABLE).reshape(1, EXP_TABLE_SIZE)


def ape_with_exp_table(ape):
    """ape [R, 128] -> [R * 128 + 64] f32: the ape rows, then EXP_TABLE (how the
    Triton-language kernels get the table: one pointer, at ape_ptr + R * 128)."""
    return jnp.concatenate([ape.astype(jnp.float32).reshape(-1), jnp.asarray(EXP_TABLE)])


EXP_MAGIC = 12582912.0                                    # 1.5 * 2**23: kf + this is exact, its bits 0x4B400000 + kf
EXP_MAGIC_BITS = 0x4B400000
assert np.float32(EXP_MAGIC).view(np.uint32) == EXP_MAGIC_BITS and EXP_MAGIC_BITS % EXP_TABLE_SIZE == 0


def exp_f32(d, lookup=None, mul=None):
    """e**d for f32 d (clamped to [-87, 88]); about 1 ulp, identical bits on every backend.

    d = k ln2/64 + r with k = floor(d * 64 log2 e) and r in [0, ln2/64) from a
    three-part ln2/64 (exact products with k); e**d = 2**(k >> 6) * T[k & 63] * e**r
    with T = EXP_TABLE (``lookup`` gives T[j]; default: an XLA gather of the
    constant). e**r = 1 + q with q = r (1 + r (1/2 + r/6)) (Horner; r**4/24 < 2**-30)
    and T e**r = T + T q. Every product that meets an add goes through ``mul``
    (``mul_rounded``), so the multiply rounds on its own whatever the compiler contracts.
    The maximum error is 1.10 ulp; test_numerics holds it within 1 ulp of the correctly
    rounded e**d.
    """
    return _exp_clamped(jnp.clip(d, -87.0, 88.0), lookup, mul)


def exp_nonpositive_f32(d, lookup=None, mul=None):
    """``exp_f32`` for d <= 0 (the pooling's d = s - max s), with its bits: the clamp
    is the lower bound alone (d > 88 cannot occur), and the power of two is applied to
    the bits (below). Domain: d <= 0 and not NaN (the pooling's d is finite for finite
    gates); a NaN d gives an unspecified value.

    2**(k >> 6) by the bits: for d in [-87, 0], k >> 6 is in [-126, 0], and e = T (1 + q)
    is in [1, 2] wherever k >> 6 = -126 (there k >= -8033, so T[k & 63] >= 2**(31/64));
    elsewhere e > 1 - 2**-23. So e * 2**(k >> 6) is a normal number, the multiply is
    exact, and its bits are e's plus (k >> 6) << 23 = (kb << 17) & 0xFF800000 (mod
    2**32: 0x4B400000 << 17 wraps to 0). One integer add instead of building 2**(k >> 6)
    and multiplying (``exp_f32`` keeps the multiply, whose overflow and underflow past
    this range it needs)."""
    return _exp_clamped(jnp.maximum(d, -87.0), lookup, mul, scale_by_bits=True)


def _exp_clamped(d, lookup=None, mul=None, scale_by_bits=False):
    """``exp_f32`` of d already in [-87, 88].

    k is read from the bits of kf + 1.5 * 2**23 (exact: |kf| <= 8125 < 2**22, and no
    product feeds the add), 0x4B400000 + k, instead of a float-to-int conversion: the
    conversion clamps to the int32 range first (two more instructions on the H200) and
    runs on the slow conversion pipe. T's index is those bits & 63 (0x4B400000 is a
    multiple of 64) and 2**(k >> 6) comes from their top bits. Same bits as the
    ``kf.astype(int32)`` form (``exp_f32_by_conversion`` in tests/numerics_forms.py).
    """
    lookup = exp_table_lookup if lookup is None else lookup
    mul = mul_rounded if mul is None else mul
    kf = jnp.floor(d * EXP_SCALE)                          # |k| <= 8125
    r = ((d - kf * EXP_L1) - kf * EXP_L2) - kf * EXP_L3    # [-tiny, ln2/64): exact products
    kb = _u32(kf + EXP_MAGIC)                              # 0x4B400000 + k
    t = lookup((kb & np.uint32(EXP_TABLE_SIZE - 1)).astype(jnp.int32))   # T[k & 63] in [1, 2)
    q = r * (1.0 + mul(r, 0.5 + mul(r, EXP_C6)))          # e**r - 1
    e = t + mul(t, q)                                      # T (1 + q)
    if scale_by_bits:                                      # d in [-87, 0]: exp_nonpositive_f32
        return _f32(_u32(e) + ((kb << np.uint32(17)) & np.uint32(0xFF800000)))
    # 2**(k >> 6): (k >> 6) + 127 = (kb >> 6) - (0x4B400000 >> 6) + 127, mod 2**9 after the shift
    two_n = _f32(((kb >> EXP_TABLE_BITS) + np.uint32((127 - (EXP_MAGIC_BITS >> EXP_TABLE_BITS)) & 0xFFFFFFFF))
                 << np.uint32(23))
    return e * two_n


def recip_f32(b, mul=None):
    """1 / b for positive normal f32 b: bit-trick seed + 4 Newton steps y (2 - b y),
    the product b y rounded on its own (``mul``: ``mul_rounded``); at most 1.5 ulp (2.0
    with exact four-product steps instead, ``recip_f32_newton_mac`` in
    tests/numerics_forms.py)."""
    mul = mul_rounded if mul is None else mul
    y = _f32(np.uint32(0x7EF311C3) - _u32(b))
    for _ in range(4):
        y = y * (2.0 - mul(b, y))
    return y


def round_bf16(x):
    """Round f32 to the nearest bf16 (ties to even) and back to f32, with integer ops."""
    u = _u32(x)
    u = (u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) & np.uint32(0xFFFF0000)
    return _f32(u.astype(jnp.uint32))


def e4m3_bits(v):
    """float8_e4m3fn bit pattern (uint8) of f32 v with |v| <= 448 (callers clip first),
    round to nearest even: the dtype conversion, which rounds that way in XLA (CPU and
    GPU) and in Pallas's Triton (the hardware's cvt.rn.satfinite), with the same bits as
    ml_dtypes (test_numerics). Building the code from integer bit operations gives the
    same bits; the conversion makes the compression kernel 4-5 % faster on the H200
    (docs/benchmarks.md)."""
    return lax.bitcast_convert_type(v.astype(FP8), jnp.uint8)


def pow2_scale(amax):
    """Exact 2**ceil(log2(max(amax, 1e-4) / 448)) from the exponent bits (f32).

    Never exp2/log2: XLA's exp2 is not exact at integers on GPU.
    Returns (scale, inv_scale); both are exact powers of two.
    """
    v = jnp.maximum(amax, AMAX_FLOOR) * (1.0 / FP8_MAX)
    u = lax.bitcast_convert_type(v, jnp.int32)
    e = ((u >> 23) & 0xFF) + ((u & 0x7FFFFF) != 0).astype(jnp.int32)   # biased exponent of 2**ceil
    scale = lax.bitcast_convert_type(e << 23, jnp.float32)
    inv_scale = lax.bitcast_convert_type((254 - e) << 23, jnp.float32)
    return scale, inv_scale


def quant_fp8(y, saturates=False):
    """Per-row power-of-two scaled e4m3 quantisation of f32 y[..., 128].

    Returns (q8 [..., 128] float8_e4m3fn, scale [...] f32). Clips to +-448 before
    the cast so Triton (saturating) and XLA (NaN on overflow) agree. ``saturates``: the
    caller's conversion saturates at +-448 itself (the compiled kernels' cvt.rn.satfinite,
    ``_backend.kernel_numerics``), so the clip is left out: the same bytes for every
    non-NaN y. No finite value scales past +-448 (test_numerics checks every amax of a
    binade; the clip is for rows holding an infinity, which scale to +-inf, and both ways
    give +-448 there). The cache and query rows go through ``rotate_quant``, which
    applies the non-finite rule first.
    """
    return _quant_rows(y, jnp.max(jnp.abs(y), axis=-1), saturates)


def _quant_rows(y, amax, saturates, finite=None):
    """quant_fp8 of y [..., 128] with its rows' amax [...] given; rows where `finite` is
    False become all-zero codes (their amax must be 0: the floor scale)."""
    scale, inv_scale = pow2_scale(amax)
    q = y * inv_scale[..., None]
    if finite is not None:
        q = jnp.where(finite[..., None], q, 0.0)
    if not saturates:
        q = jnp.clip(q, -FP8_MAX, FP8_MAX)
    return lax.bitcast_convert_type(e4m3_bits(q), FP8), scale


# ---- the non-finite rule ------------------------------------------------------------
# A pool or query row whose values are not all finite has no finite key to store, and
# NaN arithmetic differs between backends and fusion contexts (which NaN a max returns,
# what the integer bf16 rounding makes of a NaN pattern), so such rows get ONE answer:
# all-zero fp8 codes with the floor scale 2**-22 (the bytes of an all-zero row). A row
# is non-finite when any of its inputs (a pool's keys and scores gate + ape) or any
# value of its rotation is +-inf or NaN: finite but huge inputs whose rotation
# overflows are non-finite too. The test reads only
# exponent bits (integer ops), which every backend computes alike, so the bytes of a
# row do not depend on the backend or on what else is in the batch.
F32_FINITE_MAX_BITS = 0x7F7FFFFF         # bits of the largest finite |f32|
F32_INF_BITS = 0x7F800000


def abs_bits(x):
    """The bits of |x| (f32) as int32: ordered like |x| for non-NaN x, and above
    F32_FINITE_MAX_BITS exactly when x is +-inf or NaN."""
    return lax.bitcast_convert_type(_u32(x) & np.uint32(0x7FFFFFFF), jnp.int32)


def rotate_quant(x, bf16_round=None, zero_plus=None, fp8_saturates=False, flag_bits=None):
    """bf16-rounded f32 x[..., 128] -> Hadamard/sqrt(128) -> bf16 round -> fp8 + scale.
    The keywords are ``compress_pool``'s (kernel forms of the same operations).

    The non-finite rule (above): a row with a non-finite rotated value, or with
    flag_bits [..., 128] int32 (``abs_bits`` of its inputs, max-combined) above
    F32_FINITE_MAX_BITS anywhere, is all-zero codes with scale 2**-22. The row's amax
    is the integer max of ``abs_bits``, the same value as the f32 max of |y| for a
    finite row, so finite rows keep their bytes."""
    y0 = hadamard128(x, zero_plus) * INV_SQRT_128
    y = (round_bf16 if bf16_round is None else bf16_round)(y0)
    flag = abs_bits(y0) if flag_bits is None else jnp.maximum(flag_bits, abs_bits(y0))
    bits = jnp.where(flag > F32_FINITE_MAX_BITS, F32_INF_BITS, abs_bits(y))
    amax_bits = jnp.max(bits, axis=-1)
    finite = amax_bits <= F32_FINITE_MAX_BITS
    amax = lax.bitcast_convert_type(jnp.where(finite, amax_bits, 0), jnp.float32)
    return _quant_rows(y, amax, fp8_saturates, finite)


def mac_bf16(c, k, e, mul=None):
    """c + k*e for the pooled sum (k a bf16-valued key, e an exp weight): the product
    rounded on its own (``mul``: ``mul_rounded``), then the add. (Two exact partial
    products from 12-bit halves of e would give other bits for one more instruction.)"""
    return c + (mul_rounded if mul is None else mul)(k, e)


def softmax_weights(s, exp):
    """The pooling's weights e_j = exp(s_j - max s) (docs/semantics.md 2.2) for the R scores s (arrays of
    one shape): the max taken left to right, then one ``exp`` per score. The reference's form."""
    m = s[0]
    for j in range(1, len(s)):
        m = jnp.maximum(m, s[j])
    return [exp(sj - m) for sj in s]


def softmax_weights_knockout(s, exp):
    """``softmax_weights`` with one exp fewer at R = 4 (kpool 4; any other R: that form), the
    same bits wherever the scores are finite. The decode update's form at one token per
    request (``decode_update._knockout_weights``).

    A knockout of the four scores: s0 meets s1 and s2 meets s3, then the two winners meet.
    The final's winner is the max m, and its weight is exp(m - m) = exp(0), exactly 1 (the
    exp gives 1 for d = +0 and -0 alike). Every other score loses exactly one match, and
    its weight is the exp of the loser's score minus m: three exps, for the losers of the
    three matches, and six selects put each weight back in its score's place. Same values
    as the left-to-right max (a max of finite values has one value whatever the order; a
    -0 or +0 winner only changes the sign of a zero d, and the exp is 1 for both), so the
    same bits; ties give each tied score the same weight either way. A NaN or an infinite
    score is outside the exp's domain in both forms (unspecified weights).
    """
    if len(s) != 4:
        return softmax_weights(s, exp)
    c01, c23 = s[0] >= s[1], s[2] >= s[3]                 # s0 wins its match, s2 wins its
    w01, w23 = jnp.maximum(s[0], s[1]), jnp.maximum(s[2], s[3])
    cm = w01 >= w23                                         # the 0-1 winner wins the final
    m = jnp.maximum(w01, w23)
    e01 = exp(jnp.minimum(s[0], s[1]) - m)                  # the three losers' weights
    e23 = exp(jnp.minimum(s[2], s[3]) - m)
    efin = exp(jnp.minimum(w01, w23) - m)
    x01 = jnp.where(cm, 1.0, efin)                          # weight of the 0-1 match's winner
    x23 = jnp.where(cm, efin, 1.0)
    return [jnp.where(c01, x01, e01), jnp.where(c01, e01, x01),
            jnp.where(c23, x23, e23), jnp.where(c23, e23, x23)]


def compress_pool(keys, gates, ape_rows, exp_lookup=None, mul=None, bf16_round=None, zero_plus=None,
                  fp8_saturates=False, weights=None):
    """Softmax-gated pooling of one pool (docs/semantics.md 2.2), then rotation + fp8.

    keys, gates: sequences of R arrays [..., 128] bf16 (slot j = pos % R order).
    ape_rows: sequence of R arrays [128] (or broadcastable) f32.
    exp_lookup: the EXP_TABLE lookup of ``exp_f32`` (kernels pass a gather from
    their table input; default: an XLA gather of the constant).
    mul: the separately rounded multiply of every product that meets an add
    (default ``mul_rounded``; compiled kernels pass ``_backend.mul_rn`` through
    ``_backend.kernel_numerics``: the same bits).
    bf16_round, zero_plus, fp8_saturates: the kernels' forms of ``round_bf16``, of the
    Hadamard's -0 -> +0 (``positive_zero``) and of the clip before the fp8 conversion
    (``quant_fp8``); compiled kernels pass one PTX instruction each for the first two
    and leave the clip to the saturating conversion (the same bytes).
    weights: the softmax weights' form (default ``softmax_weights``; the decode update
    passes ``softmax_weights_knockout`` at one token per request: one exp fewer, the same
    bits for finite scores).
    Two-pass softmax with explicit left-to-right sums, so every backend adds in the
    same order. Returns (q8 [..., 128] e4m3fn, scale [...] f32). A pool with a non-finite
    key or score (gate + ape), or whose rotation is not finite, is all-zero codes with
    scale 2**-22 (the non-finite rule, ``rotate_quant``): the softmax of such scores and
    the NaN arithmetic after it differ between backends.

    The pooled sum starts from the first product k_0 e_0, not from 0 + k_0 e_0. The two
    differ only in the sign of a zero sum (all products +-0, the first -0: -0 here, +0
    from 0), and x = -0 and +0 give the same bytes, as ``hadamard128`` maps -0 to +0
    first (test_numerics checks such pools against ``compress_pool_sum_from_zero`` in
    tests/numerics_forms.py).
    """
    r = len(keys)
    s = [gates[j].astype(jnp.float32) + ape_rows[j] for j in range(r)]
    k = [keys[j].astype(jnp.float32) for j in range(r)]
    flag = abs_bits(s[0])                                  # the non-finite rule's inputs (rotate_quant)
    for v in s[1:] + k:
        flag = jnp.maximum(flag, abs_bits(v))
    mul = mul_rounded if mul is None else mul
    e = (softmax_weights if weights is None else weights)(s, lambda d: exp_nonpositive_f32(d, exp_lookup, mul))
    den = e[0]
    acc = mul(k[0], e[0])                                  # no 0 + (see above)
    for j in range(1, r):
        den = den + e[j]
        acc = mac_bf16(acc, k[j], e[j], mul)
    x = (round_bf16 if bf16_round is None else bf16_round)(acc * recip_f32(den, mul))
    return rotate_quant(x, bf16_round, zero_plus, fp8_saturates, flag)


def fwht_quant_rows(q):
    """Query side (docs/semantics.md 2.3): q[..., 128] bf16 -> (q8 e4m3fn, scale f32). A row holding
    +-inf or NaN, or whose rotation overflows, is all-zero codes with scale 2**-22
    (the non-finite rule, ``rotate_quant``)."""
    return rotate_quant(q.astype(jnp.float32))


# ---- byte packing into 32-bit little-endian words -------------------------------
def pack_fp8_words(q8, keep_parts=False):
    """[..., 128] float8_e4m3fn -> [..., 32] uint32 (byte 4w+i at bits 8i).

    keep_parts: [..., 32, 4] instead, each word repeated along the axis of its 4 bytes:
    the packing sum broadcast back to its operands' shape (in a kernel, their layout), so
    a store of the lanes at byte 0 needs no move into a [..., 32] layout."""
    lead = q8.shape[:-1]
    b = lax.bitcast_convert_type(q8, jnp.uint8).astype(jnp.uint32).reshape(lead + (32, 4))
    shift = (_iota(lead + (32, 4), len(lead) + 1) * 8).astype(jnp.uint32)
    return _words(jnp.sum(b << shift, axis=-1).astype(jnp.uint32), keep_parts, 4)


def pack_bf16_words(x, keep_parts=False):
    """[..., 128] bfloat16 -> [..., 64] uint32 (element 2w in the low half); keep_parts:
    [..., 64, 2], each word repeated along the axis of its two halves (``pack_fp8_words``)."""
    lead = x.shape[:-1]
    h = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32).reshape(lead + (64, 2))
    shift = (_iota(lead + (64, 2), len(lead) + 1) * 16).astype(jnp.uint32)
    return _words(jnp.sum(h << shift, axis=-1).astype(jnp.uint32), keep_parts, 2)


def _words(w, keep_parts, parts):
    """The packed words w [..., words], or with keep_parts each repeated over `parts`."""
    return jnp.broadcast_to(w[..., None], w.shape + (parts,)) if keep_parts else w


def unpack_bf16_words(w):
    """[..., 64] uint32 -> [..., 128] bfloat16 (inverse of pack_bf16_words)."""
    lead = w.shape[:-1]
    shift = (_iota(lead + (64, 2), len(lead) + 1) * 16).astype(jnp.uint32)
    h = ((w[..., None] >> shift) & 0xFFFF).astype(jnp.uint16).reshape(lead + (HEAD_DIM,))
    return lax.bitcast_convert_type(h, jnp.bfloat16)


def f32_word(x):
    """f32 -> its uint32 bit pattern."""
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
