"""Batch-invariant dense math for the model side (indexer projections, tiny decoder).

Why: the serving loop must give the same bits for a token whatever else is in
its batch. A prefix-cache hit recomputes only a suffix, a chunked prefill cuts a
prompt at arbitrary tokens, a decode step has one row per request; the cache
bytes of a request (fp8 pools, tail ring, attention K/V) and its selected tokens
must not depend on any of that. XLA's dot and row reductions do not promise this:
measured on CPU (jax 0.10.2), ``x[:m] @ w`` in f32 differs from ``(x @ w)[:m]`` for
m = 2 .. 33, bf16 dots differ at m = 1, and ``jnp.sum(x, -1)`` differs for m <= 8
(a different reduction strategy per shape); ``sum(x[:, :, None] * w)`` is rewritten
into the same dot.

So every contraction here is an explicit, fixed-order chain of elementwise
operations over the contraction axis (a ``fori_loop``, or on a GPU a Pallas kernel
doing the same operations in the same order: ``CONTRACTIONS``), whose products are
exact:

* ``linear`` takes bf16 operands: a bf16 x bf16 product has at most 16
  significant bits, exact in f32, so an FMA and a multiply-then-add round the
  same and the result is independent of contraction decisions;
* f32 x f32 products use ``pallas_kernels.core.numerics.mac`` (four exact partial
  products);
* sums without products use a fixed pairwise tree of slice adds;
* exp and reciprocal are the project's deterministic ``exp_f32`` / ``recip_f32``.

Each output element therefore sees the same operations in the same order for
any batch shape, fusion context or backend.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.core import numerics as nm

# Steps per fori_loop iteration of an ordered chain (python-unrolled inside). Measured
# on the H200 with bench_scaleout (docs/benchmarks.md): the host launches a loop body
# once per iteration, so with 8 a serving step's dispatch takes about as long as its
# device work (~25 ms of ~27); 64 cuts the dispatch to 4.6 ms but the device part grows
# to ~52 ms (the long unrolled bodies run slower) and throughput falls from 11.1k to
# 6.6k tokens/s. The unroll changes no bit either way.
UNROLL = 8
# Who runs the contractions (linear, linear_f32, batched_linear, sum_sq_last): "xla"
# (the fori_loop chains here), "pallas" (one kernel per contraction,
# pallas_kernels/contractions/ordered_linear.py and ordered_sumsq.py: the same operations in the
# same order, so the same bits, with one launch instead of K / UNROLL host-launched
# loop iterations) or "auto": "pallas" on a GPU, "xla" elsewhere (on the CPU the
# kernels run in interpret mode, far slower than the loops). Measured on the H200 with
# bench_scaleout (docs/benchmarks.md): with every contraction in a kernel a serving
# step's dispatch falls from 26 to 1.1 ms and one GPU serves 34 % more tokens/s; the bits
# equal the chains' (tests/test_gpu.py, and the engine test serving the same
# tokens and cache bytes).
CONTRACTIONS = "auto"
CONTRACTION_MODES = ("auto", "xla", "pallas")
# What "pallas" moves into kernels: "linear" (the projections, ordered_linear.py),
# "attention" (the sparse attention's scores and weighted sum, ordered_linear.py
# batched over tokens) and "norms" (the sums of squares of RMSNorm / LayerNorm,
# ordered_sumsq.py). Every subset gives the same bits; bench_scaleout --kernels
# compares their speed.
PALLAS_KERNELS = ("linear", "attention", "norms")


def contractions() -> str:
    """The effective choice, "xla" or "pallas" (``CONTRACTIONS`` with "auto" resolved
    for the default backend)."""
    if CONTRACTIONS not in CONTRACTION_MODES:
        raise ValueError(f"invariant.CONTRACTIONS must be one of {CONTRACTION_MODES}, got {CONTRACTIONS!r}")
    if CONTRACTIONS == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return CONTRACTIONS


def kernel_for(kind: str) -> bool:
    """Whether the contractions of ``kind`` (one of "linear", "attention", "norms")
    run as Pallas kernels now."""
    return contractions() == "pallas" and kind in PALLAS_KERNELS


def _ordered_chain(n: int, term, init, *, unroll: int | None = None):
    """acc = init; for j in 0..n-1: acc = step(acc, j), in order.

    ``term(acc, j)`` returns the new accumulator (j a traced int32). The loop is a
    fori_loop over groups of ``unroll`` (default: ``UNROLL``) steps, python-unrolled
    inside. The unroll changes no bit (the same operations in the
    same order; tests/test_indexer.py checks it).
    """
    unroll = UNROLL if unroll is None else unroll
    groups, rest = divmod(n, unroll)

    def body(g, acc):
        for u in range(unroll):
            acc = term(acc, g * unroll + u)
        return acc

    acc = lax.fori_loop(0, groups, body, init) if groups else init
    for u in range(rest):
        acc = term(acc, jnp.int32(groups * unroll + u))
    return acc


def linear(x, w_t):
    """x [..., K] bf16 @ w_t [K, N] bf16 -> [..., N] f32, sequential over K.

    ``w_t`` is the transposed torch-layout weight (``W.T`` of a [N, K] weight).
    """
    if x.dtype != jnp.bfloat16 or w_t.dtype != jnp.bfloat16:
        raise ValueError(f"linear: operands must be bf16 (exact products), got {x.dtype} and {w_t.dtype}")
    k = x.shape[-1]
    if w_t.shape[0] != k:
        raise ValueError(f"linear: x [..., {k}] does not match weight [{w_t.shape[0]}, ...]")
    lead = x.shape[:-1]
    if kernel_for("linear"):
        from pallas_kernels.contractions.ordered_linear import ordered_linear
        return ordered_linear(x.reshape(-1, k), w_t, mode="bf16").reshape(lead + (w_t.shape[1],))
    x2 = x.reshape(-1, k).astype(jnp.float32)
    wf = w_t.astype(jnp.float32)

    def step(acc, j):
        xj = lax.dynamic_index_in_dim(x2, j, axis=1, keepdims=True)      # [M, 1]
        wj = lax.dynamic_index_in_dim(wf, j, axis=0, keepdims=True)      # [1, N]
        return acc + xj * wj

    out = _ordered_chain(k, step, jnp.zeros((x2.shape[0], w_t.shape[1]), jnp.float32))
    return out.reshape(lead + (w_t.shape[1],))


def linear_multi(x, weights_t):
    """Several ``linear``s of the same x in one loop: the weights are concatenated
    along N (each output column is computed exactly as by ``linear``)."""
    sizes = [w.shape[1] for w in weights_t]
    out = linear(x, jnp.concatenate(list(weights_t), axis=1) if len(weights_t) > 1 else weights_t[0])
    parts, k = [], 0
    for n in sizes:
        parts.append(out[..., k:k + n])
        k += n
    return parts


def linear_f32(x, w_t):
    """x [..., K] f32 @ w_t [K, N] f32 -> [..., N] f32, exact-product mac chain over K."""
    k = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).astype(jnp.float32)
    wf = w_t.astype(jnp.float32)
    if kernel_for("linear"):
        from pallas_kernels.contractions.ordered_linear import ordered_linear
        return ordered_linear(x2, wf, mode="f32").reshape(lead + (w_t.shape[1],))

    def step(acc, j):
        xj = lax.dynamic_index_in_dim(x2, j, axis=1, keepdims=True)
        wj = lax.dynamic_index_in_dim(wf, j, axis=0, keepdims=True)
        return nm.mac(acc, jnp.broadcast_to(xj, acc.shape), jnp.broadcast_to(wj, acc.shape))

    out = _ordered_chain(k, step, jnp.zeros((x2.shape[0], w_t.shape[1]), jnp.float32))
    return out.reshape(lead + (w_t.shape[1],))


def contract(n: int, a_of, b_of, out_shape, *, exact_products: bool = True):
    """sum_j a_of(j) * b_of(j) over j = 0..n-1 in order; a_of/b_of give arrays
    broadcastable to out_shape (f32). ``exact_products`` promises the products
    are exact (bf16-valued operands); otherwise ``mac`` is used."""
    def step(acc, j):
        a = jnp.broadcast_to(a_of(j).astype(jnp.float32), out_shape)
        b = jnp.broadcast_to(b_of(j).astype(jnp.float32), out_shape)
        return acc + a * b if exact_products else nm.mac(acc, a, b)

    return _ordered_chain(n, step, jnp.zeros(out_shape, jnp.float32))


def sum_last(x):
    """Sum over the last axis by a fixed pairwise tree of slice adds (f32)."""
    x = x.astype(jnp.float32)
    n = x.shape[-1]
    p = 1 << max(0, (n - 1).bit_length())
    if p != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, p - n)])
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def batched_linear(a, b, *, b_transposed: bool = False):
    """a [G, M, K] bf16 @ b [G, K, N] bf16 (b [G, N, K] with ``b_transposed``) ->
    [G, M, N] f32: G independent ordered chains over K with exact products (the
    attention's scores and weighted sum, one product per token)."""
    if a.dtype != jnp.bfloat16 or b.dtype != jnp.bfloat16:
        raise ValueError(f"batched_linear: operands must be bf16 (exact products), got {a.dtype} and {b.dtype}")
    g, m, k = a.shape
    n, kb = (b.shape[1], b.shape[2]) if b_transposed else (b.shape[2], b.shape[1])
    if b.shape[0] != g or kb != k:
        raise ValueError(f"batched_linear: a {a.shape} does not match b {b.shape}"
                         f"{' (transposed)' if b_transposed else ''}")
    if kernel_for("attention"):
        from pallas_kernels.contractions.ordered_linear import ordered_linear
        return ordered_linear(a, b, mode="bf16", w_transposed=b_transposed)
    if b_transposed:
        def b_of(j):
            return lax.dynamic_index_in_dim(b, j, 2, keepdims=False)[:, None, :]       # [G, 1, N]
    else:
        def b_of(j):
            return lax.dynamic_index_in_dim(b, j, 1, keepdims=True)                    # [G, 1, N]
    return contract(k, lambda j: lax.dynamic_index_in_dim(a, j, 2, keepdims=True), b_of, (g, m, n))


def sum_sq_last(x):
    """sum_j x_j**2 over the last axis, exact-product mac chain (f32)."""
    x = x.astype(jnp.float32)
    n = x.shape[-1]
    if kernel_for("norms"):
        from pallas_kernels.contractions.ordered_sumsq import ordered_sumsq
        return ordered_sumsq(x.reshape(-1, n)).reshape(x.shape[:-1])

    def step(acc, j):
        xj = lax.dynamic_index_in_dim(x, j, axis=x.ndim - 1, keepdims=False)
        return nm.mac(acc, xj, xj)

    return _ordered_chain(n, step, jnp.zeros(x.shape[:-1], jnp.float32))


def rsqrt(v):
    """1 / sqrt(v) for positive v: IEEE sqrt, then the deterministic reciprocal."""
    return nm.recip_f32(jnp.sqrt(v))


def rms_norm(x, weight, eps: float):
    """RMSNorm in f32: x * rsqrt(mean(x^2) + eps) * weight."""
    x = x.astype(jnp.float32)
    ms = sum_sq_last(x) / jnp.float32(x.shape[-1])
    return x * rsqrt(ms + jnp.float32(eps))[..., None] * weight.astype(jnp.float32)


def layer_norm(x, weight, bias, eps: float):
    """LayerNorm in f32 over the last axis, with weight and bias."""
    x = x.astype(jnp.float32)
    n = x.shape[-1]
    mean = sum_last(x) / jnp.float32(n)
    d = x - mean[..., None]
    var = sum_sq_last(d) / jnp.float32(n)
    return d * rsqrt(var + jnp.float32(eps))[..., None] * weight.astype(jnp.float32) \
        + bias.astype(jnp.float32)


def silu(x):
    """x * sigmoid(x) in f32 with the deterministic exp and reciprocal."""
    x = x.astype(jnp.float32)
    return x * nm.recip_f32(1.0 + nm.exp_f32(-x))


def masked_softmax(scores, mask):
    """Softmax over the last axis of f32 scores where mask; rows with no True give 0."""
    s = jnp.where(mask, scores, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)                 # max is exact in any order
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(mask, nm.exp_f32(s - m), 0.0)
    den = sum_last(e)[..., None]
    return jnp.where(den > 0, e * nm.recip_f32(jnp.maximum(den, 1e-30)), 0.0)


def bf16(x):
    """Round to bf16 (nearest, ties to even) as a bf16 array, with integer ops.

    Not ``x.astype(bfloat16)`` alone: XLA on the GPU drops an f32 -> bf16 -> f32
    round trip when it may keep excess precision (``xla_allow_excess_precision``,
    on by default), so a consumer computing in f32 would see the unrounded value: the
    products of ``linear``'s chain would no longer be exact, and the Pallas projection
    kernel (which receives a real bf16 array) would give other bits (on the H200;
    tests/scripts/gpu_numerics_diag.py shows whether XLA keeps the round trip). Rounded
    by ``numerics.round_bf16`` first, the value is bf16-exact whether or not XLA keeps
    the round trip.
    """
    if x.dtype == jnp.bfloat16:
        return x
    return nm.round_bf16(x.astype(jnp.float32)).astype(jnp.bfloat16)


__all__ = ["linear", "linear_multi", "linear_f32", "batched_linear", "contract", "sum_last", "sum_sq_last",
           "rms_norm", "layer_norm", "silu", "masked_softmax", "rsqrt", "bf16"]