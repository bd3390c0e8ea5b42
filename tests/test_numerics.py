"""pallas_kernels.core.numerics (docs/semantics.md 2): Hadamard-128, exact power-of-two
scales, fp8/bf16 rounding with integer ops, the context-independent exp and
reciprocal, and the exact-product multiply-add. Compared against float64 /
ml_dtypes / a literal numpy butterfly, bit for bit where the semantics promise bits."""
import math
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from numerics_forms import (compress_pool_sum_from_zero, exp_f32_by_conversion, exp_f32_taylor9,
                            hadamard128_constant_geometry, recip_f32_newton_mac)
from pallas_kernels.core import numerics as nm

F32 = np.float32


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def _ulp_diff(a, b):
    """|a - b| in units of float32 ordering (a, b float32 arrays of the same sign class)."""
    ia = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    ib = np.asarray(b, np.float32).view(np.int32).astype(np.int64)
    ia = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return np.abs(ia - ib)


def _random_f32(rng, n, lo=-30, hi=30):
    """Signed values spread over many binades."""
    return (rng.choice([-1.0, 1.0], n) * np.exp2(rng.uniform(lo, hi, n)) *
            rng.uniform(1, 2, n)).astype(F32)


# ---------------------------------------------------------------------------------
# Hadamard-128
# ---------------------------------------------------------------------------------
def _hadamard_matrix64():
    i = np.arange(128)
    pc = np.vectorize(lambda v: bin(v).count("1"))(i[:, None] & i[None, :])
    return np.where(pc % 2 == 0, 1.0, -1.0)


def _butterfly_np(x):
    """The literal in-place butterfly of docs/semantics.md 2.1 in float32 numpy."""
    y = np.array(x, dtype=F32, copy=True)
    s = 1
    while s < 128:
        for g in range(0, 128, 2 * s):
            a = y[..., g:g + s].copy()
            b = y[..., g + s:g + 2 * s].copy()
            y[..., g:g + s] = a + b
            y[..., g + s:g + 2 * s] = a - b
        s *= 2
    return y


def test_hadamard_matrix_recursion_matches_popcount():
    h = np.array([[1.0]])
    for _ in range(7):
        h = np.block([[h, h], [h, -h]])
    np.testing.assert_array_equal(h, _hadamard_matrix64())


def test_hadamard128_matches_matrix_definition(rng):
    x = (rng.standard_normal((64, 128)) * np.exp2(rng.uniform(-10, 10, (64, 1)))).astype(F32)
    x[0] = 0
    x[1] = np.eye(128, dtype=F32)[37]            # a basis vector picks one matrix row
    got = np.asarray(jax.jit(nm.hadamard128)(jnp.asarray(x)))
    want = x.astype(np.float64) @ _hadamard_matrix64()      # H symmetric: x.H
    tol = 7 * 2.0**-24 * np.abs(x).astype(np.float64).sum(-1, keepdims=True)
    assert np.all(np.abs(got - want) <= tol)
    np.testing.assert_array_equal(got[1], _hadamard_matrix64()[37].astype(F32))
    assert np.all(got[0] == 0)
    # orthogonality: H.H = 128 I, so applying twice returns 128 x (to rounding)
    twice = np.asarray(jax.jit(nm.hadamard128)(jnp.asarray(got)))
    np.testing.assert_allclose(twice, 128 * x.astype(np.float64), rtol=0,
                               atol=float(np.max(1e-5 * 128 * np.abs(x).sum(-1))))


def test_hadamard128_equals_numpy_butterfly_bitwise(rng):
    x = (rng.standard_normal((3, 5, 128)) * np.exp2(rng.uniform(-20, 20, (3, 5, 1)))).astype(F32)
    x[2, 4] *= np.exp2(rng.uniform(-30, 30, 128)).astype(F32)     # a row of widely spread exponents
    want = _butterfly_np(x)
    got_jit = np.asarray(jax.jit(nm.hadamard128)(jnp.asarray(x)))
    got_eager = np.asarray(nm.hadamard128(jnp.asarray(x)))
    got_flat = np.asarray(jax.jit(nm.hadamard128)(jnp.asarray(x.reshape(15, 128)))).reshape(x.shape)
    got_row = np.asarray(jax.jit(nm.hadamard128)(jnp.asarray(x[1, 2])))
    for got in (got_jit, got_eager, got_flat):
        np.testing.assert_array_equal(_bits(got), _bits(want))
    np.testing.assert_array_equal(_bits(got_row), _bits(want[1, 2]))


def _signed_zero_rows(rng):
    """[6, 128] f32 rows that exercise signed zeros: all -0, -0 pairs, -0 against +0,
    pairs that cancel exactly, and random rows with -0 scattered in."""
    x = (rng.standard_normal((6, 128)) * np.exp2(rng.uniform(-20, 20, (6, 1)))).astype(F32)
    x[0] = -0.0
    x[1, ::2] = -0.0
    x[1, 1::2] = -0.0 if rng.integers(2) else 0.0
    x[2, ::2] = -0.0
    x[2, 1::2] = 0.0
    x[3, 1::2] = -x[3, ::2]                          # stage 1 differences cancel to exactly 0
    x[4:, rng.integers(0, 128, 40)] = -0.0
    return x


def test_hadamard128_equals_constant_geometry_form_bitwise(rng):
    """The in-place unstack form has the bits of the constant-geometry form
    (tests/numerics_forms.py) for normal inputs and signed zeros, jitted and eager and at
    several leading shapes; and of the numpy butterfly once -0 is +0. (Not for
    subnormals on the CPU: XLA's CPU backend flushes them to zero with their sign, and
    the two forms' signed zeros then differ; the GPU backends keep them.)"""
    n_random_rows = 40
    x = (rng.standard_normal((n_random_rows, 128)) * np.exp2(rng.uniform(-60, 60, (n_random_rows, 1)))).astype(F32)
    x[5] *= np.exp2(rng.uniform(-40, 40, 128)).astype(F32)                 # widely spread exponents
    x = np.concatenate([x, _signed_zero_rows(rng)])                        # its row 0: all -0
    want = np.asarray(jax.jit(hadamard128_constant_geometry)(jnp.asarray(x)))
    for got in (np.asarray(jax.jit(nm.hadamard128)(jnp.asarray(x))),
                np.asarray(nm.hadamard128(jnp.asarray(x))),
                np.asarray(jax.jit(nm.hadamard128)(jnp.asarray(x.reshape(2, 23, 128)))).reshape(x.shape)):
        np.testing.assert_array_equal(_bits(got), _bits(want))
    assert not np.any((want == 0) & np.signbit(want))                     # no -0 out of either form
    np.testing.assert_array_equal(_bits(want), _bits(_butterfly_np(np.where(x == 0, F32(0), x))))
    # the integer select is what keeps -0 out: the plain butterfly of an all -0 row gives a -0
    all_minus_zero = x[n_random_rows:n_random_rows + 1]
    assert np.any(np.signbit(_butterfly_np(all_minus_zero)))


def test_hadamard128_differs_from_dense_matmul_only_in_rounding(rng):
    """Self-check that the bitwise butterfly test is sharp: an fp32 dense product of the
    same matrix is not always bit-equal to the butterfly."""
    x = rng.standard_normal((512, 128)).astype(F32)
    dense = (x @ _hadamard_matrix64().astype(F32)).astype(F32)
    bfly = _butterfly_np(x)
    assert np.any(_bits(dense) != _bits(bfly))
    assert np.max(np.abs(dense - bfly)) < 1e-4


# ---------------------------------------------------------------------------------
# power-of-two scale and fp8 quantisation
# ---------------------------------------------------------------------------------
def _is_pow2(x):
    x = np.asarray(x, np.float32)
    m, _ = np.frexp(x)
    return (x > 0) & (m == 0.5)


