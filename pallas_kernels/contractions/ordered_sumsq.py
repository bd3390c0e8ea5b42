"""Kernel: sum_j x[m, j]**2 as one ordered chain (``glm5_jax.model.invariant.sum_sq_last``).

out[m] = mac(...mac(mac(0, x[m, 0], x[m, 0]), x[m, 1], x[m, 1])..., x[m, K-1], x[m, K-1])
in f32, j ascending, each square through ``numerics.mac``'s four exact partial
products: the same operations in the same order as the XLA chain, so the same
bits on every backend and for any batch (glm5_jax.model.invariant). The norms of the
model (RMSNorm, the indexer's LayerNorm) call it once per norm instead of the XLA
chain's K / UNROLL host-launched loop iterations.

Reads ONLY x [M, K] f32; writes ONLY out [M] f32 (rows past M masked). Grid:
(ceil(M / BM),), one block of BM rows per program, walking K in order.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ..core import backend as B
from ..core import numerics as nm

TILE_ROWS = 64             # BM
UNROLL = 4                 # K steps per loop iteration


def _kernel(x_ref, o_ref, *, m: int, k: int, bm: int, unroll: int):
    # x_ref [M, K] f32; o_ref [M, 1] f32
    rows = B.program_id(0) * bm + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)        # [BM, 1]
    rc = jnp.minimum(rows, m - 1)

    def one(t, acc):                                                                # acc [BM, 1] f32
        xt = B.gather(x_ref, rc, 0 * rc + t)
        return nm.mac(acc, xt, xt)

    def group(i, acc):
        for u in range(unroll):
            acc = one(i * unroll + u, acc)
        return acc

    groups, rest = divmod(k, unroll)
    acc = lax.fori_loop(0, groups, group, jnp.zeros((bm, 1), jnp.float32))
    for u in range(rest):
        acc = one(groups * unroll + u, acc)
    B.scatter(o_ref, rc, 0 * rc, acc, rows < m)


@functools.partial(jax.jit, static_argnames=("interpret", "tile_rows", "unroll", "num_warps"))
def ordered_sumsq(x, *, interpret=None, tile_rows: int = TILE_ROWS, unroll: int = UNROLL, num_warps: int = 4):
    """x [M, K] f32 -> [M] f32, sum of squares over K in ascending order (module docstring)."""
    if x.dtype != jnp.float32 or x.ndim != 2:
        raise ValueError(f"ordered_sumsq: x must be a 2-D float32 array, got {x.dtype} {x.shape}")
    if unroll < 1:
        raise ValueError(f"ordered_sumsq: unroll must be >= 1, got {unroll}")
    m, k = x.shape
    if m == 0 or k == 0:
        return jnp.zeros((m,), jnp.float32)
    out = B.pallas_call(
        functools.partial(_kernel, m=m, k=k, bm=tile_rows, unroll=unroll),
        grid=(-(-m // tile_rows),),
        out_shape=jax.ShapeDtypeStruct((m, 1), jnp.float32),
        input_output_aliases={}, interpret=interpret, name="ordered_sumsq", num_warps=num_warps,
    )(x)
    return out[:, 0]
