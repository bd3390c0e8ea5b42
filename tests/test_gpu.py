"""GPU-only checks of the compiled kernels: in-place updates (no cache copy in
the compiled HLO, same buffer), caches larger than 2 and 4 GiB with writes past
byte 2**31, and out-of-range slots that must not write (interpret mode clamps
out-of-bounds accesses, so only a GPU run proves these)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import ops, reference as ref
from glm5_jax.config import IndexerConfig
from glm5_jax.layout import CacheLayout
from write_cases import (assert_pools_golden, assert_updates_in_place, large_layout, last_blocks_scenario,
                         many_pools_case, write_ops)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("op", ["compress_prefill", "seed_tail", "decode_update"])
def test_in_place_no_copy(rng, op):
    layout = CacheLayout(IndexerConfig(), num_layers=2, num_blocks=64)
    assert_updates_in_place(write_ops(rng, layout, "pallas")[op], layout)


@pytest.mark.parametrize("gib", [3, 5])
def test_large_cache_writes_past_2gib(rng, gib):
    """A cache of `gib` GiB whose last layer starts past byte 2**31: pallas == reference."""
    blocks = 4096
    layout, layer = large_layout(gib, blocks)
    assert layout.index_base_bytes(layer) >= 2**31
    sc = last_blocks_scenario(rng, layout, layer, [2000, 999, 5])          # request 0 in the very last blocks
    pre = sc.prefill([1990, 999, 5])
    st = sc.decode([1990, 999, 5], [4, 0, 0], 4)
    out = {}
    for impl in ("xla", "pallas"):
        c = layout.allocate(0x5A)
        a = {k: jnp.asarray(v) for k, v in pre.items()}
        c = ops.compress_prefill(c, layout, layer, a["key"], a["gate"], jnp.asarray(sc.ape), a["slot_mapping"],
                                 implementation=impl)
        c = ops.seed_tail(c, layout, layer, a["key"], a["gate"], a["tslot"], implementation=impl)
        d = {k: jnp.asarray(v) for k, v in st.items()}
        c = ops.decode_update(c, layout, layer, d["key"], d["gate"], jnp.asarray(sc.ape), d["slot_mapping"],
                              d["tslot"], d["positions"], implementation=impl)
        out[impl] = c
    ndiff = int(jnp.sum(out["xla"] != out["pallas"]))
    assert ndiff == 0, f"{ndiff} words differ between the kernels and the reference"
    # something was written past byte 2**31, inside the last blocks
    lo = layout.block_byte_range(layer, blocks - 3)[0] // 4
    assert lo * 4 >= 2**31
    assert int(jnp.sum(out["pallas"][lo:] != jnp.uint32(0x5A5A5A5A))) > 0


@pytest.mark.parametrize("gib", [3, 5])
def test_large_cache_reads_past_2gib(rng, gib):
    """The read kernels on the last pages of a `gib` GiB cache (keys past byte 2**31;
    past 2**32 at 5 GiB): paged_logits == the XLA reference, and the fused logits ->
    top-k == top-k of those logits. At 3 GiB the keys come through the word view (a
    byte view faults past byte 2**31 there), at 5 GiB through the byte view."""
    from pallas_kernels.core import addressing as addr
    from pallas_kernels.read.paged_logits import key_source
    from pallas_kernels.read.paged_topk import paged_topk
    from test_read_path import fp8_bytes, random_queries
    blocks = 4096
    layout, layer = large_layout(gib, blocks)
    s = layout.strides(layer)
    assert key_source(s) == (gib == 5)
    p, n_pages = s.page_rows, addr.num_pages(s)
    pages = np.arange(n_pages - 8, n_pages, dtype=np.int64)                   # the layer's last 8 pages
    page_r, row_r = np.repeat(pages, p), np.tile(np.arange(p), pages.size)
    kw = addr.global_word(s, addr.page_key_words(s, page_r, row_r))[:, None] + np.arange(addr.KEY_WORDS)
    sw = addr.global_word(s, addr.page_scale_words(s, page_r, row_r))
    assert kw.min() * 4 >= 2**31 and (gib < 5 or kw.max() * 4 >= 2**32)
    keys = fp8_bytes(rng, (page_r.size, 128)).view(np.uint32).reshape(-1)
    scales = (np.exp2(rng.integers(-12, -4, page_r.size)) * rng.uniform(1, 2, page_r.size)).astype(np.float32)
    r, c = addr.view_row_col(np.concatenate([kw.reshape(-1), sw]))
    view = layout.allocate(0x3C).reshape(addr.view_shape(s))
    view = view.at[jnp.asarray(r, jnp.int32), jnp.asarray(c, jnp.int32)].set(
        jnp.asarray(np.concatenate([keys, scales.view(np.uint32)])))
    cache = view.reshape(-1)
    del view
    q8, wf = random_queries(rng, 2, 2, 32)
    table = jnp.asarray(pages.reshape(2, 4).astype(np.int32))
    ctx = jnp.asarray([[4 * p, 3 * p + 5], [2 * p - 1, 4 * p]], jnp.int32)
    a = np.asarray(ops.paged_logits(cache, layout, layer, q8, wf, table, ctx, implementation="pallas"))
    want = np.asarray(ops.paged_logits(cache, layout, layer, q8, wf, table, ctx, implementation="xla"))
    np.testing.assert_array_equal(np.isneginf(a), np.isneginf(want))
    fin = np.isfinite(want)
    assert fin.sum() == int(np.asarray(ctx).sum())
    np.testing.assert_allclose(a[fin], want[fin], rtol=1e-5, atol=1e-5 * np.abs(want[fin]).max())
    got = np.asarray(paged_topk(cache, s, q8, wf, table, ctx, 16))
    np.testing.assert_array_equal(got.reshape(4, 16),
                                  np.asarray(ref.topk_pools(jnp.asarray(a.reshape(4, -1)), ctx.reshape(-1), 16)))


def test_out_of_range_slots_never_write(rng):
    """Slots past the last block (docs/semantics.md B8) and padding write nothing, compiled."""
    layout = CacheLayout(IndexerConfig(), num_layers=1, num_blocks=8)
    t = 64
    key = jnp.asarray(rng.standard_normal((t, 128)), jnp.bfloat16)
    big = np.array([8 * 288, 10**6, 2**31 - 1, -1, -5], np.int32)
    slot = jnp.asarray(np.resize(big, t))
    tslot = jnp.asarray(np.resize(np.array([8 * 4, 8 * 4 + 3, 10**7, -1], np.int32), t))
    c0 = layout.allocate(0x33)
    c = ops.compress_prefill(c0, layout, 0, key, key, jnp.zeros((4, 128), jnp.float32), slot,
                             implementation="pallas")
    c = ops.seed_tail(c, layout, 0, key, key, tslot, implementation="pallas")
    pos = jnp.asarray(np.resize(np.array([3, 7, 11, -1], np.int32), (16, 4)))
    c = ops.decode_update(c, layout, 0, key[:64].reshape(16, 4, 128), key[:64].reshape(16, 4, 128),
                          jnp.zeros((4, 128), jnp.float32), slot.reshape(16, 4), tslot.reshape(16, 4), pos,
                          implementation="pallas")
    assert int(jnp.sum(c != jnp.uint32(0x33333333))) == 0


def test_compress_many_pools_matches_golden(rng):
    """65,536 fresh random pools through the compiled Pallas kernel == the golden model."""
    layout, sc, pre = many_pools_case(rng)
    c = ops.compress_prefill(layout.allocate(0x5A), layout, 0, pre["key"], pre["gate"], jnp.asarray(sc.ape),
                             pre["slot_mapping"], implementation="pallas")
    assert_pools_golden(c, layout, sc, "pallas compress")


def test_read_path_never_waits_on_the_host(rng):
    """topk_pools compiled for the GPU (filter mode, its fallback under a lax.cond)
    has no loop at which XLA's GPU runtime waits for the device (a while loop
    without a known trip count): the serving step's dispatch is not held."""
    from glm5_jax.serving import sharding
    from pallas_kernels.topk import topk_pools
    scores = jnp.asarray(rng.standard_normal((8, 4096)), jnp.float32)
    lengths = jnp.asarray(rng.integers(0, 4097, 8), jnp.int32)
    text = jax.jit(topk_pools, static_argnames="k").lower(scores, lengths, k=512).compile().as_text()
    assert "triton" in text                                # the kernels are compiled, not interpreted
    assert sharding.host_waits(text) == []