def test_pow2_scale_exact_powers(rng):
    amax = np.concatenate([
        np.exp2(rng.uniform(-40, 127, 3000)).astype(F32),           # spread
        np.exp2(np.arange(-13, 118)).astype(F32) * 448,               # exactly at 2^k * 448
        np.exp2(np.arange(-13, 126)).astype(F32),                     # exact powers of two
        np.nextafter(np.exp2(np.arange(-13, 110)).astype(F32) * 448, F32(np.inf)),
        np.nextafter(np.exp2(np.arange(-13, 110)).astype(F32) * 448, F32(0)),
        np.array([1e-4, 1.1e-4, 448, 449, 1e38, 3.3e38], F32),
    ]).astype(F32)
    scale, inv = jax.jit(nm.pow2_scale)(jnp.asarray(amax))
    scale, inv = np.asarray(scale), np.asarray(inv)
    assert np.all(_is_pow2(scale)) and np.all(_is_pow2(inv))
    assert np.all(scale.astype(np.float64) * inv.astype(np.float64) == 1.0)
    # ceil: v = max(amax, 1e-4) * fl(1/448) is <= scale < 2 v (so the scale is the smallest one)
    v = np.maximum(amax, F32(1e-4)).astype(F32) * F32(1.0 / 448.0)
    v = v.astype(np.float64)
    assert np.all(v <= scale) and np.all(scale < 2 * v)
    # every value quantises into [-448, 448] (test below: for every f32 amax, not only these)
    q = amax.astype(np.float64) * inv
    assert np.all(q <= 448)
    assert np.all(q[amax >= 1e-4] > 224 * (1 - 2.0**-22))


def test_no_finite_value_scales_past_448():
    """amax * inv_scale <= 448 for EVERY f32 amax of the binade [448, 896) (and so of every
    normal binade: the scale comes from the exponent bits and fl(1/448) scales exactly by
    2**k), although fl(1/448) > 1/448 by less than an ulp: the quantisation's clip to
    +-448 never changes a finite value, so kernels whose fp8 conversion saturates may
    leave it out (numerics.quant_fp8's ``saturates``)."""
    u = np.arange(np.float32(448).view(np.uint32), np.float32(896).view(np.uint32), dtype=np.uint32)
    amax = np.concatenate([u.view(F32), (u.view(F32) * F32(2.0**-12)), (u.view(F32) * F32(2.0**100))])
    scale, inv = jax.jit(nm.pow2_scale)(jnp.asarray(amax))
    q = amax.astype(np.float64) * np.asarray(inv).astype(np.float64)
    assert q.max() == 448.0 and np.all(q > 224)


def test_pow2_scale_floor_for_small_inputs():
    amax = np.array([0.0, 1e-45, 1e-38, 1e-20, 1e-5, 9.99e-5, np.float32(1e-4)], F32)
    scale, inv = jax.jit(nm.pow2_scale)(jnp.asarray(amax))
    assert np.all(np.asarray(scale) == np.float32(2.0**-22))
    assert np.all(np.asarray(inv) == np.float32(2.0**22))
    # 2^-22 is what docs/semantics.md 2.2 derives: 2^ceil(log2(1e-4/448))
    assert 2.0**math.ceil(math.log2(1e-4 / 448)) == 2.0**-22


def test_quant_fp8_no_nan_and_bounded(rng):
    rows = [
        np.zeros(128, F32),
        np.full(128, 1e38, F32),
        -np.full(128, 1e38, F32),
        np.full(128, 3e-42, F32),                     # f32 subnormals
        np.full(128, 1e-30, F32),
        _random_f32(rng, 128, -126, 127),             # huge dynamic range in one row
        _random_f32(rng, 128, -3, 3),
    ]
    y = np.stack(rows)
    q8, scale = jax.jit(nm.quant_fp8)(jnp.asarray(y))
    q = np.asarray(q8).astype(np.float32)
    scale = np.asarray(scale)
    codes = np.asarray(q8).view(np.uint8)
    assert not np.any(np.isnan(q)) and not np.any((codes & 0x7F) == 0x7F)        # no NaN codes
    assert np.all(np.abs(q) <= 448)
    assert np.all(_is_pow2(scale))
    assert scale[0] == scale[3] == scale[4] == F32(2.0**-22)
    assert np.all(codes[0] == 0)
    # the +-1e38 rows hit the top of the fp8 range, same magnitude, opposite sign
    np.testing.assert_array_equal(codes[1] ^ 0x80, codes[2])
    assert np.all(np.abs(q[1]) > 224)
    deq = q.astype(np.float64) * scale[:, None]
    ok = np.abs(deq - y) <= 2.0**-4 * np.abs(y) + scale[:, None] * 2.0**-10
    assert np.all(ok[[0, 1, 2, 6]])


def test_fwht_quant_rows_no_nan_for_extreme_inputs(rng):
    q = np.zeros((5, 128), ml_dtypes.bfloat16)
    q[1, 3] = 1e38                                   # a spike: each output is +-1e38/sqrt(128)
    q[2] = np.float32(1e-38)                         # bf16 of a tiny f32 (normal bf16)
    q[3] = _random_f32(rng, 128, -40, 40)
    q[4, :2] = -1.5e38                              # outputs +-3e38 or 0: still finite
    q8, scale = jax.jit(nm.fwht_quant_rows)(jnp.asarray(q))
    q8 = np.asarray(q8).astype(np.float32)
    assert not np.any(np.isnan(q8)) and not np.any(np.isnan(np.asarray(scale)))
    assert np.all(np.isfinite(np.asarray(scale)))
    assert np.all(_is_pow2(np.asarray(scale)))
    assert np.all(np.asarray(q8)[0] == 0)


def _non_finite_query_rows():
    """[n, 128] bf16 rows that the non-finite rule maps to zero codes and scale 2**-22:
    NaN (several bit patterns, one value or all), +-inf, and finite rows whose rotation
    overflows f32 (+-1e37 everywhere). (A rotation that is finite in f32 is at most
    2**128 / sqrt(128) and never rounds to a bf16 infinity.)"""
    bf = ml_dtypes.bfloat16
    rows = []
    for pattern in (0x7FC0, 0x7FFF, 0xFFC0, 0xFFFF, 0x7F81, 0xFF81):
        r = np.zeros(128, np.uint16)
        r[int(pattern) % 128] = pattern
        rows.append(r.view(bf))
    rows.append(np.full(128, np.uint16(0x7FFF)).view(bf))                  # all NaN
    for v in (np.inf, -np.inf):
        r = np.zeros(128, bf)
        r[5] = v
        rows.append(r)
    rows.append(np.full(128, 1e37, bf))                                     # 128 * 1e37 overflows
    rows.append(np.full(128, -1e37, bf))
    return np.stack(rows)


def test_non_finite_rows_are_zero_codes_with_the_floor_scale(rng):
    """The non-finite rule (numerics.rotate_quant): a query row holding +-inf or NaN,
    or whose rotation overflows, is all-zero fp8 codes
    with scale 2**-22, the bytes of an all-zero row, in the XLA form and in the Pallas
    kernel alike, whatever rows are beside it. (NaN arithmetic alone gives a NaN row
    scale -0.0 in the XLA form and 2.4e-7 in the kernel, with NaN codes 0x7F.)"""
    from glm5_jax import ops
    bad = _non_finite_query_rows()
    q = np.asarray(random_rows_bf16(rng, 37))
    where = rng.permutation(q.shape[0])[:bad.shape[0]]
    q[where] = bad
    zero_q8, zero_s = jax.jit(nm.fwht_quant_rows)(jnp.zeros((1, 128), jnp.bfloat16))
    assert np.all(np.asarray(zero_q8).view(np.uint8) == 0) and _bits(zero_s)[0] == 0x34800000   # 2**-22
    got = {}
    for impl in ("xla", "pallas"):
        q8, s = ops.fwht_quant(jnp.asarray(q), implementation=impl)
        got[impl] = np.asarray(q8).view(np.uint8), _bits(s)
        alone = [ops.fwht_quant(jnp.asarray(q[i:i + 1]), implementation=impl) for i in where[:3]]
        for i, (a8, a) in zip(where[:3], alone):                # the same bytes alone as in the batch
            np.testing.assert_array_equal(np.asarray(a8).view(np.uint8)[0], got[impl][0][i])
            assert _bits(a)[0] == got[impl][1][i]
    np.testing.assert_array_equal(got["xla"][0], got["pallas"][0])
    np.testing.assert_array_equal(got["xla"][1], got["pallas"][1])
    codes, scale = got["xla"]
    assert np.all(codes[where] == 0) and np.all(scale[where] == 0x34800000)
    finite = np.setdiff1d(np.arange(q.shape[0]), where)
    want8, want = jax.jit(nm.quant_fp8)(jax.jit(lambda x: nm.round_bf16(nm.hadamard128(x) * nm.INV_SQRT_128))(
        jnp.asarray(q[finite]).astype(jnp.float32)))            # the finite rows keep quant_fp8's bytes
    np.testing.assert_array_equal(codes[finite], np.asarray(want8).view(np.uint8))
    np.testing.assert_array_equal(scale[finite], _bits(want))


