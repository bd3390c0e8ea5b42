"""Kernel: query FWHT + fp8 quantisation (docs/semantics.md 2.3, 5.1).

Reads ONLY the [rows, 128] bf16 query rows; writes ONLY its two outputs
(q8 [rows, 128] float8_e4m3fn and scale [rows] f32). No cache access.

Grid: one program per TILE_ROWS rows (vLLM uses 32 rows per program). Each
program loads its tile (rows past the end masked), runs the Hadamard-128
rotation, bf16 rounding, power-of-two scaling and the clipped e4m3 cast through
``numerics.fwht_quant_rows`` (the same float operations as the XLA reference,
so the bits match), and stores q8 and the scale with the same row mask.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from ..core import backend as B
from ..core import numerics as nm

TILE_ROWS = 32


def _kernel(q_ref, q8_ref, scale_ref, *, rows: int):
    # q_ref: [rows, 128] bf16; q8_ref: [rows, 128] e4m3fn; scale_ref: [rows] f32
    p = B.program_id(0)
    r = p * TILE_ROWS + lax.broadcasted_iota(jnp.int32, (TILE_ROWS,), 0)            # [TILE]
    ok = r < rows
    rc = jnp.minimum(r, rows - 1)
    col = lax.broadcasted_iota(jnp.int32, (TILE_ROWS, nm.HEAD_DIM), 1)              # [TILE, 128]
    r2 = rc[:, None] + 0 * col
    m2 = ok[:, None] & (col >= 0)
    q = B.gather(q_ref, r2, col, mask=m2, other=0)                                  # [TILE, 128] bf16
    q8, scale = nm.fwht_quant_rows(q)                                               # [TILE,128], [TILE]
    B.scatter(q8_ref, r2, col, q8, m2)
    # masked lanes parked past the end (never aliased with a real lane's address)
    B.store(scale_ref.at[jnp.where(ok, r, rows)], scale, mask=ok)


@functools.partial(jax.jit, static_argnames=("interpret",))
def fwht_quant(q, *, interpret=None):
    """q: [rows, 128] bf16 -> (q8 [rows, 128] float8_e4m3fn, scale [rows] f32)."""
    rows = q.shape[0]
    if rows == 0:
        return jnp.zeros((0, 128), nm.FP8), jnp.zeros((0,), jnp.float32)
    return B.pallas_call(
        functools.partial(_kernel, rows=rows),
        grid=(-(-rows // TILE_ROWS),),
        out_shape=(jax.ShapeDtypeStruct((rows, nm.HEAD_DIM), nm.FP8),
                   jax.ShapeDtypeStruct((rows,), jnp.float32)),
        input_output_aliases={},
        interpret=interpret, name="kpool_query_quant", num_warps=4,
    )(q.astype(jnp.bfloat16))