@pytest.mark.parametrize("mode, n", [("bf16", 640), ("f32", 32)])
def test_ordered_linear_compiled_equals_the_chain(rng, monkeypatch, mode, n):
    """The projection kernel compiled for the GPU gives the XLA chain's bits at the
    serving step's sizes (2,064 tokens, K = 512)."""
    from glm5_jax.model import invariant as inv
    from pallas_kernels.contractions.ordered_linear import ordered_linear
    monkeypatch.setattr(inv, "CONTRACTIONS", "xla")        # the chain ("auto" is the kernel on a GPU)
    dt = jnp.bfloat16 if mode == "bf16" else jnp.float32
    x = jnp.asarray(rng.standard_normal((2064, 512)) * (1.0 if mode == "bf16" else 1.37), dt)
    w = jnp.asarray(rng.standard_normal((512, n)) * 0.05, dt)
    chain = inv.linear if mode == "bf16" else inv.linear_f32
    want = np.asarray(jax.jit(chain)(x, w)).view(np.uint32)
    got = np.asarray(ordered_linear(x, w, mode=mode)).view(np.uint32)
    assert (got != want).sum() == 0, f"{(got != want).sum()} of {want.size} words differ"


def test_attention_and_norm_kernels_compiled_equal_the_chains(rng, monkeypatch):
    """The attention's per-token products (scores with the K rows as gathered, then
    the weighted sum over 2,051 selected tokens) and the norms' sums of squares,
    compiled for the GPU, give the XLA chains' bits at the serving step's sizes."""
    from glm5_jax.model import invariant as inv
    from pallas_kernels.contractions.ordered_linear import ordered_linear
    from pallas_kernels.contractions.ordered_sumsq import ordered_sumsq
    monkeypatch.setattr(inv, "CONTRACTIONS", "xla")
    t, nh, hd, w = 300, 4, 64, 2051
    q = jnp.asarray(rng.standard_normal((t, nh, hd)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((t, w, hd)) * 0.1, jnp.bfloat16)
    p = jnp.asarray(rng.uniform(0, 1e-3, (t, nh, w)), jnp.bfloat16)
    for name, a, b, tr in (("scores", q, k, True), ("weighted sum", p, k, False)):
        want = np.asarray(jax.jit(functools.partial(inv.batched_linear, b_transposed=tr))(a, b)).view(np.uint32)
        got = np.asarray(ordered_linear(a, b, mode="bf16", w_transposed=tr)).view(np.uint32)
        assert (got != want).sum() == 0, f"{name}: {(got != want).sum()} of {want.size} words differ"
    x = jnp.asarray(rng.standard_normal((2064, 256)) * np.exp2(rng.integers(-8, 8, (2064, 1))), jnp.float32)
    want = np.asarray(jax.jit(inv.sum_sq_last)(x)).view(np.uint32)
    got = np.asarray(ordered_sumsq(x)).view(np.uint32)
    assert (got != want).sum() == 0, f"sum of squares: {(got != want).sum()} of {want.size} words differ"


def test_attention_rows_kernels_compiled_equal_the_gathered_rows(rng):
    """The attention's contractions reading K / V rows from a packed table by index
    (``ordered_linear_rows``, what the serving step runs on a GPU), compiled, give the
    bits of ``ordered_linear`` on the rows gathered beforehand, at the serving step's
    sizes (2,051 selected tokens, head_dim 64), with -1 rows (zeros), padding tokens and
    dead tails."""
    import ml_dtypes
    from pallas_kernels.contractions.ordered_linear import ordered_linear, ordered_linear_rows
    t, nh, hd, w, n_rows = 300, 8, 64, 2051, 5000
    kv = (rng.standard_normal((n_rows, hd)) * 0.1).astype(ml_dtypes.bfloat16)
    table = jnp.asarray(kv.view(np.uint32))                                   # [R, 32]: element 2c low half
    rows = rng.integers(-1, n_rows, (t, w)).astype(np.int32)
    rows[:40] = -1                                  # padding tokens
    rows[40:80, int(rng.integers(1, w)):] = -1      # dead tails (sorted selections end in -1)
    dense = jnp.asarray(np.where((rows >= 0)[..., None], kv[np.maximum(rows, 0)], 0).astype(ml_dtypes.bfloat16))
    q = jnp.asarray(rng.standard_normal((t, nh, hd)), jnp.bfloat16)
    p = jnp.asarray(rng.uniform(0, 1e-3, (t, nh, w)), jnp.bfloat16)
    for name, a, tr in (("scores", q, True), ("weighted sum", p, False)):
        want = np.asarray(ordered_linear(a, dense, mode="bf16", w_transposed=tr)).view(np.uint32)
        got = np.asarray(ordered_linear_rows(a, table, jnp.asarray(rows), w_transposed=tr)).view(np.uint32)
        assert (got != want).sum() == 0, f"{name}: {(got != want).sum()} of {want.size} words differ"


def test_byte_view_adds_no_copy_of_the_cache(rng):
    """paged_logits reads keys through a u8 byte view of the u32 cache (an XLA
    bitcast): compiled, the program holds no buffer the size of the cache besides
    the cache itself (a materialised view would be a 288 MB copy per call at
    decode), and the byte view really is the path taken."""
    from pallas_kernels.read.paged_logits import key_source, paged_logits
    from test_read_path import random_queries
    layout = CacheLayout(IndexerConfig(), num_layers=2, num_blocks=2048)
    s = layout.strides(1)
    assert key_source(s)
    cache = layout.allocate(0x11)
    q8, wf = random_queries(rng, 4, 1, 32)
    table = jnp.asarray(rng.integers(0, 64, (4, 16)), jnp.int32)
    ctx = jnp.full((4, 1), 16 * s.page_rows, jnp.int32)
    f = jax.jit(functools.partial(paged_logits, s=s))
    compiled = f.lower(cache, q8=q8, weights=wf, page_table_pages=table, context_pools=ctx).compile()
    text = compiled.as_text()
    assert "triton" in text
    mem = compiled.memory_analysis()
    cache_bytes = cache.size * 4
    assert mem.temp_size_in_bytes < cache_bytes // 4, (mem.temp_size_in_bytes, cache_bytes)
    assert mem.output_size_in_bytes < cache_bytes // 4
    n_u8 = [ln for ln in text.splitlines() if " = u8[" in ln and "bitcast" not in ln and "parameter" not in ln]
    assert n_u8 == [], n_u8


def test_mul_rn_is_the_separately_rounded_product(rng):
    """_backend.mul_rn compiled: c + mul_rn(a, b) is the f32 product rounded on its own,
    then the add (numpy's separately rounded steps), on inputs where a fused multiply-add
    would give other bits for many of them (checked against a float64 model of the FMA)."""
    from pallas_kernels.core import backend as B
    n = 4096
    a = (rng.uniform(1, 2, n) * np.exp2(rng.integers(-8, 8, n))).astype(np.float32)
    b = (rng.uniform(1, 2, n) * np.exp2(rng.integers(-8, 8, n))).astype(np.float32)
    c = (-(a.astype(np.float64) * b) * rng.uniform(0.5, 1.5, n)).astype(np.float32)   # cancellation: FMA differs
    mul = B.mul_rn(interpret=False)
    assert mul is not None

    def kernel(a_ref, b_ref, c_ref, o_ref):
        o_ref[...] = c_ref[...] + mul(a_ref[...], b_ref[...])

    out = B.pallas_call(kernel, grid=(1,), out_shape=jax.ShapeDtypeStruct((n,), jnp.float32),
                        input_output_aliases={}, interpret=False, name="mul_rn_check")(
        jnp.asarray(a), jnp.asarray(b), jnp.asarray(c))
    want = c + a * b                                                                  # numpy f32: two roundings
    fused = (c.astype(np.float64) + a.astype(np.float64) * b).astype(np.float32)      # the product exact in f64
    assert int(np.sum(fused.view(np.uint32) != want.view(np.uint32))) > n // 4
    np.testing.assert_array_equal(np.asarray(out).view(np.uint32), want.view(np.uint32))


def _every_class_f32(rng, n):
    """f32 bit patterns of every class but NaN: random bits over all exponents (subnormals
    included), bf16 rounding ties and near-ties, the overflow edge, +-0, +-inf."""
    u = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    u = u[(u & 0x7F800000) != 0x7F800000]                                        # no inf / NaN here
    hi = u & np.uint32(0xFFFF0000)
    ties = np.concatenate([hi | 0x8000, hi | 0x7FFF, hi | 0x8001, (hi | 0x8000) ^ 0x10000])
    ties = ties[(ties & 0x7F800000) != 0x7F800000]
    edge = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000,
                     0x7F7F7FFF, 0x00000001, 0x80000001, 0x00008000, 0x80018000, 0x007FFFFF], np.uint32)
    return np.concatenate([edge, ties, u]).view(np.float32)