def random_rows_bf16(rng, n):
    mag = np.exp(rng.uniform(np.log(1e-3), np.log(300.0), size=(n, 1)))
    return (rng.standard_normal((n, 128)) * mag).astype(ml_dtypes.bfloat16)


def test_pool_non_finite_rule_reads_exponent_bits_only(rng):
    """compress_pool's non-finite rule on single pools: any NaN / +-inf key or score
    (gate + ape), or keys whose pooled rotation overflows, gives zero codes and scale
    2**-22; scores that are finite but huge (+-3e38: the softmax differences overflow to
    -inf, which the exp's clamp takes) give a finite pool, the same bytes with the
    knockout weights of the decode update."""
    keys = [jnp.asarray(random_rows_bf16(rng, 1)) for _ in range(4)]
    gates = [jnp.asarray(random_rows_bf16(rng, 1)) for _ in range(4)]
    ape = [jnp.asarray(rng.standard_normal(128), jnp.float32) for _ in range(4)]
    pool = jax.jit(nm.compress_pool)
    knock = jax.jit(lambda k, g, a: nm.compress_pool(k, g, a, weights=nm.softmax_weights_knockout))

    def run(k, g, a=ape):
        q8, s = pool(k, g, a)
        q8k, sk = knock(k, g, a)
        np.testing.assert_array_equal(np.asarray(q8).view(np.uint8), np.asarray(q8k).view(np.uint8))
        assert _bits(s)[0] == _bits(sk)[0]
        return np.asarray(q8).view(np.uint8)[0], _bits(s)[0]

    def put(rows, j, d, v):
        out = list(rows)
        r = np.asarray(out[j]).copy()
        r[0, d] = v
        out[j] = jnp.asarray(r)
        return out

    for v in (np.nan, np.inf, -np.inf):
        for name in ("key", "gate"):
            j, d = int(rng.integers(0, 4)), int(rng.integers(0, 128))
            k, g = (put(keys, j, d, v), gates) if name == "key" else (keys, put(gates, j, d, v))
            codes, scale = run(k, g)
            assert np.all(codes == 0) and scale == 0x34800000, (name, v)
    big = [jnp.full((1, 128), 1e37, jnp.bfloat16)] * 4                     # the rotation overflows
    codes, scale = run(big, gates)
    assert np.all(codes == 0) and scale == 0x34800000
    nan_ape = [a.at[7].set(np.nan) for a in ape]
    codes, scale = run(keys, gates, nan_ape)
    assert np.all(codes == 0) and scale == 0x34800000
    huge = [jnp.asarray(np.where(rng.random((1, 128)) < 0.5, -3e38, 3e38), jnp.bfloat16) for _ in range(4)]
    codes, scale = run(keys, huge, [jnp.zeros(128, jnp.float32)] * 4)
    assert np.isfinite(np.uint32(scale).view(np.float32)) and scale != 0x34800000 and np.any(codes != 0)


# ---------------------------------------------------------------------------------
# bit-level conversions vs ml_dtypes
# ---------------------------------------------------------------------------------
def _e4m3_edge_values():
    v = []
    # every fp8 value and every midpoint between neighbours (ties), both signs
    codes = np.arange(0, 0x7F, dtype=np.uint8)                     # 0x7F is NaN
    vals = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    mids = (vals[:-1] + vals[1:]) / 2
    v += [vals, mids, np.nextafter(mids, 0), np.nextafter(mids, 1e9)]
    # subnormal range 2^-9 .. 2^-6 and below the smallest subnormal
    v += [np.linspace(0, 2.0**-6, 257), np.array([2.0**-10, 2.0**-10 * 1.0001, 2.0**-11, 1e-30, 0.0])]
    v += [np.array([448.0, 447.9, 440.0, 432.0, 416.0, 2.0**-6, 2.0**-7, 0.0625, 1.0, 1.0625, 1.125])]
    out = np.concatenate(v).astype(F32)
    return np.concatenate([out, -out])


def test_e4m3_bits_equals_ml_dtypes(rng):
    x = np.concatenate([
        _e4m3_edge_values(),
        _random_f32(rng, 20000, -14, 9),
        rng.uniform(-448, 448, 20000).astype(F32),
        rng.uniform(-2.0**-5, 2.0**-5, 20000).astype(F32),
    ])
    x = np.clip(x, -448, 448).astype(F32)
    got = np.asarray(jax.jit(nm.e4m3_bits)(jnp.asarray(x)))
    assert got.dtype == np.uint8
    want = x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, (f"{bad.size} mismatches, e.g. x={x[bad[:5]]!r} "
                           f"got={got[bad[:5]]} want={want[bad[:5]]}")
    # the same bits eagerly (op by op) as under jit
    np.testing.assert_array_equal(np.asarray(nm.e4m3_bits(jnp.asarray(x[:4096]))), want[:4096])


def test_round_bf16_equals_ml_dtypes(rng):
    u = rng.integers(0, 2**32, 50000, dtype=np.uint64).astype(np.uint32)
    x = u.view(np.float32)
    x = x[np.isfinite(x)]
    # ties: low 16 bits exactly 0x8000 (even and odd upper halves), and just around them
    hi = rng.integers(0, 0x7F7F, 2000, dtype=np.uint32) << 16
    sgn = (rng.integers(0, 2, 2000, dtype=np.uint32) << 31)
    ties = np.concatenate([hi | 0x8000, hi | 0x7FFF, hi | 0x8001, hi | 0x18000]) | np.tile(sgn, 4)
    extra = np.array([0.0, -0.0, 1.0, 3.3895e38, 1e-40, -1e-45, 65504.0], F32)
    x = np.concatenate([x, ties.view(np.float32), extra, _random_f32(rng, 5000)]).astype(F32)
    got = np.asarray(jax.jit(nm.round_bf16)(jnp.asarray(x)))
    want = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    bad = np.nonzero(_bits(got) != _bits(want))[0]
    assert bad.size == 0, f"{bad.size} mismatches, e.g. {x[bad[:5]]!r}"


# ---------------------------------------------------------------------------------
# exp, reciprocal, exact-product multiply-add
# ---------------------------------------------------------------------------------
def test_exp_f32_accuracy(rng):
    d = np.concatenate([
        rng.uniform(-87, 0, 200000),
        -np.exp2(rng.uniform(-40, 6, 20000)),
        np.arange(-87, 1, dtype=np.float64),                 # integers
        -np.arange(0, 126) * math.log(2),                     # near multiples of ln 2
        [0.0, -0.0, -1e-30, -86.99, -87.0],
    ]).astype(F32)
    got = np.asarray(jax.jit(nm.exp_f32)(jnp.asarray(d)))
    want = np.exp(d.astype(np.float64)).astype(F32)          # correctly rounded (to f64 accuracy)
    ulps = _ulp_diff(got, want)
    assert ulps.max() <= 1, f"max {ulps.max()} ulp at d={d[np.argmax(ulps)]!r}"
    assert got[d == 0][0] == 1.0
    assert np.all(got > 0) and np.all(got <= 1.0)


