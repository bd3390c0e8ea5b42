"""Kernel: x @ w as one ordered chain (``glm5_jax.invariant.linear`` / ``linear_f32``).

out[m, n] = (...((0 + x[m, 0] w[0, n]) + x[m, 1] w[1, n]) + ...) + x[m, K-1] w[K-1, n]
in f32, the contraction index ascending. Every product is exact: bf16 x bf16 has
at most 16 significant bits (mode "bf16"), and an f32 x f32 product goes through
``numerics.mac``'s four exact partial products (mode "f32"). An FMA and a
multiply-then-add therefore round the same, so the bits equal the XLA chain's on
every backend, and a row's result depends neither on the other rows nor on the
tile shape (batch invariance, glm5_jax.invariant).

Why a kernel: the XLA chain is a fori_loop whose body the GPU runtime launches
from the host once per iteration; the serving step of bench_scaleout runs ~900
such iterations for its projections alone (docs/design.md, "Toward 1.8x"). One
launch per projection replaces them. Not yet measured on the GPU:
``invariant.CONTRACTIONS`` selects it ("xla" by default).

Reads ONLY x [M, K] and w [K, N]; writes ONLY out [M, N] f32 (lanes past M or N
are masked). Grid: (ceil(M / BM), ceil(N / BN)), one [BM, BN] output tile per
program, walking K in order.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from . import _backend as B
from . import numerics as nm

TILE_ROWS = 32             # BM
TILE_COLS = 64             # BN
MODES = ("bf16", "f32")


def _kernel(x_ref, w_ref, o_ref, *, m: int, n: int, k: int, bm: int, bn: int, mode: str):
    # x_ref [M, K] (bf16 or f32), w_ref [K, N] (same dtype), o_ref [M, N] f32
    rows = B.program_id(0) * bm + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)         # [BM, 1]
    cols = B.program_id(1) * bn + lax.broadcasted_iota(jnp.int32, (1, bn), 1)         # [1, BN]
    rc, cc = jnp.minimum(rows, m - 1), jnp.minimum(cols, n - 1)                      # in range

    def step(t, acc):                                                                # acc [BM, BN] f32
        xt = B.gather(x_ref, rc, 0 * rc + t).astype(jnp.float32)                     # [BM, 1]
        wt = B.gather(w_ref, 0 * cc + t, cc).astype(jnp.float32)                     # [1, BN]
        if mode == "bf16":
            return acc + xt * wt                                                     # exact product
        return nm.mac(acc, jnp.broadcast_to(xt, acc.shape), jnp.broadcast_to(wt, acc.shape))

    acc = lax.fori_loop(0, k, step, jnp.zeros((bm, bn), jnp.float32))
    r2, c2 = rc + 0 * cc, cc + 0 * rc                                                # [BM, BN]
    B.scatter(o_ref, r2, c2, acc, (rows < m) & (cols < n))


@functools.partial(jax.jit, static_argnames=("mode", "interpret", "tile", "num_warps"))
def ordered_linear(x, w, *, mode: str, interpret=None, tile=(TILE_ROWS, TILE_COLS), num_warps: int = 4):
    """x [M, K], w [K, N] (bf16 for mode "bf16", f32 for "f32") -> [M, N] f32, the
    contraction in ascending order with exact products (module docstring)."""
    if mode not in MODES:
        raise ValueError(f"ordered_linear: mode must be one of {MODES}, got {mode!r}")
    want = jnp.bfloat16 if mode == "bf16" else jnp.float32
    if x.dtype != want or w.dtype != want:
        raise ValueError(f"ordered_linear: mode {mode!r} needs {jnp.dtype(want).name} operands, "
                         f"got {x.dtype} and {w.dtype}")
    (m, k), (k2, n) = x.shape, w.shape
    if k != k2:
        raise ValueError(f"ordered_linear: x [{m}, {k}] does not match w [{k2}, {n}]")
    if m == 0 or n == 0 or k == 0:
        return jnp.zeros((m, n), jnp.float32)
    bm, bn = tile
    return B.pallas_call(
        functools.partial(_kernel, m=m, n=n, k=k, bm=bm, bn=bn, mode=mode),
        grid=(-(-m // bm), -(-n // bn)),
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        input_output_aliases={}, interpret=interpret, name=f"ordered_linear_{mode}", num_warps=num_warps,
    )(x, w)
