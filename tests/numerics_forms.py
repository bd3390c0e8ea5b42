"""Second derivations of the shared numerics, for tests/test_numerics.py.

Each function computes something that ``pallas_kernels.core.numerics`` also computes,
by a different sequence of operations. Where the two must give the same bits, the
test that compares them shows that the shipped form's cheaper operations change no
bit. Where they give other bits, the form is what produced a saved artefact
(tests/data/triton_fma_pools.npz) and the test needs it to rebuild those bytes.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.core import numerics as nm


def _exp_reduction_by_conversion(d, lookup=None):
    """(r, k, T[k & 63]) of d clamped to [-87, 88], with k = floor(d * EXP_SCALE) by a
    float-to-int conversion (``numerics._exp_clamped`` reads k from the bits of
    kf + 1.5 * 2**23 instead)."""
    lookup = nm.exp_table_lookup if lookup is None else lookup
    d = jnp.clip(d, -87.0, 88.0)
    kf = jnp.floor(d * nm.EXP_SCALE)
    r = ((d - kf * nm.EXP_L1) - kf * nm.EXP_L2) - kf * nm.EXP_L3
    k = kf.astype(jnp.int32)
    return r, k, lookup(k & (nm.EXP_TABLE_SIZE - 1))


def exp_f32_by_conversion(d, lookup=None):
    """e**d with ``numerics.exp_f32``'s table, polynomial and separately rounded products,
    but k from a float-to-int conversion and 2**(k >> 6) built from k and multiplied in:
    both clamps, no bit tricks. Must give ``exp_f32``'s bits, and ``exp_nonpositive_f32``'s
    for d <= 0."""
    r, k, t = _exp_reduction_by_conversion(d, lookup)
    q = r * (1.0 + nm.rounded(r * (0.5 + nm.rounded(r * nm.EXP_C6))))
    e = t + nm.rounded(t * q)
    return e * nm._f32((((k >> nm.EXP_TABLE_BITS) + 127) << 23).astype(jnp.uint32))


def compress_pool_sum_from_zero(keys, gates, ape_rows, exp_lookup=None):
    """``numerics.compress_pool`` with the exps of ``exp_f32_by_conversion`` and the pooled
    sum started from 0 + k_0 e_0 (``compress_pool`` starts from the product k_0 e_0, so an
    all -0 pool sums to -0 instead of +0). Must give ``compress_pool``'s bytes and scales:
    the Hadamard maps -0 to +0 first."""
    r = len(keys)
    s = [gates[j].astype(jnp.float32) + ape_rows[j] for j in range(r)]
    m = s[0]
    for j in range(1, r):
        m = jnp.maximum(m, s[j])
    e = [exp_f32_by_conversion(s[j] - m, exp_lookup) for j in range(r)]
    den = e[0]
    acc = nm.mac_bf16(jnp.zeros_like(e[0]), keys[0].astype(jnp.float32), e[0])
    for j in range(1, r):
        den = den + e[j]
        acc = nm.mac_bf16(acc, keys[j].astype(jnp.float32), e[j])
    return nm.rotate_quant(nm.round_bf16(acc * nm.recip_f32(den)))


def hadamard128_constant_geometry(x):
    """The unnormalised Hadamard-128 of the last axis by seven constant-geometry stages:
    each multiplies the values, viewed as [..., 1, 64, 2], by the 2x2 Hadamard's +-1
    and sums the pairs with an XLA reduction (which starts from +0, so no output is -0).
    Must give ``numerics.hadamard128``'s bits for normal inputs and signed zeros."""
    lead = x.shape[:-1]
    n = len(lead)
    shape3 = lead + (2, 64, 2)
    s_idx = jax.lax.broadcasted_iota(jnp.int32, shape3, n)
    j_idx = jax.lax.broadcasted_iota(jnp.int32, shape3, n + 2)
    sign = jnp.where((s_idx & j_idx) == 1, -1.0, 1.0).astype(jnp.float32)     # the 2x2 Hadamard
    for _ in range(7):
        x = jnp.sum(x.reshape(lead + (1, 64, 2)) * sign, axis=-1).reshape(lead + (nm.HEAD_DIM,))
    return x


def recip_f32_newton_mac(b):
    """1 / b by the bit-trick seed and 4 Newton steps y * (2 - b y), each 2 - b y from
    ``numerics.mac``'s four exact partial products (``recip_f32`` rounds the product b y
    on its own instead: other bits). The reciprocal the saved Triton FMA pools were
    computed with."""
    y = nm._f32(np.uint32(0x7EF311C3) - nm._u32(b))
    for _ in range(4):
        y = y * nm.mac(jnp.float32(2.0), -b, y)
    return y


# exp by a degree-9 Taylor polynomial of exact four-product ``mac`` steps after a ln 2
# reduction: the exp the saved Triton FMA pools were computed with (other bits than
# ``exp_f32``'s table form).
_TAYLOR_LN2_HI = 0.693145751953125                  # 16 bits: n * LN2_HI exact for |n| < 256
_TAYLOR_LN2_LO = nm._short(0.6931471805599453 - _TAYLOR_LN2_HI)
_TAYLOR_COEFFS = tuple(1.0 / math.factorial(k) for k in range(10))


def exp_f32_taylor9(d):
    """e**d for d clamped to [-87, 88]: d = n ln 2 + r, a degree-9 Taylor polynomial of r
    by Horner steps of ``numerics.mac``, times 2**n from the exponent bits."""
    d = jnp.clip(d, -87.0, 88.0)
    n = jnp.floor(d * nm.LOG2E)
    r = (d - n * _TAYLOR_LN2_HI) - n * _TAYLOR_LN2_LO
    p = jnp.full_like(r, _TAYLOR_COEFFS[9])
    for c in _TAYLOR_COEFFS[8::-1]:
        p = nm.mac(jnp.float32(c), p, r)
    return p * nm._f32(((n.astype(jnp.int32) + 127) << 23).astype(jnp.uint32))