def test_exp_f32_is_context_independent(rng):
    """Same bits eagerly, under jit, fused into other ops, vmapped and inside a fori_loop."""
    d = np.concatenate([rng.uniform(-87, 0, 4096), -np.exp2(rng.uniform(-30, 6, 1024))]).astype(F32)
    x = jnp.asarray(d)
    ref = np.asarray(jax.jit(nm.exp_f32)(x))
    eager = np.asarray(nm.exp_f32(x))

    def in_loop(x):
        def body(i, c):
            acc, xs = c
            e = nm.exp_f32(xs)
            return acc + e * (i == 2).astype(jnp.float32), xs
        return lax.fori_loop(0, 3, body, (jnp.zeros_like(x), x))[0]

    def fused(a, b):         # exp(s - max) as in the pool softmax, then a sum
        m = jnp.maximum(a, b)
        e = nm.exp_f32(a - m) + nm.exp_f32(b - m)
        return nm.exp_f32(a - m), e

    def scanned(x):
        return lax.scan(lambda c, xi: (c, nm.exp_f32(xi)), 0.0, x.reshape(-1, 128))[1].reshape(-1)

    loop = np.asarray(jax.jit(in_loop)(x))
    other = rng.uniform(-87, 0, d.size).astype(F32)
    fus = np.asarray(jax.jit(fused)(x, jnp.asarray(other))[0])
    vm = np.asarray(jax.jit(jax.vmap(nm.exp_f32))(x.reshape(-1, 128))).reshape(-1)
    sc = np.asarray(jax.jit(scanned)(x))
    for name, got in (("eager", eager), ("fori_loop", loop), ("vmap", vm), ("scan", sc)):
        np.testing.assert_array_equal(_bits(got), _bits(ref), err_msg=name)
    # fused into the softmax: the same bits as exp_f32 of the same (numpy-computed) argument
    s = (d - np.maximum(d, other)).astype(F32)
    np.testing.assert_array_equal(_bits(fus), _bits(np.asarray(jax.jit(nm.exp_f32)(jnp.asarray(s)))))


def test_exp_table_is_correctly_rounded():
    """EXP_TABLE[j] is 2**(j/64) rounded to nearest f32 (checked at 40 digits)."""
    import decimal
    ctx = decimal.Context(prec=40)
    for j, t in enumerate(nm.EXP_TABLE):
        x = ctx.power(decimal.Decimal(2), decimal.Decimal(j) / 64)
        err = abs(decimal.Decimal(float(t)) - x)
        half_ulp = decimal.Decimal(float(np.spacing(t))) / 2
        assert err <= half_ulp, f"T[{j}] = {t!r} is {err / half_ulp} half-ulps off"


def _mul_add(a, b, c, fused):
    """c + a*b in f32: one rounding when fused (float64 holds the f32 product), two otherwise."""
    if fused:
        return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(F32)
    return (c + (a * b).astype(F32)).astype(F32)


def _exact(a, b):
    return np.all((a * b).astype(F32).astype(np.float64) == a.astype(np.float64) * b.astype(np.float64))


def _exp_model(d, fused):
    """numerics.exp_f32 step by step in numpy. fused: every multiply-add that a compiler
    could contract is fused (one rounding), as if ``rounded`` were not there; else each
    multiply rounds on its own (what ``rounded`` guarantees)."""
    f = lambda v: np.asarray(v, F32)                                            # noqa: E731
    d = np.clip(d, -87.0, 88.0).astype(F32)
    kf = np.floor((d * F32(nm.EXP_SCALE)).astype(F32))
    r = d
    for part in (nm.EXP_L1, nm.EXP_L2, nm.EXP_L3):
        assert _exact(kf, f(part))              # exact: fused or not, the same r
        r = _mul_add(-kf, f(part), r, fused)
    k = kf.astype(np.int32)
    t = nm.EXP_TABLE[k & 63]
    a1 = _mul_add(r, f(nm.EXP_C6), f(0.5), fused)
    a2 = _mul_add(r, a1, f(1.0), fused)
    q = (r * a2).astype(F32)
    e = _mul_add(t, q, t, fused)
    two_n = (((k >> 6) + 127).astype(np.uint32) << np.uint32(23)).view(F32)
    return (e * two_n).astype(F32)


def _exp_inputs(rng):
    return np.concatenate([rng.uniform(-87, 0, 100000), -np.exp2(rng.uniform(-40, 6, 20000)),
                           rng.uniform(0, 88, 20000), [0.0, -0.0, -87.0, 88.0, -1e-30]]).astype(F32)


def test_exp_f32_rounds_each_product_on_its_own(rng):
    """exp_f32 equals the step-by-step model with every multiply rounded on its own: in a
    plain jit, inside a loop (where XLA fuses differently), and through a kernel's table
    lookup. On the GPU this is XLA's code; the kernels' tests check Pallas and Triton."""
    d = _exp_inputs(rng)
    want = _exp_model(d, fused=False)
    np.testing.assert_array_equal(_bits(np.asarray(jax.jit(nm.exp_f32)(jnp.asarray(d)))), _bits(want))
    looped = jax.jit(lambda x: lax.fori_loop(0, 2, lambda i, c: nm.exp_f32(x) + c * 0.0, x))(jnp.asarray(d))
    np.testing.assert_array_equal(_bits(np.asarray(looped)), _bits(want))
    tab = jnp.asarray(nm.exp_table_input())
    got = jax.jit(lambda x: nm.exp_f32(x, lambda j: tab[jnp.zeros_like(j), j]))(jnp.asarray(d))
    np.testing.assert_array_equal(_bits(np.asarray(got)), _bits(want))


def test_exp_model_fused_differs_so_the_rounding_matters(rng):
    """The model is sharp: contracting its multiply-adds (what ``rounded`` prevents)
    changes some results, and with a 16-bit ln2/64 part (k * part needs up to 29 bits)
    even the reduction would depend on contraction."""
    d = _exp_inputs(rng)
    assert np.any(_bits(_exp_model(d, fused=True)) != _bits(_exp_model(d, fused=False)))
    d = rng.uniform(-87, 0, 20000).astype(F32)
    kf = np.floor((d * F32(nm.EXP_SCALE)).astype(F32))
    part = F32(nm._short(nm._EXP_L, 16))
    assert not _exact(kf, np.full_like(kf, part))
    sep = _mul_add(-kf, np.full_like(kf, part), d, False)
    fus = _mul_add(-kf, np.full_like(kf, part), d, True)
    assert np.any(_bits(sep) != _bits(fus))


