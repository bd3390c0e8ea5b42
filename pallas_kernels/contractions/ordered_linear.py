"""Kernel: x @ w as one ordered chain (``glm5_jax.model.invariant.linear`` / ``linear_f32``
/ ``batched_linear``).

out[g, m, n] = (...((0 + x[g, m, 0] w[g, 0, n]) + x[g, m, 1] w[g, 1, n]) + ...) + x[g, m, K-1] w[g, K-1, n]
in f32, the contraction index ascending. Every product is exact: bf16 x bf16 has
at most 16 significant bits (mode "bf16"), and an f32 x f32 product goes through
``numerics.mac``'s four exact partial products (mode "f32"). An FMA and a
multiply-then-add therefore round the same, so the bits equal the XLA chain's on
every backend, and a row's result depends neither on the other rows nor on the
tile shape (batch invariance, glm5_jax.model.invariant).

Why a kernel: the XLA chain is a fori_loop whose body the GPU runtime launches
from the host once per iteration; the serving step of bench_scaleout ran ~1,800
such iterations (docs/design.md, "Toward 1.8x"). One launch per contraction
replaces them. On the H200, with the projections in this kernel a step's dispatch
takes 12 ms instead of 26 and the 2-GPU scale-out is 1.88x instead of 1.81x
(docs/benchmarks.md).

Operands: x [M, K] or [G, M, K]; w [K, N] or [G, K, N], or with
``w_transposed`` [N, K] / [G, N, K] (the attention's scores read K rows as they
are gathered, without a transposed copy). A leading G is a batch of independent
products (the attention: one per token).

``ordered_linear_rows`` is the same chain with w read as packed bf16 rows of a
u32 table (the cache's K / V rows, element 2c in the low half of word c), picked
per token by a row index (-1: a zero row): the sparse attention reads the rows
where the cache holds them, without a gathered [T, W, head_dim] copy. Each element
enters the chain as the f32 of its bits (the bf16 -> f32 conversion), so the bits
equal ``ordered_linear`` on the gathered rows.

Reads ONLY x and w (or rows and the table's rows they name); writes ONLY out
[G, M, N] f32 (lanes past M or N are masked). Grid: (G, ceil(M / BM), ceil(N / BN)),
one [BM, BN] output tile per program, walking K in order, ``unroll`` steps per loop
iteration (the same operations in the same order: the unroll only lets the loads of
several steps be in flight together).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..core import backend as B
from ..core import numerics as nm

TILE_ROWS = 32             # BM
TILE_COLS = 64             # BN
TILE_COLS_TRANSPOSED = 128 # BN with w_transposed (the attention's scores: N = the selected tokens)
UNROLL = 16                # K steps per loop iteration, compiled
UNROLL_INTERPRET = 4       # ... in interpret mode (the CPU: a shorter loop body to trace and compile)
# The compiled defaults, measured on the H200 at the serving step's shapes (2,064 tokens;
# device spans, bits compared first; docs/benchmarks.md, "Ordered contraction kernels"):
# unroll 16 instead of 4 makes the attention's weighted sum (K = 2,051) 1.21x faster, the
# LM head and the indexer's q projection 1.08-1.10x; 128-wide tiles make the attention's
# scores (w_transposed, N = 2,051) 1.59x faster than 64-wide ones.
ROWS_NUM_WARPS = 2         # ordered_linear_rows, H200 at the step's sizes (docs/benchmarks.md):
                           # 2 warps 1.24x (weighted sum) and 1.08x (scores) faster than 4;
                           # 8 warps and unroll 8 / 32 slower or within 8 %
MODES = ("bf16", "f32")


def _kernel(*refs, m: int, n: int, k: int, bm: int, bn: int, mode: str, wt: bool, unroll: int,
            packed: bool = False):
    # x_ref [G*M, K]; w_ref [G*K, N] (or [G*N, K] when wt); o_ref [G*M, N] f32
    # packed: x_ref, rows_ref [G, N] (wt) or [G, K] i32, w_ref [R, row_words] u32, o_ref
    if packed:
        x_ref, rows_ref, w_ref, o_ref = refs
    else:
        (x_ref, w_ref, o_ref), rows_ref = refs, None
    g = B.program_id(0)
    rows = B.program_id(1) * bm + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)        # [BM, 1]
    cols = B.program_id(2) * bn + lax.broadcasted_iota(jnp.int32, (1, bn), 1)        # [1, BN]
    rc, cc = jnp.minimum(rows, m - 1), jnp.minimum(cols, n - 1)                     # in range
    xr = g * m + rc                                                                 # rows of x_ref
    wr = g * n + cc if wt else None                                                 # rows of w_ref (wt)
    if packed and wt:                                   # the table rows of this tile's columns, once
        wr = B.gather(rows_ref, 0 * cc + g, cc)                                     # [1, BN]
        w_live = (wr >= 0) & (wr < w_ref.shape[0])
        wr = jnp.where(w_live, wr, 0)

    def w_step(t):                                                                  # [1, BN] of w's step t
        if not packed:
            if wt:
                return B.gather(w_ref, wr, 0 * wr + t)
            return B.gather(w_ref, 0 * cc + g * k + t, cc)
        if wt:                                          # element t of each column's row: word t >> 1
            word = B.gather(w_ref, wr, 0 * wr + (t >> 1), mask=w_live)
            return _bf16_half(word, t & 1)
        r = rows_ref[g, t]                              # the row of step t (a scalar)
        live = (r >= 0) & (r < w_ref.shape[0])
        word = B.gather(w_ref, 0 * cc + jnp.where(live, r, 0), cc >> 1, mask=live & (cc >= 0))
        return _bf16_half(word, cc & 1)

    def one(t, acc):                                                                # acc [BM, BN] f32
        xt = B.gather(x_ref, xr, 0 * xr + t).astype(jnp.float32)                    # [BM, 1]
        wv = w_step(t).astype(jnp.float32)
        if mode == "bf16":
            return acc + xt * wv                                                    # exact product
        return nm.mac(acc, jnp.broadcast_to(xt, acc.shape), jnp.broadcast_to(wv, acc.shape))

    def group(i, acc):
        for u in range(unroll):
            acc = one(i * unroll + u, acc)
        return acc

    groups, rest = divmod(k, unroll)
    acc = lax.fori_loop(0, groups, group, jnp.zeros((bm, bn), jnp.float32))
    for u in range(rest):
        acc = one(groups * unroll + u, acc)
    r2, c2 = g * m + rc + 0 * cc, cc + 0 * rc                                         # [BM, BN]
    B.scatter(o_ref, r2, c2, acc, (rows < m) & (cols < n))


def _bf16_half(word, half):
    """The bf16 in half `half` (0: low) of u32 words, as its f32 (the bits moved to the top)."""
    bits = jnp.where(half == 0, word << np.uint32(16), word & np.uint32(0xFFFF0000))
    return lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)


def _tile_side(v: int, cap: int, floor: int = 16) -> int:
    """The smallest power of two >= v, kept within [floor, cap]: a tile side that
    covers a small M or N without idle lanes beyond the next power of two."""
    p = floor
    while p < cap and p < v:
        p *= 2
    return p


def _launch(*inputs, g: int, m: int, n: int, k: int, mode: str, wt: bool, packed: bool, name: str,
            interpret, tile, num_warps: int, unroll):
    """The [G * M, N] f32 result of ``_kernel`` on `inputs` (its refs but the output): the
    unroll (None: UNROLL compiled, UNROLL_INTERPRET in interpret mode) checked, the tile
    (None: the defaults of ``ordered_linear``) and the grid (G, M / BM, N / BN)."""
    interpret = B.resolve_interpret(interpret)
    unroll = (UNROLL_INTERPRET if interpret else UNROLL) if unroll is None else unroll
    if unroll < 1:
        raise ValueError(f"{name}: unroll must be >= 1, got {unroll}")
    if g == 0 or m == 0 or n == 0 or k == 0:
        return jnp.zeros((g * m, n), jnp.float32)
    bm, bn = tile if tile is not None else (_tile_side(m, TILE_ROWS),
                                            _tile_side(n, TILE_COLS_TRANSPOSED if wt else TILE_COLS))
    return B.pallas_call(
        functools.partial(_kernel, m=m, n=n, k=k, bm=bm, bn=bn, mode=mode, wt=wt, unroll=unroll, packed=packed),
        grid=(g, -(-m // bm), -(-n // bn)),
        out_shape=jax.ShapeDtypeStruct((g * m, n), jnp.float32),
        input_output_aliases={}, interpret=interpret, name=name, num_warps=num_warps,
    )(*inputs)


@functools.partial(jax.jit, static_argnames=("mode", "interpret", "tile", "num_warps", "w_transposed", "unroll"))
def ordered_linear(x, w, *, mode: str, interpret=None, tile=None, num_warps: int = 4, w_transposed: bool = False,
                   unroll: int | None = None):
    """x [M, K] or [G, M, K], w [K, N] or [G, K, N] ([N, K] / [G, N, K] with
    ``w_transposed``), both bf16 (mode "bf16") or f32 (mode "f32") -> [M, N] or
    [G, M, N] f32: each contraction in ascending order with exact products (module
    docstring). ``tile`` (BM, BN) defaults to (32, 64) ((32, 128) with ``w_transposed``),
    narrowed to powers of two >= 16 that cover small M / N; ``unroll`` to UNROLL
    compiled, UNROLL_INTERPRET in interpret mode. The bits are the same for any."""
    if mode not in MODES:
        raise ValueError(f"ordered_linear: mode must be one of {MODES}, got {mode!r}")
    want = jnp.bfloat16 if mode == "bf16" else jnp.float32
    if x.dtype != want or w.dtype != want:
        raise ValueError(f"ordered_linear: mode {mode!r} needs {jnp.dtype(want).name} operands, "
                         f"got {x.dtype} and {w.dtype}")
    if x.ndim not in (2, 3) or w.ndim != x.ndim:
        raise ValueError(f"ordered_linear: x and w must both be 2-D or both 3-D, got {x.shape} and {w.shape}")
    batched = x.ndim == 3
    x3, w3 = (x, w) if batched else (x[None], w[None])
    g, m, k = x3.shape
    n = w3.shape[1] if w_transposed else w3.shape[2]
    kw = w3.shape[2] if w_transposed else w3.shape[1]
    if w3.shape[0] != g or kw != k:
        raise ValueError(f"ordered_linear: x {x.shape} does not match w {w.shape}"
                         f"{' (transposed)' if w_transposed else ''}")
    shape = (g, m, n) if batched else (m, n)
    out = _launch(x3.reshape(g * m, k), w3.reshape(w3.shape[0] * w3.shape[1], w3.shape[2]), g=g, m=m, n=n, k=k,
                  mode=mode, wt=w_transposed, packed=False, name=f"ordered_linear_{mode}", interpret=interpret,
                  tile=tile, num_warps=num_warps, unroll=unroll)
    return out.reshape(shape)


@functools.partial(jax.jit, static_argnames=("w_transposed", "interpret", "tile", "num_warps", "unroll"))
def ordered_linear_rows(x, table, rows, *, w_transposed: bool, interpret=None, tile=None,
                        num_warps: int = ROWS_NUM_WARPS, unroll: int | None = None):
    """``ordered_linear(x, w, mode="bf16", w_transposed=...)`` with w's rows read from a table.

    x [G, M, K] bf16; table [R, row_words] u32, each row 2 * row_words bf16 (element 2c
    in the low half of word c); rows int32, -1 (or any id outside [0, R)) for a zero row:
    * ``w_transposed``: rows [G, N], w[g, n, :] = table row rows[g, n] (K = 2 * row_words);
    * else: rows [G, K], w[g, j, :] = table row rows[g, j] (N = 2 * row_words).
    Returns [G, M, N] f32 with the bits of ``ordered_linear`` on those w (module
    docstring). ``tile`` and ``unroll`` as there."""
    if x.dtype != jnp.bfloat16 or x.ndim != 3:
        raise ValueError(f"ordered_linear_rows: x must be [G, M, K] bfloat16, got {x.shape} {x.dtype}")
    if table.dtype != jnp.uint32 or table.ndim != 2:
        raise ValueError(f"ordered_linear_rows: table must be [R, row_words] uint32, got {table.shape} {table.dtype}")
    if rows.ndim != 2 or not jnp.issubdtype(rows.dtype, jnp.integer):
        raise ValueError(f"ordered_linear_rows: rows must be a 2-D integer array, got {rows.shape} {rows.dtype}")
    g, m, k = x.shape
    row_elems = 2 * table.shape[1]
    if w_transposed:
        n, want_rows = rows.shape[1], (g, rows.shape[1])
        if k != row_elems:
            raise ValueError(f"ordered_linear_rows: x's K = {k} must be the table rows' {row_elems} elements")
    else:
        n, want_rows = row_elems, (g, k)
    if rows.shape != want_rows:
        raise ValueError(f"ordered_linear_rows: rows {rows.shape} does not match x {x.shape} "
                         f"({'[G, N]' if w_transposed else '[G, K]'} expected)")
    out = _launch(x.reshape(g * m, k), rows.astype(jnp.int32), table, g=g, m=m, n=n, k=k, mode="bf16",
                  wt=w_transposed, packed=True, name="ordered_linear_rows", interpret=interpret, tile=tile,
                  num_warps=num_warps, unroll=unroll)
    return out.reshape(g, m, n)