def _run_elementwise(f, *xs):
    from pallas_kernels.core import backend as B
    n = xs[0].size

    def kernel(*refs):
        refs[-1][...] = f(*(r[...] for r in refs[:-1]))
    return np.asarray(B.pallas_call(kernel, grid=(1,), out_shape=jax.ShapeDtypeStruct((n,), jnp.float32),
                                    input_output_aliases={}, interpret=False, name="elementwise_check")(
        *(jnp.asarray(x) for x in xs)))


def test_bf16_round_rn_and_plus_zero_rn_keep_the_numerics_bits(rng):
    """_backend.bf16_round_rn and plus_zero_rn compiled (one PTX instruction each) give the
    bits of numerics.round_bf16 and numerics.positive_zero (XLA, integer forms) for every
    non-NaN f32: subnormals, ties, values that round to +-inf, signed zeros."""
    from pallas_kernels.core import backend as B
    from pallas_kernels.core import numerics as nm
    x = _every_class_f32(rng, 1 << 16)[: 1 << 18]                                 # a power of two (Triton)
    assert x.size == 1 << 18
    rnd, pz = B.bf16_round_rn(interpret=False), B.plus_zero_rn(interpret=False)
    assert rnd is not None and pz is not None
    want = np.asarray(jax.jit(nm.round_bf16)(jnp.asarray(x)))
    got = _run_elementwise(rnd, x)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.isinf(want).sum() >= 4 and np.any(want.view(np.uint32) == 0x80000000)   # the edges are in
    want0 = np.asarray(jax.jit(nm.positive_zero)(jnp.asarray(x)))
    got0 = _run_elementwise(pz, x)
    np.testing.assert_array_equal(got0.view(np.uint32), want0.view(np.uint32))
    assert np.any(x.view(np.uint32) == 0x80000000) and not np.any(got0.view(np.uint32) == 0x80000000)