def test_exp_forms_equal_the_conversion_form(rng):
    """exp_f32 (k from the bits of kf + 1.5 * 2**23) and exp_nonpositive_f32 (one-sided
    clamp) have the bits of exp_f32_by_conversion (k by a float-to-int conversion, both
    clamps; tests/numerics_forms.py): exp_f32 over [-100, 100] (both clamps reached),
    exp_nonpositive_f32 for every d <= 0, jitted and eager, with the XLA gather and with
    a kernel-style table lookup."""
    d_all = np.concatenate([rng.uniform(-100, 100, 100000), _exp_inputs(rng),
                            [88.0, 88.5, 1e30, -1e30, -87.0, -87.000001, -86.99999]]).astype(F32)
    d_neg = np.concatenate([rng.uniform(-100, 0, 100000), -np.exp2(rng.uniform(-149, 8, 50000)),
                            np.arange(-8200, 1) / F32(nm.EXP_SCALE),          # near every k boundary
                            [0.0, -0.0, -87.0, -1e30, -2.0**-149]]).astype(F32)
    d_neg = np.minimum(d_neg, F32(0.0))
    tab = jnp.asarray(nm.exp_table_input())
    kernel_lookup = lambda j: tab[jnp.zeros_like(j), j]                           # noqa: E731
    want_all = np.asarray(jax.jit(exp_f32_by_conversion)(jnp.asarray(d_all)))
    want_neg = np.asarray(jax.jit(exp_f32_by_conversion)(jnp.asarray(d_neg)))
    for name, got, want in (
            ("exp_f32 jit", jax.jit(nm.exp_f32)(jnp.asarray(d_all)), want_all),
            ("exp_f32 eager", nm.exp_f32(jnp.asarray(d_all)), want_all),
            ("exp_f32 table", jax.jit(lambda x: nm.exp_f32(x, kernel_lookup))(jnp.asarray(d_all)), want_all),
            ("nonpositive jit", jax.jit(nm.exp_nonpositive_f32)(jnp.asarray(d_neg)), want_neg),
            ("nonpositive eager", nm.exp_nonpositive_f32(jnp.asarray(d_neg)), want_neg),
            ("nonpositive table", jax.jit(lambda x: nm.exp_nonpositive_f32(x, kernel_lookup))(jnp.asarray(d_neg)),
             want_neg)):
        np.testing.assert_array_equal(_bits(np.asarray(got)), _bits(want), err_msg=name)
    # the one-sided clamp is exp_f32 only where d <= 0: at d > 88 they part
    big = jnp.asarray(np.array([100.0], F32))
    assert _bits(np.asarray(nm.exp_nonpositive_f32(big))) != _bits(np.asarray(nm.exp_f32(big)))


def test_exp_nonpositive_power_by_bits_equals_the_multiply(rng):
    """exp_nonpositive_f32 applies 2**(k >> 6) by adding (k >> 6) << 23 to e's bits: the
    same bits as the multiply (``_exp_clamped`` without scale_by_bits) and as
    exp_f32_by_conversion, for EVERY f32 in [-87, -86.5] (k >> 6 = -126, the bottom of the
    range, where a subnormal product would break the add: it stays normal), every f32 within
    +-6 ulps of each k boundary k / EXP_SCALE in [-87, 0], the tiny d near 0 (r < 0 there,
    e < 1) and random d; with the XLA gather and with a kernel-style lookup."""
    lo = np.float32(-87.0).view(np.uint32)
    hi = np.float32(-86.5).view(np.uint32)
    every = np.arange(hi, lo + 1, dtype=np.uint32).view(F32)                       # all of [-87, -86.5]
    edges = (np.arange(-8033, 1) / F32(nm.EXP_SCALE)).astype(F32)
    near = (edges.view(np.int32)[:, None] + np.arange(-6, 7, dtype=np.int32)[None, :]).view(F32).ravel()
    near = near[np.isfinite(near)]                      # (around 0 the int steps wrap into NaN patterns)
    tiny = -np.exp2(rng.uniform(-149, -5, 20000)).astype(F32)
    d = np.concatenate([every, near, tiny, rng.uniform(-87, 0, 20000).astype(F32), [0.0, -0.0, -87.0]]).astype(F32)
    d = np.clip(d, F32(-87.0), F32(0.0))
    assert every.size > 60000
    tab = jnp.asarray(nm.exp_table_input())
    kernel_lookup = lambda j: tab[jnp.zeros_like(j), j]                           # noqa: E731
    mult = np.asarray(jax.jit(lambda x: nm._exp_clamped(jnp.maximum(x, -87.0)))(jnp.asarray(d)))
    np.testing.assert_array_equal(_bits(mult), _bits(np.asarray(jax.jit(exp_f32_by_conversion)(jnp.asarray(d)))))
    for name, got in (("gather", jax.jit(nm.exp_nonpositive_f32)(jnp.asarray(d))),
                      ("kernel lookup", jax.jit(lambda x: nm.exp_nonpositive_f32(x, kernel_lookup))(jnp.asarray(d)))):
        np.testing.assert_array_equal(_bits(np.asarray(got)), _bits(mult), err_msg=name)
    # the cases the argument rests on are in the draw: e < 1 (near 0) and the bottom binade
    assert np.any(mult < 1.0) and np.min(mult[mult > 0]) < 2.0 ** -125


def test_compress_pool_takes_its_multiply_as_mul(rng):
    """Every product that meets an add in compress_pool goes through its ``mul`` (the
    compiled kernels pass a mul.rn.f32 there): a mul that rounds the same way gives the
    same bytes, one that does not changes them (so no product bypasses it)."""
    keys = [jnp.asarray(_random_f32(rng, 4 * 128, -3, 3).reshape(4, 128)).astype(jnp.bfloat16) for _ in range(4)]
    gates = [jnp.asarray(rng.normal(0, 2, (4, 128)).astype(F32)).astype(jnp.bfloat16) for _ in range(4)]
    apes = [jnp.asarray(rng.normal(0, 1, 128).astype(F32)) for _ in range(4)]
    base = [np.asarray(a) for a in nm.compress_pool(keys, gates, apes)]
    same = [np.asarray(a) for a in nm.compress_pool(keys, gates, apes, mul=lambda a, b: a * b)]
    np.testing.assert_array_equal(base[0].view(np.uint8), same[0].view(np.uint8))
    np.testing.assert_array_equal(base[1], same[1])
    calls = []

    def counting(a, b):
        calls.append(1)
        return nm.mul_rounded(a, b)
    nm.compress_pool(keys, gates, apes, mul=counting)
    assert len(calls) == 4 * 3 + 4 + 4           # 3 per exp, the 4 pooled products, 4 Newton steps
    off = [np.asarray(a) for a in nm.compress_pool(keys, gates, apes,
                                                   mul=lambda a, b: nm.mul_rounded(a, b) + F32(2.0 ** -6))]
    assert not np.array_equal(base[0].view(np.uint8), off[0].view(np.uint8))


def test_compress_pool_kernel_forms_are_used_and_keep_the_bytes(rng):
    """compress_pool's kernel hooks: the bf16 rounding runs twice per pool and
    the -0 fix once, through the forms given (a rounding that truncates instead changes
    the bytes, so neither is bypassed), and leaving the clip to the conversion
    (fp8_saturates) keeps every byte on XLA too, since no finite value scales past 448.
    The compiled PTX forms are held to the same bytes by tests/test_gpu.py."""
    keys = [jnp.asarray(_random_f32(rng, 8 * 128, -3, 3).reshape(8, 128)).astype(jnp.bfloat16) for _ in range(4)]
    gates = [jnp.asarray(rng.normal(0, 2, (8, 128)).astype(F32)).astype(jnp.bfloat16) for _ in range(4)]
    apes = [jnp.asarray(rng.normal(0, 1, 128).astype(F32)) for _ in range(4)]
    keys[0] = keys[0].at[0].set(-0.0)                                   # a row whose pooled x has -0s
    base = [np.asarray(a) for a in nm.compress_pool(keys, gates, apes)]
    calls = {"round": 0, "zero": 0}

    def rnd(x):
        calls["round"] += 1
        return nm.round_bf16(x)

    def zero(x):
        calls["zero"] += 1
        return nm.positive_zero(x)
    same = [np.asarray(a) for a in nm.compress_pool(keys, gates, apes, bf16_round=rnd, zero_plus=zero,
                                                    fp8_saturates=True)]
    assert calls == {"round": 2, "zero": 1}
    np.testing.assert_array_equal(base[0].view(np.uint8), same[0].view(np.uint8))
    np.testing.assert_array_equal(_bits(base[1]), _bits(same[1]))
    trunc = lambda x: nm._f32(nm._u32(x) & np.uint32(0xFFFF0000))                 # noqa: E731
    off = np.asarray(nm.compress_pool(keys, gates, apes, bf16_round=trunc)[0])
    assert not np.array_equal(base[0].view(np.uint8), off.view(np.uint8))