def test_compiled_fp8_conversion_saturates_like_the_clip(rng):
    """quant_fp8 with saturates=True (no clip: the compiled kernels' form) gives, compiled,
    the bytes and scales of the clipped form (and of XLA's), also where scaled values pass
    +-448: the conversion is cvt.rn.satfinite. Finite rows never scale past 448
    (test_numerics); rows holding +-inf scale to +-inf and must give +-448 (0x7E / 0xFE).
    Rows whose largest value is 448 * 2**k or one ulp away probe the edge."""
    from jax import lax
    from pallas_kernels.core import backend as B
    from pallas_kernels.core import numerics as nm
    m = 256
    y = (rng.standard_normal((m, 128)) * np.exp2(rng.uniform(-20, 20, (m, 1)))).astype(np.float32)
    top = (np.exp2(rng.integers(-10, 10, m)) * 448).astype(np.float32)
    top = np.where(rng.random(m) < 0.5, top, np.nextafter(top, np.float32(np.inf)))
    y[np.arange(m), rng.integers(0, 128, m)] = top * rng.choice(np.array([-1, 1], np.float32), m)
    y[:4, 7] = [np.inf, -np.inf, np.inf, -np.inf]

    def run(saturates):
        def kernel(y_ref, q_ref, s_ref):
            q8, scale = nm.quant_fp8(y_ref[...], saturates=saturates)          # [m, 128], [m]
            q_ref[...] = lax.bitcast_convert_type(q8, jnp.uint8).astype(jnp.int32)
            s_ref[...] = scale
        q, sc = B.pallas_call(kernel, grid=(1,), out_shape=(jax.ShapeDtypeStruct((m, 128), jnp.int32),
                                                            jax.ShapeDtypeStruct((m,), jnp.float32)),
                              input_output_aliases={}, interpret=False, name="fp8_saturation_check")(jnp.asarray(y))
        return np.asarray(q), np.asarray(sc)
    q_sat, s_sat = run(True)
    q_clip, s_clip = run(False)
    np.testing.assert_array_equal(q_sat, q_clip)
    np.testing.assert_array_equal(s_sat.view(np.uint32), s_clip.view(np.uint32))
    q8_xla, s_xla = jax.jit(nm.quant_fp8)(jnp.asarray(y[4:]))                 # XLA: rows without inf
    np.testing.assert_array_equal(q_sat[4:], np.asarray(q8_xla).view(np.uint8).astype(np.int32))
    np.testing.assert_array_equal(s_sat[4:].view(np.uint32), np.asarray(s_xla).view(np.uint32))
    # the edges are in the draw: finite rows reach exactly +-448, the inf rows saturate
    assert np.any(np.abs(y[4:].astype(np.float64) / s_sat[4:, None]) == 448)
    assert np.all(np.isin(q_sat[:4, 7], [0x7E, 0xFE]))