def _knockout_scores(rng, n):
    """[4, n] f32 scores for the softmax weights: spread values, every tie pattern of
    small integers (with +0 / -0 mixed), pairs one ulp apart, far-apart scores (weights
    down to the exp's clamp) and -inf beside finite scores."""
    s = np.stack([_random_f32(rng, n, -20, 8) for _ in range(4)])
    k = n // 6
    s[:, k:2 * k] = rng.integers(-2, 2, (4, k)).astype(F32)                    # ties, zeros
    s[:, k:2 * k] *= rng.choice(np.array([1.0, -1.0], F32), (4, k))            # -0 where 0
    base = _random_f32(rng, k, -6, 6)
    s[:, 2 * k:3 * k] = np.stack([np.nextafter(base, F32(rng.choice([-1, 1]) * np.inf)) for _ in range(4)])
    s[:, 3 * k:4 * k] = rng.uniform(-300, 300, (4, k)).astype(F32)              # d < -87 often
    s[rng.integers(0, 4, k), np.arange(4 * k, 5 * k)] = -np.inf
    return s


def test_knockout_weights_are_the_chain_weights(rng):
    """softmax_weights_knockout (three exps for four scores) gives every
    weight the bits of softmax_weights (the reference's left-to-right max, four exps) for
    finite scores and -inf beside them: spread values, all tie patterns with signed zeros,
    neighbours one ulp apart, weights at the exp's clamp. It runs three exps, and the
    max (weight 1) falls in each of the four slots somewhere in the draw, so a misplaced
    weight shows (swapping the final's two weights fails this test)."""
    s = jnp.asarray(_knockout_scores(rng, 60_000))
    calls = []

    def exp(d):
        calls.append(d.shape)
        return nm.exp_nonpositive_f32(d)
    want = nm.softmax_weights(list(s), nm.exp_nonpositive_f32)
    got = nm.softmax_weights_knockout(list(s), exp)
    assert len(calls) == 3
    for j in range(4):
        np.testing.assert_array_equal(_bits(got[j]), _bits(want[j]), err_msg=f"weight {j}")
    assert all(np.any(np.asarray(w) == 1.0) for w in want)                   # the max sits in every slot
    jitted = jax.jit(lambda x: nm.softmax_weights_knockout(list(x), nm.exp_nonpositive_f32))(s)
    for j in range(4):
        np.testing.assert_array_equal(_bits(jitted[j]), _bits(want[j]), err_msg=f"jit weight {j}")
    two = [s[0], s[1], s[2]]                                                   # other R: the chain form
    for a, b in zip(nm.softmax_weights_knockout(two, nm.exp_nonpositive_f32),
                    nm.softmax_weights(two, nm.exp_nonpositive_f32)):
        np.testing.assert_array_equal(_bits(a), _bits(b))


def test_compress_pool_with_knockout_weights_keeps_the_bytes(rng):
    """compress_pool with the decode update's one-token weights form gives the reference's
    bytes and scales for random pools, pools with tied gates and pools with far-apart gates
    (both forms jitted: eager dispatch of the numerics' many small ops is slow on the CPU)."""
    n = 1024
    keys = [jnp.asarray(_random_f32(rng, n * 128, -3, 3).reshape(n, 128)).astype(jnp.bfloat16) for _ in range(4)]
    g = rng.normal(0, 2, (4, n, 128)).astype(F32)
    g[:, : n // 4] = rng.integers(-1, 2, (4, n // 4, 128))                   # ties, +-0
    g[:, n // 4: n // 2] *= 40                                                 # weights near 0
    gates = [jnp.asarray(g[j]).astype(jnp.bfloat16) for j in range(4)]
    apes = [jnp.asarray(rng.normal(0, 1, 128).astype(F32) * (j % 2)) for j in range(4)]   # two zero rows
    base = [np.asarray(a) for a in jax.jit(nm.compress_pool)(keys, gates, apes)]
    knock = [np.asarray(a) for a in jax.jit(lambda k, g, a: nm.compress_pool(
        k, g, a, weights=nm.softmax_weights_knockout))(keys, gates, apes)]
    np.testing.assert_array_equal(base[0].view(np.uint8), knock[0].view(np.uint8))
    np.testing.assert_array_equal(_bits(base[1]), _bits(knock[1]))


def test_compress_pool_equals_the_sum_from_zero_with_signed_zero_keys(rng):
    """compress_pool's sum starts from k_0 e_0 (no 0 +): the same fp8 bytes and scales as
    compress_pool_sum_from_zero (tests/numerics_forms.py), for random pools and for pools
    whose keys are all +-0 (where the sum from the product ends at -0 and the sum from 0
    at +0)."""
    import ml_dtypes
    n, r = 512, 4
    k = (rng.standard_normal((n, r, 128)) * np.exp2(rng.uniform(-8, 8, (n, 1, 1)))).astype(ml_dtypes.bfloat16)
    g = (rng.standard_normal((n, r, 128)) * 3).astype(ml_dtypes.bfloat16)
    k[:8] = -0.0                                                    # every product -0
    k[8:16] = rng.choice(np.array([0.0, -0.0], ml_dtypes.bfloat16), (8, r, 128))
    k[16:24, 0] = -0.0                                              # the first product -0, then real ones
    ape = rng.standard_normal((r, 128)).astype(F32)

    def both(k, g, ape):
        args = ([k[:, j] for j in range(r)], [g[:, j] for j in range(r)], [ape[j] for j in range(r)])
        return nm.compress_pool(*args), compress_pool_sum_from_zero(*args)
    (q_got, s_got), (q_zero, s_zero) = jax.jit(both)(jnp.asarray(k), jnp.asarray(g), jnp.asarray(ape))
    np.testing.assert_array_equal(np.asarray(q_got).view(np.uint8), np.asarray(q_zero).view(np.uint8))
    np.testing.assert_array_equal(_bits(s_got), _bits(s_zero))
    # sharp: the two sums do differ in sign for the all -0 pools
    e = jnp.ones((128,), jnp.float32)
    kz = jnp.asarray(k[0, 0]).astype(jnp.float32)
    assert np.all(np.signbit(np.asarray(nm.rounded(kz * e))))
    assert not np.any(np.signbit(np.asarray(nm.mac_bf16(jnp.zeros_like(e), kz, e))))


def test_rounded_keeps_every_value_and_stays_in_the_program(rng):
    """numerics.rounded returns its input's bits for every non-NaN f32 (zeros, subnormals,
    infinities included), and the integer min that forces the multiply to round alone is
    still in the jitted program (XLA did not fold it away)."""
    x = np.concatenate([_random_f32(rng, 50000, -140, 120), -_random_f32(rng, 50000, -140, 120),
                        np.array([0.0, -0.0, np.inf, -np.inf, 2.0**-149, -(2.0**-149)], F32)]).astype(F32)
    got = np.asarray(jax.jit(nm.rounded)(jnp.asarray(x)))
    ok = np.abs(x) >= 2.0**-126                 # XLA on CPU flushes subnormal results
    np.testing.assert_array_equal(_bits(got)[ok], _bits(x)[ok])
    hlo = jax.jit(lambda a, b, c: c + nm.rounded(a * b)).lower(*(jnp.ones(8, F32),) * 3).compile().as_text()
    assert "minimum" in hlo, hlo


def test_mac_bf16_rounds_the_product_on_its_own(rng):
    """mac_bf16 is c + (k*e rounded): the same bits in a plain jit and inside a loop,
    not the fused multiply-add (which differs somewhere), and accurate."""
    n = 50000
    k = _random_f32(rng, n, -20, 20).astype(ml_dtypes.bfloat16).astype(F32)
    e = _random_f32(rng, n, -20, 20)
    c = _random_f32(rng, n, -20, 20)
    sep, fus = _mul_add(k, e, c, False), _mul_add(k, e, c, True)
    assert np.any(_bits(sep) != _bits(fus))
    args = (jnp.asarray(c), jnp.asarray(k), jnp.asarray(e))
    got = np.asarray(jax.jit(nm.mac_bf16)(*args))
    np.testing.assert_array_equal(_bits(got), _bits(sep))
    looped = jax.jit(lambda c, k, e: lax.fori_loop(0, 2, lambda i, a: nm.mac_bf16(c, k, e), c))(*args)
    np.testing.assert_array_equal(_bits(np.asarray(looped)), _bits(sep))
    exact = c.astype(np.float64) + k.astype(np.float64) * e
    scale = np.abs(c).astype(np.float64) + np.abs(k.astype(np.float64) * e)
    assert np.all(np.abs(got - exact) <= 2 * 2.0**-24 * scale)


def test_recip_f32_accuracy(rng):
    b = np.concatenate([
        np.exp2(rng.uniform(-100, 100, 100000)),
        rng.uniform(1, 4, 100000),                       # the softmax denominator range [1, R]
        np.exp2(np.arange(-100, 101)),
        [1.0, 2.0, 3.0, 4.0, 16.0, 1.0000001, 3.9999998],
    ]).astype(F32)
    got = np.asarray(jax.jit(nm.recip_f32)(jnp.asarray(b)))
    want = (1.0 / b.astype(np.float64)).astype(F32)
    ulps = _ulp_diff(got, want)
    assert ulps.max() <= 2, f"max {ulps.max()} ulp at b={b[np.argmax(ulps)]!r}"
    loop = np.asarray(jax.jit(lambda x: lax.fori_loop(0, 2, lambda i, c: nm.recip_f32(x), x))(jnp.asarray(b)))
    np.testing.assert_array_equal(_bits(loop), _bits(got))
    # each Newton step's product b*y rounds on its own (numpy: separate multiply and add)
    y = (np.uint32(0x7EF311C3) - b.view(np.uint32)).view(F32)
    for _ in range(4):
        y = (y * (F32(2) - (b * y).astype(F32))).astype(F32)
    np.testing.assert_array_equal(_bits(got), _bits(y))


def _split12_np(a):
    hi = (np.asarray(a, F32).view(np.uint32) & np.uint32(0xFFFFF000)).view(np.float32)
    return hi, (a - hi).astype(F32)


def test_split12_is_made_from_the_bits_of_its_operand(rng):
    """numerics._split12 gives a - hi exactly (signed zeros and subnormals included),
    and its lo never subtracts from the operand itself: a compiler that contracts
    multiply-adds would subtract hi from the UNROUNDED product that made the
    operand (Triton did, in recip_f32's Newton steps: 21 of 65,536 pools off)."""
    n = 50000
    a = np.concatenate([_random_f32(rng, n, -30, 30), _random_f32(rng, 64, -140, -126),
                        np.array([0.0, -0.0, 1.0, -1.0, 2.0**-149, -(2.0**-149)], F32)]).astype(F32)
    hi, lo = jax.jit(nm._split12)(jnp.asarray(a))
    want_hi, want_lo = _split12_np(a)
    normal = np.abs(a) >= 2.0**-100               # numpy keeps subnormals, XLA on CPU flushes them
    np.testing.assert_array_equal(_bits(np.asarray(hi)), _bits(want_hi))
    np.testing.assert_array_equal(_bits(np.asarray(lo))[normal], _bits(want_lo)[normal])
    # everywhere, subnormals included: the same bits as a plain a - hi on this backend
    plain_lo = jax.jit(lambda a: a - nm._split12(a)[0])(jnp.asarray(a))
    np.testing.assert_array_equal(_bits(np.asarray(lo)), _bits(np.asarray(plain_lo)))
    # structure: every float subtraction reads bitcasts only, never the operand
    jaxpr = jax.make_jaxpr(nm._split12)(jnp.float32(1.5)).jaxpr
    made = {v: e.primitive.name for e in jaxpr.eqns for v in e.outvars}
    subs = [e for e in jaxpr.eqns if e.primitive.name == "sub"]
    assert subs and all(made.get(v) == "bitcast_convert_type" for e in subs for v in e.invars), jaxpr
    # why: with the product x*y unrounded (as an FMA sees it), x*y - hi is not lo
    x = _random_f32(rng, n, -10, 10)
    y = _random_f32(rng, n, -10, 10)
    p64 = x.astype(np.float64) * y
    p = p64.astype(F32)
    h, _ = _split12_np(p)
    contracted = (p64 - h).astype(F32)
    lo = _split12_np(p)[1]
    assert np.any(_bits(contracted) != _bits(lo)), "contraction should matter for some products"
    np.testing.assert_array_equal(_bits(np.asarray(jax.jit(nm._split12)(jnp.asarray(p))[1])), _bits(lo))


def test_mac_exact_partial_products(rng):
    n = 50000
    a = _random_f32(rng, n, -30, 30)
    b = _random_f32(rng, n, -30, 30)
    c = _random_f32(rng, n, -30, 30)
    ah, al = _split12_np(a)
    bh, bl = _split12_np(b)
    # the split is exact and each half has <= 12 significant bits
    assert np.all(ah.astype(np.float64) + al == a.astype(np.float64))
    for part in (ah, al, bh, bl):
        m, _ = np.frexp(part.astype(np.float64))
        assert np.all(m * 2**12 == np.round(m * 2**12))
    # every partial product is exact in f32 (so FMA contraction cannot change a bit)
    for x, y in ((ah, bh), (ah, bl), (al, bh), (al, bl)):
        assert np.all((x * y).astype(np.float64) == x.astype(np.float64) * y.astype(np.float64))
    # the jitted mac equals the step-by-step f32 evaluation bit for bit
    want = ((c + ah * bh).astype(F32) + (ah * bl + al * bh).astype(F32)).astype(F32) + (al * bl)
    want = want.astype(F32)
    got = np.asarray(jax.jit(nm.mac)(jnp.asarray(c), jnp.asarray(a), jnp.asarray(b)))
    np.testing.assert_array_equal(_bits(got), _bits(want))
    # and it is an accurate c + a*b
    exact = c.astype(np.float64) + a.astype(np.float64) * b.astype(np.float64)
    scale = np.abs(c).astype(np.float64) + np.abs(a.astype(np.float64) * b)
    assert np.all(np.abs(got - exact) <= 3 * 2.0**-24 * scale)
    # same bits when the products are contracted with the adds in another context
    in_loop = jax.jit(lambda c, a, b: lax.fori_loop(0, 2, lambda i, acc: nm.mac(c, a, b), c))
    np.testing.assert_array_equal(_bits(in_loop(jnp.asarray(c), jnp.asarray(a), jnp.asarray(b))), _bits(want))


# ---------------------------------------------------------------------------------
# query side: fwht_quant_rows vs a float64 re-derivation
# ---------------------------------------------------------------------------------
def test_fwht_quant_rows_vs_float64(rng):
    rows = 300
    q = (rng.standard_normal((rows, 128)) * np.exp2(rng.uniform(-12, 12, (rows, 1)))).astype(ml_dtypes.bfloat16)
    q[0] = 0
    q[1, :] = 0
    q[1, 5] = 2.5                                   # flat spectrum: every output +-2.5/sqrt(128)
    q8, scale = jax.jit(nm.fwht_quant_rows)(jnp.asarray(q))
    q8, scale = np.asarray(q8), np.asarray(scale)
    assert q8.dtype == ml_dtypes.float8_e4m3fn and q8.shape == (rows, 128) and scale.shape == (rows,)
    y = q.astype(np.float64) @ _hadamard_matrix64() / math.sqrt(128)
    deq = q8.astype(np.float64) * scale[:, None]
    tol = (2.0**-4 + 2.0**-8) * np.abs(y) + scale[:, None] * 2.0**-10
    assert np.all(np.abs(deq - y) <= tol)
    assert np.all(_is_pow2(scale))
    amax = np.maximum(np.abs(y).max(-1), 1e-4)
    want_scale = np.exp2(np.ceil(np.log2(amax / 448)))
    # equal except where the bf16 rounding of y crosses a power-of-two boundary: ~1 % of
    # random rows (7 of 300 = 2.3 % for GLM5_SEED=364332028, so a 98 % bound was flaky);
    # the exact rule is the bit-for-bit comparison with the numpy model below
    assert np.mean(scale == want_scale) > 0.9
    assert np.all((scale == want_scale) | (scale == 2 * want_scale) | (scale == want_scale / 2))
    assert scale[0] == F32(2.0**-22) and np.all(q8[0].astype(np.float32) == 0)
    np.testing.assert_array_equal(np.abs(deq[1]), np.full(128, np.abs(deq[1, 0])))
    # == numpy: butterfly in f32, * 1/sqrt(128), bf16 round, pow2 scale, e4m3 round (RNE)
    y32 = _butterfly_np(q.astype(F32)) * F32(nm.INV_SQRT_128)
    yb = y32.astype(F32).astype(ml_dtypes.bfloat16).astype(F32)
    s_np = np.asarray(nm.pow2_scale(jnp.asarray(np.abs(yb).max(-1)))[0])
    np.testing.assert_array_equal(_bits(scale), _bits(s_np))
    want8 = np.clip(yb / s_np[:, None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(q8.view(np.uint8), want8.view(np.uint8))


# ---------------------------------------------------------------------------------
# the whole pool compression: same bits in any context
# ---------------------------------------------------------------------------------
def test_compress_pool_context_independent(rng):
    from glm5_jax.testing import random_ape, random_rows
    R, m = 4, 96
    k = jnp.asarray(random_rows(rng, m * R).reshape(m, R, 128))
    g = jnp.asarray(random_rows(rng, m * R).reshape(m, R, 128))
    ape = jnp.asarray(random_ape(rng, R))

    def pools(k, g):
        return nm.compress_pool([k[..., j, :] for j in range(R)], [g[..., j, :] for j in range(R)],
                                [ape[j] for j in range(R)])

    q_ref, s_ref = jax.jit(pools)(k, g)
    q_vm, s_vm = jax.jit(jax.vmap(pools))(k[:, None], g[:, None])
    q_loop, s_loop = jax.jit(lambda k, g: lax.fori_loop(0, 2, lambda i, c: pools(k, g), pools(k, g)))(k, g)
    q_half, s_half = jax.jit(pools)(k[: m // 2], g[: m // 2])
    for name, q, s in (("vmap", q_vm[:, 0], s_vm[:, 0]), ("fori_loop", q_loop, s_loop)):
        np.testing.assert_array_equal(np.asarray(q).view(np.uint8), np.asarray(q_ref).view(np.uint8), err_msg=name)
        np.testing.assert_array_equal(_bits(s), _bits(s_ref), err_msg=name)
    np.testing.assert_array_equal(np.asarray(q_half).view(np.uint8), np.asarray(q_ref)[: m // 2].view(np.uint8))
    assert np.all(_is_pow2(np.asarray(s_ref)))


# ---------------------------------------------------------------------------------
# the Triton FMA-contraction mismatch: 16 pools saved from an H200
# ---------------------------------------------------------------------------------
def _saved_pools():
    import ml_dtypes
    path = pathlib.Path(__file__).parent / "data" / "triton_fma_pools.npz"
    d = np.load(path)
    n = sum(1 for f in d.files if f.startswith("golden"))
    as_f32 = lambda a: a.view(ml_dtypes.bfloat16).astype(F32)                      # noqa: E731
    return d, [(as_f32(d[f"k{j}"]), as_f32(d[f"g{j}"])) for j in range(n)]


def _newton_recip_contracted(b):
    """recip_f32_newton_mac as Triton compiled it with FMA contraction and the split
    lo = a - hi: each Newton step's split subtracts hi from the UNROUNDED
    product y * t (float64 holds it exactly)."""
    y = (np.uint32(0x7EF311C3) - b.view(np.uint32)).view(F32)
    exact = y.astype(np.float64)
    for _ in range(4):
        hi = (y.view(np.uint32) & np.uint32(0xFFFFF000)).view(F32)
        lo = (exact - hi.astype(np.float64)).astype(F32)
        nb = (-b).astype(F32)
        bh = (nb.view(np.uint32) & np.uint32(0xFFFFF000)).view(F32)
        bl = (nb - bh).astype(F32)
        t = (((F32(2) + bh * hi).astype(F32) + (bh * lo + bl * hi).astype(F32)).astype(F32) + bl * lo).astype(F32)
        exact = y.astype(np.float64) * t.astype(np.float64)
        y = exact.astype(F32)
    return y


# The numerics the pools were saved with: ``exp_f32_taylor9`` (tests/numerics_forms.py)
# and the pooled sum with four-product ``mac`` steps, whose bits differ from numerics'
# exp_f32 / mac_bf16.
def _saved_pools_softmax_pool(k, g, ape, recip):
    """The pooling of k, g [4, 128] (bf16-valued f32) in the numerics the pools were
    saved with: the bf16-rounded x."""
    s = [jnp.asarray((g[i] + ape[i]).astype(F32)) for i in range(4)]
    m = s[0]
    for i in range(1, 4):
        m = jnp.maximum(m, s[i])
    e = [exp_f32_taylor9(s[i] - m) for i in range(4)]
    den = e[0]
    acc = nm.mac(jnp.zeros(128, jnp.float32), jnp.asarray(k[0]), e[0])
    for i in range(1, 4):
        den = den + e[i]
        acc = nm.mac(acc, jnp.asarray(k[i]), e[i])
    return nm.round_bf16(jnp.asarray(np.asarray(acc) * recip(np.asarray(den))))


def test_saved_triton_fma_pools_root_cause():
    """Pools the Triton compress got wrong on the H200 with FMA contraction: the
    reference gives the golden bytes (the XLA, Pallas and contraction-off Triton
    bytes), and a numpy model of the contracted Newton step of recip_f32 reproduces
    the wrong bytes exactly, which pins the cause on lo = a - hi of a product."""
    d, pools = _saved_pools()
    ape = d["ape"].astype(F32)
    recip = lambda den: np.asarray(recip_f32_newton_mac(jnp.asarray(den)))     # noqa: E731
    for j, (k, g) in enumerate(pools):
        q8, _ = nm.rotate_quant(_saved_pools_softmax_pool(k, g, ape, recip))
        got = np.asarray(q8).view(np.uint8)
        np.testing.assert_array_equal(got, d[f"golden{j}"], err_msg=f"pool {j}")
        np.testing.assert_array_equal(got, d[f"triton_nofma{j}"], err_msg=f"pool {j}")
        assert (d[f"triton_fma{j}"] != got).any()
        # the same pooling with the contracted reciprocal
        q8c, _ = nm.rotate_quant(_saved_pools_softmax_pool(k, g, ape, _newton_recip_contracted))
        np.testing.assert_array_equal(np.asarray(q8c).view(np.uint8), d[f"triton_fma{j}"], err_msg=f"pool {j}")


def test_word_packing_keeps_byte_order_and_its_parts_form(rng):
    """pack_fp8_words / pack_bf16_words put element i of a row at byte i of the row's
    little-endian words (the cache's byte layout), and their keep_parts form (the decode
    update's stores at one token per request) repeats each of those words along
    the axis of its parts: every part holds the whole word."""
    raw = rng.integers(0, 256, (3, 5, 256), dtype=np.uint8)
    q8 = jnp.asarray(raw[..., :128].copy().view(ml_dtypes.float8_e4m3fn))
    x = jnp.asarray(raw.copy().view(ml_dtypes.bfloat16))                            # [3, 5, 128]
    for pack, v, words, parts, want in ((nm.pack_fp8_words, q8, 32, 4, raw[..., :128]),
                                        (nm.pack_bf16_words, x, 64, 2, raw)):
        w = np.asarray(pack(v))
        assert w.shape == (3, 5, words) and w.dtype == np.uint32
        np.testing.assert_array_equal(w.astype("<u4").view(np.uint8), want)
        kept = np.asarray(pack(v, keep_parts=True))
        assert kept.shape == (3, 5, words, parts)
        for p in range(parts):
            np.testing.assert_array_equal(kept[..., p], w)
