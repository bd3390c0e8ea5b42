"""Read path: query quantisation, paged logits, exact top-k over pools, expansion,
and whole token selection. Pallas kernels vs the XLA reference vs numpy oracles
and the paging-free golden model (docs/semantics.md appendix C).

On CPU the kernels run in interpret mode; on a GPU backend the same tests run
them compiled. Logits are f32 sums whose order may differ between Pallas and
XLA, so selections computed from logits are compared as sets, allowing a
difference only between candidates whose reference scores tie with the k-th
best within a tolerance (``assert_selection``); inputs with integer-valued
scores (exact in any order) check tie-breaking exactly.
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from glm5_jax import metadata as md
from glm5_jax import ops
from glm5_jax import reference as ref
from glm5_jax.config import IndexerConfig
from glm5_jax.layout import CacheLayout
from glm5_jax.testing import Scenario
from pallas_kernels.core import addressing as addr

SENTINEL = 0xA5
FP8 = jnp.float8_e4m3fn
# Relative tolerance on logits (relative to the row's largest |score|). On CPU the
# kernels' f32 sums differ from XLA's by an ulp at most. On the H200
# (tests/scripts/gpu_numerics_diag.py) the Pallas logits are within 1.3e-6 of the f64
# golden scores; the XLA reference multiplies bf16 copies of the fp8 arrays (exact
# products, f32 accumulation), since an einsum of the fp8 arrays themselves runs on fp8
# tensor cores with reduced-precision accumulation, up to 1.6e-3 off.
LOGIT_RTOL = 2e-5 if jax.default_backend() == "gpu" else 2e-6


# ---------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------
def fp8_bytes(rng, shape):
    """Random float8_e4m3fn bit patterns, NaN codes (0x7F, 0xFF) excluded."""
    b = rng.integers(0, 256, size=shape, dtype=np.uint8)
    return np.where((b & 0x7F) == 0x7F, b ^ 0x01, b).astype(np.uint8)


def write_pool_records(layout, cache, layer, slots, key_bytes, scales):
    """Host-side write of pool records (128 fp8 bytes + f32 scale) at pool slots."""
    s = layout.strides(layer)
    words = np.array(cache).view(np.uint32).copy()
    slots = np.asarray(slots, np.int64)
    kw = addr.global_word(s, addr.pool_key_words(s, slots))[:, None] + np.arange(addr.KEY_WORDS)
    words[kw] = np.ascontiguousarray(key_bytes, np.uint8).view(np.uint32).reshape(slots.size, 32)
    words[addr.global_word(s, addr.pool_scale_words(s, slots))] = np.asarray(scales, np.float32).view(np.uint32)
    return jnp.asarray(words)


def random_cache(rng, layout, layer=0):
    """Sentinel cache with a random record in every pool slot of `layer`."""
    s = layout.strides(layer)
    n = s.num_pool_slots
    scales = (np.exp2(rng.integers(-12, -4, size=n)) * rng.uniform(1, 2, n)).astype(np.float32)
    return write_pool_records(layout, layout.allocate(SENTINEL), layer, np.arange(n),
                              fp8_bytes(rng, (n, 128)), scales)


_prepare_xla = jax.jit(lambda q, w: ops.prepare_queries(q, w, implementation="xla"))
# the reference, compiled once per shape (eager op-by-op dispatch compiles every op)
ref_logits = jax.jit(ref.paged_logits_strides, static_argnums=1)
ref_topk = jax.jit(ref.topk_pools, static_argnums=2)


def random_queries(rng, b, n, h):
    q = jnp.asarray(rng.standard_normal((b, n, h, 128)) * rng.uniform(0.1, 10, (b, n, h, 1)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((b, n, h)), jnp.float32)
    return _prepare_xla(q, w)


def random_tables(rng, layout, layer, b, max_pages):
    s = layout.strides(layer)
    n_pages = s.num_blocks * s.pages_per_block
    return np.stack([rng.permutation(n_pages)[:max_pages] for _ in range(b)]).astype(np.int32)


def np_topk(x, lengths, k):
    """Oracle: best k ids by (score desc, id asc); -0 == +0; NaN below everything; -1 pad."""
    x = np.asarray(x, np.float64)
    out = np.full((x.shape[0], k), -1, np.int32)
    for r in range(x.shape[0]):
        n = int(np.clip(lengths[r], 0, x.shape[1]))
        v = x[r, :n]
        nan = np.isnan(v)
        order = np.lexsort((np.arange(n), -np.where(nan, 0.0, v), nan))[:k]
        out[r, :order.size] = order
    return out


def np_expand(ids, seq, r):
    rows, k = ids.shape
    out = np.full((rows, k * r + r - 1), -1, np.int32)
    for i in range(rows):
        L = max(int(seq[i]), 0)
        for g in range(k):
            if 0 <= ids[i, g] < L // r:
                out[i, g * r:(g + 1) * r] = ids[i, g] * r + np.arange(r)
        for t in range(L % r):
            out[i, k * r + t] = (L // r) * r + t
    return out


def assert_selection(got, want, scores, lengths, k, rtol=LOGIT_RTOL):
    """got/want [rows, k] pool ids. Valid ids first, -1 only at the end; same set as
    `want` except for candidates tied with the k-th best within rtol; ordered by
    non-increasing score (ties within rtol)."""
    got, want, scores = np.asarray(got), np.asarray(want), np.asarray(scores, np.float64)
    for r in range(got.shape[0]):
        nv = int(min(k, max(int(lengths[r]), 0), scores.shape[1]))
        g, w = got[r], want[r]
        assert (g[:nv] >= 0).all() and (g[nv:] == -1).all(), f"row {r}: -1 not only at the end: {g}"
        assert np.unique(g[:nv]).size == nv, f"row {r}: duplicate ids"
        assert (g[:nv] < lengths[r]).all(), f"row {r}: id past the row's context"
        if nv == 0:
            continue
        sc = scores[r]
        tol = rtol * max(1.0, np.abs(sc[np.isfinite(sc)]).max(initial=0.0))
        diff = set(g[:nv].tolist()) ^ set(w[:nv].tolist())
        bound = sc[w[nv - 1]]
        assert all(abs(sc[x] - bound) <= tol for x in diff), \
            f"row {r}: selections differ beyond near-ties: {sorted(diff)}"
        sg = sc[g[:nv]]
        assert (np.diff(sg) <= tol).all(), f"row {r}: not in descending score order"


def decode_positions(rng, lengths, next_n, counts=None):
    """[B, next_n] positions: request b's last counts[b] tokens (-1 padding after)."""
    b = len(lengths)
    pos = np.full((b, next_n), -1, np.int32)
    for i, L in enumerate(lengths):
        c = next_n if counts is None else counts[i]
        pos[i, :c] = np.arange(L - c, L)
    return pos


# ---------------------------------------------------------------------------------
# query side
# ---------------------------------------------------------------------------------
def test_fwht_quant_pallas_bits(rng):
    q = rng.standard_normal((37, 128)) * np.exp(rng.uniform(-8, 8, (37, 1)))
    q[0] = -0.0                                     # signed zeros: XLA and Triton must agree
    q[1, ::2] = -0.0
    q[1, 1::2] = 0.0
    q[2, rng.integers(0, 128, 30)] = -0.0
    q = jnp.asarray(q, jnp.bfloat16)
    a8, a = ops.fwht_quant(q, implementation="pallas")
    b8, b = ops.fwht_quant(q, implementation="xla")
    np.testing.assert_array_equal(np.asarray(a8).view(np.uint8), np.asarray(b8).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


@pytest.mark.parametrize("h", [16, 32, 64])
def test_fold_weights_and_pad_heads(rng, h):
    hp = ops.padded_heads(h)
    assert hp == (32 if h <= 32 else 64)
    q = jnp.asarray(rng.standard_normal((3, h, 128)), jnp.bfloat16)
    w = rng.standard_normal((3, h)).astype(np.float32)
    q8, wf = _prepare_xla(q, jnp.asarray(w))
    assert q8.shape == (3, hp, 128) and wf.shape == (3, hp)
    raw8, qs = jax.jit(ref.fwht_quant)(q.reshape(-1, 128))
    c = np.float32(128 ** -0.5 * h ** -0.5)                      # the REAL head count
    want = (w * np.asarray(qs).reshape(3, h)) * c
    np.testing.assert_array_equal(np.asarray(wf)[:, :h], want)
    assert (np.asarray(wf)[:, h:] == 0).all()
    b8 = np.asarray(q8).view(np.uint8)
    np.testing.assert_array_equal(b8[:, :h], np.asarray(raw8).view(np.uint8).reshape(3, h, 128))
    assert (b8[:, h:] == 0).all()
    np.testing.assert_array_equal(np.asarray(ops.fold_weights(jnp.asarray(w), qs.reshape(3, h))), np.asarray(wf))
    np.testing.assert_array_equal(np.asarray(ops.pad_heads(raw8.reshape(3, h, 128))).view(np.uint8), b8)


def test_prepare_queries_pallas_matches_xla(rng):
    q = jnp.asarray(rng.standard_normal((2, 3, 16, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((2, 3, 16)), jnp.float32)
    a8, aw = ops.prepare_queries(q, w, implementation="pallas")
    b8, bw = ops.prepare_queries(q, w, implementation="xla")
    np.testing.assert_array_equal(np.asarray(a8).view(np.uint8), np.asarray(b8).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(aw), np.asarray(bw))


# ---------------------------------------------------------------------------------
# paged logits
# ---------------------------------------------------------------------------------
LOGIT_CASES = [
    pytest.param(dict(block_size=1152, next_n=1, heads=32, attn=0), id="P32-n1-H32"),
    pytest.param(dict(block_size=512, next_n=4, heads=64, attn=0), id="P64-n4-H64"),
    # attention blocks of 4 bytes put layer 1's base 8 bytes off a 16-byte boundary:
    # keys must then come through the word view
    pytest.param(dict(block_size=512, next_n=2, heads=32, attn=4), id="P64-n2-H32-unaligned"),
]


def logits_case(rng, case):
    layout = CacheLayout(IndexerConfig(block_size=case["block_size"]), num_layers=2, num_blocks=5,
                         attn_block_bytes=case["attn"])
    cache = random_cache(rng, layout, layer=1)
    s = layout.strides(1)
    b, n, max_pages = 3, case["next_n"], 5
    q8, wf = random_queries(rng, b, n, case["heads"])
    table = random_tables(rng, layout, 1, b, max_pages)
    ctx = rng.integers(0, max_pages * s.page_rows + 1, size=(b, n)).astype(np.int32)
    ctx[0, 0] = 1
    ctx[1, -1] = 0                                               # a padding row
    table[2, -1] = 10**6                                         # never read: past request 2's context
    ctx[2] = np.minimum(ctx[2], (max_pages - 1) * s.page_rows)
    return layout, s, (cache, layout, 1, q8, wf, jnp.asarray(table), jnp.asarray(ctx))


def assert_logits_match(a, want, ctx):
    np.testing.assert_array_equal(np.isneginf(a), np.isneginf(want))
    m = np.arange(a.shape[-1])
    np.testing.assert_array_equal(np.isneginf(want), m[None, None, :] >= ctx[..., None])
    fin = np.isfinite(want)
    np.testing.assert_allclose(a[fin], want[fin], rtol=LOGIT_RTOL, atol=LOGIT_RTOL * np.abs(want[fin]).max())


@pytest.mark.parametrize("case", LOGIT_CASES)
def test_paged_logits_pallas_matches_reference(rng, case):
    layout, s, args = logits_case(rng, case)
    a = np.asarray(ops.paged_logits(*args, implementation="pallas"))
    want = np.asarray(ops.paged_logits(*args, implementation="xla"))
    assert a.shape == want.shape == (3, case["next_n"], 5 * s.page_rows)
    assert_logits_match(a, want, np.asarray(args[-1]))


@pytest.mark.parametrize("case", LOGIT_CASES)
def test_paged_logits_key_sources(rng, case):
    """Keys through the byte view (the default where safe) and through the word view
    give the same logits; the byte view is refused where key rows are not 16-byte
    aligned, and the default then falls back to the words."""
    from pallas_kernels.read.paged_logits import Tuning, key_source, paged_logits
    layout, s, (cache, _, _, q8, wf, table, ctx) = logits_case(rng, case)
    aligned = case["attn"] == 0
    assert key_source(s) == aligned
    out = {}
    for bv in (True, False):
        if bv and not aligned:
            with pytest.raises(ValueError, match="byte view"):
                paged_logits(cache, s, q8, wf, table, ctx, tune=Tuning(byte_view=True))
            continue
        out[bv] = np.asarray(paged_logits(cache, s, q8, wf, table, ctx, tune=Tuning(byte_view=bv)))
    want = np.asarray(ops.paged_logits(cache, layout, 1, q8, wf, table, ctx, implementation="xla"))
    for a in out.values():
        assert_logits_match(a, want, np.asarray(ctx))
    if aligned:
        assert_logits_match(out[True], out[False], np.asarray(ctx))


@pytest.mark.parametrize("case", LOGIT_CASES)
def test_paged_logits_f16_dot(rng, case):
    """The f16 dot form (wgmma on the GPU at 4 warps) gives the reference's logits, and
    the fp8 form's to the same tolerance: fp8 -> f16 is exact, only the order of the
    f32 sums may differ."""
    from pallas_kernels.read.paged_logits import Tuning, paged_logits
    layout, s, (cache, _, _, q8, wf, table, ctx) = logits_case(rng, case)
    a = np.asarray(paged_logits(cache, s, q8, wf, table, ctx, tune=Tuning(num_warps=4, dot="f16")))
    want = np.asarray(ops.paged_logits(cache, layout, 1, q8, wf, table, ctx, implementation="xla"))
    assert_logits_match(a, want, np.asarray(ctx))
    assert_logits_match(a, np.asarray(paged_logits(cache, s, q8, wf, table, ctx)), np.asarray(ctx))
    with pytest.raises(ValueError, match="tuning"):
        Tuning(dot="f16-pools")
    from pallas_kernels.read.paged_topk import paged_topk
    with pytest.raises(ValueError, match="dot must be one of"):
        paged_topk(cache, s, q8, wf, table, ctx, 4, dot="bf16")


def test_paged_logits_default_dot_by_rows():
    """The f16 dot (wgmma) from 64 dot rows (prefill blocks), fp8 below (decode); an
    explicit form wins."""
    from pallas_kernels.read.paged_logits import WGMMA_DOT_ROWS, Tuning
    assert WGMMA_DOT_ROWS == 64
    assert Tuning().dot_for(128) == Tuning().dot_for(64) == "f16"
    assert Tuning().dot_for(32) == "fp8"
    assert Tuning(dot="fp8").dot_for(128) == "fp8" and Tuning(dot="f16").dot_for(32) == "f16"


def test_byte_view_offset_rule():
    """The byte view is used only where the backend indexes every byte correctly:
    at most 2 GiB, or more than 4 GiB (64-bit offsets)."""
    from pallas_kernels.core import backend as _backend
    assert _backend.narrow_offsets_safe(2**31) and _backend.narrow_offsets_safe(2**32 + 4096)
    assert not _backend.narrow_offsets_safe(2**31 + 4096) and not _backend.narrow_offsets_safe(2**32)


def test_paged_logits_rejects_bad_page_tables(rng):
    layout = CacheLayout(IndexerConfig(), num_layers=1, num_blocks=4)
    q8, wf = random_queries(rng, 1, 1, 32)
    cache = layout.allocate(0)
    with pytest.raises(ValueError, match="not a page"):
        ops.paged_logits(cache, layout, 0, q8, wf, jnp.asarray([[1, 99]], jnp.int32),
                         jnp.asarray([[40]], jnp.int32), implementation="xla")
    with pytest.raises(ValueError, match="page table holds"):
        ops.paged_logits(cache, layout, 0, q8, wf, jnp.asarray([[1, 2]], jnp.int32),
                         jnp.asarray([[65]], jnp.int32), implementation="xla")


# ---------------------------------------------------------------------------------
# top-k over pools
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("splits", [None, 3], ids=["one-pass", "split+merge"])
def test_topk_pools_exact_ties_and_short_rows(rng, splits):
    rows, n, k = 6, 300, 16
    x = rng.integers(-4, 5, size=(rows, n)).astype(np.float32)       # heavy ties
    x[0, :40] = np.where(rng.random(40) < 0.5, -0.0, 0.0)           # -0 == +0
    x[1, 5] = np.nan                                                 # NaN ranks last
    x[1, 7] = -np.inf
    x[2] = rng.standard_normal(n).astype(np.float32)                 # distinct scores
    lengths = np.array([n, 9, n - 1, 0, 16, n + 50], np.int32)       # < k, == k, > n
    got = np.asarray(ops.topk_pools(jnp.asarray(x), jnp.asarray(lengths), k,
                                    implementation="pallas", splits=splits))
    want = np.asarray(ops.topk_pools(jnp.asarray(x), jnp.asarray(lengths), k, implementation="xla"))
    oracle = np_topk(x, lengths, k)
    np.testing.assert_array_equal(want, oracle)
    np.testing.assert_array_equal(got, oracle)
    assert (got[3] == -1).all() and (got[1, 9:] == -1).all() and got[1, 8] == 5   # NaN last of 9


@pytest.mark.parametrize("tune", ["no-prefilter", "prefilter", "small-chunks", "filter-auto"])
def test_topk_pools_tunings_are_exact(rng, tune):
    """Every launch shape of the sweep selects the same ids; the pre-filter floor
    admits at least k keys of each row (so it can never drop a top-k id)."""
    from pallas_kernels.topk import common as tk
    from pallas_kernels.topk import driver
    t = {"no-prefilter": tk.Tuning(buckets_per_k=0, mode="stream"),
         "prefilter": tk.Tuning(buckets_per_k=4, mode="stream"),
         "small-chunks": tk.Tuning(score_chunk=64, target_programs=16, buckets_per_k=2, mode="stream"),
         "filter-auto": tk.Tuning()}[tune]
    rows, n, k = 5, 2000, 24
    x = rng.standard_normal((rows, n)).astype(np.float32)
    x[1] = rng.integers(-2, 3, size=n)                               # ties across the floor
    x[2, : n // 2] = 7.0                                             # one run holds every top id
    lengths = np.array([n, n, n, 30, n - 333], np.int32)
    floor = np.asarray(tk.bucket_floor(jnp.asarray(x), jnp.asarray(lengths), k, 4 * k))
    keys = np.asarray(ref.order_key(jnp.asarray(x)))
    live = np.arange(n)[None, :] < lengths[:, None]
    assert (((keys >= floor[:, None]) & live).sum(axis=1) >= np.minimum(k, lengths)).all()
    assert floor[0] > 0 and floor[3] == 0                            # short row: no floor
    got = np.asarray(driver.topk_pools(jnp.asarray(x), jnp.asarray(lengths), k, tune=t))
    np.testing.assert_array_equal(got, np_topk(x, lengths, k))


def test_topk_filter_auto_cap():
    """filter_cap = 0 (the default) sizes the row's list: room for 4 k candidates when
    the row has a floor (never more than the row or MAX_SELECT_SLOTS), every key when
    it is too short for one. The H200 shape [64, 131072], k = 512: 2048 slots (the
    floor passes ~590 keys of a random row)."""
    from pallas_kernels.topk import common as tk
    t = tk.Tuning()
    assert t.mode == "filter" and t.filter_cap == 0
    assert tk.filter_cap(131072, 512, t) == 2048
    for n, k in [(131072, 512), (8192, 512), (3000, 512), (1 << 20, 512), (2000, 24), (50, 24)]:
        cap = tk.filter_cap(n, k, t)
        floor = tk.has_floor(n, k, t.buckets_per_k * k)
        assert cap & (cap - 1) == 0 and cap >= 16, (n, k)
        if floor:
            assert min(tk.FILTER_ROOM_PER_K * k, n, tk.MAX_SELECT_SLOTS) <= cap <= tk.MAX_SELECT_SLOTS, (n, k)
        else:
            assert n <= cap < 2 * n or cap == 16, (n, k)


# filter mode at test sizes: [6, 2048] scores, k = 24 (96 runs of 22 for the floor);
# "cap-64": 64-slot lists, the default select tiles (two programs rank 32 each),
# 16-bit floor in 2-bit steps;
# "cap-128": 128-slot lists, select programs of 16 candidates compared 32 at a time,
# exact 32-bit floor in 4-bit steps
FILTER_TUNINGS = {"cap-64": dict(mode="filter", filter_cap=64),
                  "cap-128": dict(mode="filter", filter_cap=128, select_ti=16, select_tj=32, radix_bits=4,
                                  floor_bits=32)}
FILTER_ROWS, FILTER_N, FILTER_K = 6, 2048, 24


def filter_case(rng, case):
    """(scores [6, 2048] f32, lengths [6] i32, whether filter mode must fall back)."""
    rows, n = FILTER_ROWS, FILTER_N
    x = rng.standard_normal((rows, n)).astype(np.float32)
    lengths = np.array([n, n - 333, 0, 20, FILTER_K, n + 50], np.int32)     # < k, == k, > n
    fallback = False
    if case == "ties-select":            # the k-th key tied; few keys reach the floor
        x = rng.integers(0, 200, size=(rows, n)).astype(np.float32)
    elif case == "ties-fallback":        # a third of each row at the top value: lists overflow
        x = rng.integers(-1, 2, size=(rows, n)).astype(np.float32)
        fallback = True
    elif case == "nan-zero":
        x[0] = -np.abs(x[0])
        x[0, rng.choice(n, 10, replace=False)] = np.where(rng.random(10) < 0.5, -0.0, 0.0)  # top: +-0 ties
        x[1, rng.random(n) < 0.2] = np.nan
        x[2] = np.where(rng.random(n) < 0.5, -0.0, 0.0)
        x[2, rng.random(n) < 0.3] = np.nan                                  # +-0 ties, NaN last
        lengths[2] = 40
        x[3, 2:7] = np.nan                                                  # 20 valid, 5 NaN: NaN ids last
        x[4, [3, 9]] = [np.inf, -np.inf]
        x[5, 100] = np.nan
    elif case == "overflow":             # one split holds far more than CAP keys >= floor
        x[2, : n // 2] = 7.0
        lengths[2] = n
        x[4] = 1.5                                                          # all equal
        fallback = True
    return x, lengths, fallback


@pytest.mark.parametrize("tune", list(FILTER_TUNINGS))
@pytest.mark.parametrize("case", ["random", "ties-select", "ties-fallback", "nan-zero", "overflow"])
def test_topk_pools_filter_mode_is_exact(rng, case, tune):
    """Filter mode == the oracle; it falls back to the stream path exactly when a
    candidate list overflows (and only then: plain data takes the select kernel)."""
    from pallas_kernels import topk as tk
    t = tk.Tuning(**FILTER_TUNINGS[tune])
    x, lengths, fallback = filter_case(rng, case)
    xs, ls = jnp.asarray(x), jnp.asarray(lengths)
    assert bool(tk.filter_overflowed(xs, ls, FILTER_K, tune=t)) == fallback
    got = np.asarray(tk.topk_pools(xs, ls, FILTER_K, tune=t))
    np.testing.assert_array_equal(got, np_topk(x, lengths, FILTER_K))


@pytest.mark.parametrize("ti, tj", [(64, 128), (8, 16)])
def test_topk_select_ignores_list_order(rng, ti, tj):
    """The filter's programs reserve list slots in whatever order the GPU runs them
    (interpret mode runs them in order): the select must give the same ids for any
    order of a row's list. The lists are shuffled per row, with ties at the k-th key
    (integer scores) and a row with fewer valid keys than k, and the slots past each
    row's count hold the best possible key (stale bytes on the GPU); a select that
    broke ties by list position, ranked against only its own tile, or let a slot past
    the count in, fails."""
    from pallas_kernels.topk import common as tk
    from pallas_kernels.topk import driver
    t = tk.Tuning(**FILTER_TUNINGS["cap-64"])
    x = rng.standard_normal((FILTER_ROWS, FILTER_N)).astype(np.float32)
    x[1] = rng.integers(0, 150, FILTER_N)
    lengths = np.array([FILTER_N, FILTER_N, 900, 10, FILTER_N, 3], np.int32)
    xs, ls = jnp.asarray(x), jnp.asarray(lengths)
    floor, cnt, keys, ids, over = driver._filter_lists(xs, ls, FILTER_K, None, t)
    assert not bool(jnp.any(over))
    cnt, keys, ids = np.asarray(cnt), np.array(keys), np.array(ids)
    for r in range(FILTER_ROWS):
        p = rng.permutation(cnt[r])
        keys[r, : cnt[r]], ids[r, : cnt[r]] = keys[r, p], ids[r, p]
        keys[r, cnt[r]:] = 0xFFFFFFFF                     # stale slots past the count: the best key,
        ids[r, cnt[r]:] = rng.integers(0, FILTER_N, keys.shape[1] - cnt[r])   # must never be ranked
    got = driver.select_candidates(xs, ls, floor, jnp.asarray(cnt), jnp.asarray(keys), jnp.asarray(ids),
                                   FILTER_K, ti=ti, tj=tj)
    np.testing.assert_array_equal(np.asarray(got), np_topk(x, lengths, FILTER_K))


def test_topk_fallback_writes_only_overflowed_rows(rng):
    """The fallback launch runs the exact streaming path on the rows whose count
    exceeds CAP and leaves every other row of the ids it is handed as it is: ids
    filled with a sentinel keep it byte for byte outside the overflowed rows, and
    those rows hold the oracle's top k (-1 padded, a short row included)."""
    from pallas_kernels.topk import common as tk
    from pallas_kernels.topk import fallback as topk_fallback
    rows, n, k, cap = 6, 700, 24, 64
    x = rng.integers(0, 50, size=(rows, n)).astype(np.float32)              # ties everywhere
    lengths = np.array([n, 300, 10, n, 0, n], np.int32)
    counts = np.array([cap + 1, 5, 10**6, cap, 0, 2 * cap], np.int32)       # rows 0, 2, 5 overflowed
    sentinel = np.full((rows, k), 0x5EED, np.int32)
    got = np.asarray(topk_fallback.stream_overflowed(jnp.asarray(x), jnp.asarray(lengths),
                                                     jnp.zeros((rows,), jnp.uint32), jnp.asarray(counts),
                                                     jnp.asarray(sentinel), cap=cap))
    over = counts > cap
    np.testing.assert_array_equal(got[~over], sentinel[~over])
    np.testing.assert_array_equal(got[over], np_topk(x, lengths, k)[over])
    assert (got[2, 10:] == -1).all() and tk.next_pow2(cap) == cap


@pytest.mark.gpu
def test_topk_pools_in_a_loop_equals_the_same_call_alone(rng):
    """Inside lax.map (each chunk's ids written into the loop's stacked output) the
    Pallas top-k gives the ids it gives called alone, where its last launch, the
    fallback, takes the select's ids as an aliased operand and rewrites only the
    overflowed rows: one row in eight is a plateau of equal scores, more candidates
    than the filter's list holds, and every other row keeps the select's ids."""
    chunks, rows, n, k = 2, 2048, 8192 + 77, 512
    x = rng.standard_normal((chunks, rows, n)).astype(np.float32)
    x[:, ::8] = np.where(rng.random((chunks, rows // 8, n)) < 0.5, 0.0, -1.0)    # ReLU-like plateaus
    lengths = rng.integers(k // 2, n + 1, (chunks, rows)).astype(np.int32)
    call = lambda a, l: ops.topk_pools(a, l, k, implementation="pallas")    # noqa: E731
    alone = np.stack([np.asarray(jax.jit(call)(jnp.asarray(x[i]), jnp.asarray(lengths[i])))
                      for i in range(chunks)])
    looped = np.asarray(jax.jit(lambda a, l: jax.lax.map(lambda c: call(*c), (a, l)))(
        jnp.asarray(x), jnp.asarray(lengths)))
    np.testing.assert_array_equal(looped, alone)
    for r in (0, 1, 8, 9):                                   # plateau rows (fallback) and select rows
        np.testing.assert_array_equal(alone[1, r], np_topk(x[1, r:r + 1], lengths[1, r:r + 1], k)[0])


def test_topk_filter_ignores_stale_run_ids(rng):
    """The filter loads its run ids before it knows the row's run count: entries past
    the count (stale bytes on the GPU; here negative, huge and real run ids) must be
    clamped to real runs and masked, never read as candidates."""
    from pallas_kernels import topk as tk
    from pallas_kernels.topk import driver
    from pallas_kernels.topk import filter as topk_filter
    k, n = FILTER_K, FILTER_N
    x = rng.standard_normal((FILTER_ROWS, n)).astype(np.float32)
    lengths = np.array([n, n - 333, 0, 20, k, n + 50], np.int32)
    xs, ls = jnp.asarray(x), jnp.asarray(lengths)
    buckets, cap = tk.Tuning().buckets_per_k * k, 1024
    floor, zeros, runs, n_runs = driver.key_floor(xs, ls, k, buckets)
    clean = [np.asarray(v) for v in topk_filter.filter_candidates(xs, ls, floor, zeros, runs, n_runs, buckets,
                                                                 cap=cap)]
    stale = np.array(runs)
    for r, nr in enumerate(np.asarray(n_runs)):
        stale[r, nr:] = rng.choice([-7, 2**30, 0, 5], stale.shape[1] - nr)
    got = [np.asarray(v) for v in topk_filter.filter_candidates(xs, ls, floor, jnp.zeros_like(zeros),
                                                               jnp.asarray(stale), n_runs, buckets, cap=cap)]
    np.testing.assert_array_equal(got[0], clean[0])
    for r in range(FILTER_ROWS):
        c = clean[0][r]
        assert sorted(got[2][r, :c]) == sorted(clean[2][r, :c]), r


def test_topk_emit_ranks_only_tiles_with_survivors(rng):
    """At k = 256 the rank emit works in 4 tiles of 64 survivors and runs only the
    tiles that hold some: rows with 256, 100, 64, 1 and 0 valid keys (the stream
    path's merge gets empty rows too) all match the oracle, -1 padded."""
    from pallas_kernels import topk as tk
    rows, n, k = 5, 4096, 256
    x = rng.standard_normal((rows, n)).astype(np.float32)
    x[1] = rng.integers(0, 300, n)                                      # ties at the k-th key
    lengths = np.array([n, 100, 64, 1, 0], np.int32)
    want = np_topk(x, lengths, k)
    for t in (tk.Tuning(), tk.Tuning(mode="stream")):
        got = np.asarray(tk.topk_pools(jnp.asarray(x), jnp.asarray(lengths), k, tune=t))
        np.testing.assert_array_equal(got, want, err_msg=t.mode)


@pytest.mark.parametrize("k, n", [(24, 2000), (16, 1024), (16, 100)], ids=["M=96", "M=64", "no-floor"])
@pytest.mark.parametrize("data", ["random", "ties", "narrow"])
def test_topk_floor_kernel_matches_bucket_floor(rng, data, k, n):
    """The Pallas floor (radix k-th of the run maxima) == the XLA sort floor, bit for bit,
    over all 32 bits and over the top 16 (low bits cleared: lower, still >= k keys);
    the kernel also hands the filter its zeroed counters."""
    from pallas_kernels.topk import common as tk
    from pallas_kernels.topk import driver
    rows, buckets = 5, 4 * k
    x = (rng.standard_normal((rows, n)) if data == "random"
         else rng.integers(-3, 4, size=(rows, n)) if data == "ties"
         else 1.5 + rng.random((rows, n)) * 1e-4).astype(np.float32)   # narrow: maxima share ~18 top bits
    x[1, rng.random(n) < 0.1] = np.nan
    lengths = np.array([n, n // 2, 0, 5, n + 7], np.int32)
    xs, ls = jnp.asarray(x), jnp.asarray(lengths)
    keys = np.asarray(ref.order_key(xs))
    live = np.arange(n)[None, :] < lengths[:, None]
    if not tk.has_floor(n, k, buckets):
        assert (np.asarray(tk.bucket_floor(xs, ls, k, buckets)) == 0).all()
        with pytest.raises(ValueError, match="no floor"):
            driver.key_floor(xs, ls, k, buckets)
        return
    top = np.asarray(tk.run_maxima(xs, ls, buckets))
    for bits, radix in [(32, 2), (32, 4), (16, 2)]:
        want = np.asarray(tk.bucket_floor(xs, ls, k, buckets, bits))
        got, zeros, runs, n_runs = (np.asarray(v) for v in
                                    driver.key_floor(xs, ls, k, buckets, bits=bits, radix_bits=radix))
        np.testing.assert_array_equal(got, want, err_msg=f"{bits} bits")
        np.testing.assert_array_equal(zeros, np.zeros(rows, np.int32))
        for r in range(rows):                                              # runs reaching the floor
            reach = np.flatnonzero(top[r] >= want[r])
            assert n_runs[r] == len(reach) and (runs[r, : n_runs[r]] == reach).all(), (bits, r)
        assert (want[[0, 1]] > 0).all() and (want[[2, 3]] == 0).all()
        assert (((keys >= want[:, None]) & live).sum(axis=1) >= np.minimum(k, lengths)).all()
    full = np.asarray(tk.bucket_floor(xs, ls, k, buckets))
    assert (want == full & np.uint32(0xFFFF0000)).all()


def test_kth_key_prefix_skip_is_exact(rng):
    """kth_key's prefix skip (search only below the bits every nonzero live key
    shares) == the full radix search, as plain jnp: rows whose keys share 0, a few,
    more than `bits` and all 32 bits, rows with zeros (empty runs), dead lanes, and
    fewer than k nonzero live keys; static and traced k; 1, 2 and 4-bit steps."""
    from pallas_kernels.topk import common as tk
    rows, c = 8, 256
    base = rng.integers(0, 2**32, (rows, 1), dtype=np.uint64)
    spread = np.array([32, 4, 10, 20, 0, 31, 2, 16], np.uint64)[:, None]     # low bits that vary per row
    low = (np.uint64(1) << spread) - np.uint64(1)                            # [rows, 1] mask of those bits
    key = ((base & ~low) | (rng.integers(0, 2**32, (rows, c), dtype=np.uint64) & low)).astype(np.uint32)
    key[1, rng.random(c) < 0.3] = 0                                          # empty runs
    key[2, 5:] = 0                                                          # 5 nonzero keys only
    live = rng.random((rows, c)) < 0.9
    key, live = jnp.asarray(key), jnp.asarray(live)
    for k in (1, 7, 100, jnp.asarray(rng.integers(1, 200, rows), jnp.int32)):
        for radix, bits in ((1, 32), (2, 32), (2, 16), (4, 12)):
            want = np.asarray(tk.kth_key(key, live, k, radix, bits))
            got = np.asarray(tk.kth_key(key, live, k, radix, bits, skip_prefix=True))
            np.testing.assert_array_equal(got, want, err_msg=f"k={k} radix={radix} bits={bits}")
    assert np.asarray(tk.kth_key(key, live, 7, 2, 32))[2] == 0


@pytest.mark.parametrize("rows, n, m", [(3, 4096, 256), (3, 2000, 96), (4, 1000, 64), (2, 300, 100),
                                        (4, 8200, 1025)],
                         ids=["exact", "ragged", "runs-16", "runs-3", "whole-runs"])
def test_topk_maxima_kernel_matches_xla(rng, rows, n, m):
    """The Pallas run maxima == the XLA reduce, bit for bit: NaN (key 1), lengths inside,
    past and at 0, runs that straddle the row's length, shapes where the runs do
    not tile the row (the masked load), and runs that tile the row but not the
    programs (1,025 runs of 8 over 3 programs of 512, as in a decode row of 32,832
    pools)."""
    from pallas_kernels.topk import common as tk
    from pallas_kernels.topk import maxima as topk_maxima
    x = rng.standard_normal((rows, n)).astype(np.float32)
    x[0, rng.random(n) < 0.1] = np.nan
    x[1, : n // 2] = -np.abs(x[1, : n // 2])
    lengths = np.array([n, n // 3 + 1, n + 5, 0][:rows], np.int32)
    xs, ls = jnp.asarray(x), jnp.asarray(lengths)
    want = np.asarray(tk.run_maxima(xs, ls, m))
    np.testing.assert_array_equal(np.asarray(topk_maxima.run_maxima(xs, ls, m)), want)
    run, runs = tk.run_geometry(n, m)
    assert want.shape == (rows, runs) and run & (run - 1) == 0 and runs <= m and runs * run >= n
    assert (want[0] > 0).all()
    assert (want[rows - 1] == 0).all() == (lengths[rows - 1] == 0)


def test_topk_filter_keeps_keys_at_the_floor(rng):
    """The k-th key sits exactly at the floor, its ties spread over several filter
    programs: the filter's count and list hold exactly the valid keys >= floor (one
    dropped at the floor, or lost in a reservation, shows), and the top-k is exact
    whether or not the list overflowed."""
    from pallas_kernels.topk import common as tk
    from pallas_kernels.topk import driver
    rows, n, k = 4, FILTER_N, FILTER_K
    buckets = tk.Tuning().buckets_per_k * k                                 # the floor's runs, as the
    run, m = tk.run_geometry(n, buckets)                                    # filter cuts them: 128 of 16
    x = rng.uniform(-2, -1, size=(rows, n)).astype(np.float32)              # every run max < 0
    for r in range(rows):
        runs = rng.permutation(m)
        n_above = [k - 1, k - 1, 0, 5][r]                                   # keys above the floor
        for q in runs[:n_above]:
            x[r, q * run + rng.integers(run)] = 1.0 + rng.random()
        for q in runs[n_above:n_above + k + 6 - n_above]:                   # runs whose max == floor
            x[r, q * run + rng.choice(run, 1 + r % 2 + (q % 3 == 0), replace=False)] = 0.5
    lengths = np.full((rows,), n, np.int32)
    xs, ls = jnp.asarray(x), jnp.asarray(lengths)
    floor = np.asarray(tk.bucket_floor(xs, ls, k, buckets))
    assert (floor == np.asarray(ref.order_key(jnp.float32(0.5)))).all()
    want = np_topk(x, lengths, k)
    assert (x[np.arange(rows), want[:, -1]] == 0.5).all()                   # k-th key == floor
    keys = np.asarray(ref.order_key(xs))
    at_least = keys >= floor[:, None]                                       # every key the filter keeps
    for name, kw in FILTER_TUNINGS.items():
        t = tk.Tuning(**kw)
        fl, cnt, kl, il, over = (np.asarray(v) for v in driver._filter_lists(xs, ls, k, None, t))
        np.testing.assert_array_equal(fl, floor, err_msg=name)              # 0.5 needs no low bits
        np.testing.assert_array_equal(cnt, at_least.sum(axis=1), err_msg=name)
        for r in range(rows):
            if cnt[r] <= kl.shape[1]:                                       # the list holds all of them
                assert sorted(il[r, : cnt[r]]) == list(np.flatnonzero(at_least[r])), (name, r)
                np.testing.assert_array_equal(kl[r, : cnt[r]], keys[r, il[r, : cnt[r]]])
        assert over.tolist() == (cnt > kl.shape[1]).tolist()
        np.testing.assert_array_equal(np.asarray(driver.topk_pools(xs, ls, k, tune=t)), want, err_msg=name)


def test_topk_pools_more_k_than_pools(rng):
    x = rng.standard_normal((3, 7)).astype(np.float32)
    lengths = np.array([7, 3, 100], np.int32)
    got = np.asarray(ops.topk_pools(jnp.asarray(x), jnp.asarray(lengths), 12, implementation="pallas"))
    np.testing.assert_array_equal(got, np_topk(x, lengths, 12))


# ---------------------------------------------------------------------------------
# expansion
# ---------------------------------------------------------------------------------
def test_expand_pools_rejects_out_of_range_and_appends_tail(rng):
    r, k, rows = 4, 9, 11
    seq = np.array([0, -1, 1, 3, 4, 5, 37, 38, 39, 40, 200], np.int32)
    ids = rng.integers(-1, 14, size=(rows, k)).astype(np.int32)
    ids[6, :3] = [9, 10, 2**30]                                     # 37 tokens: pools 0..8 only
    got = np.asarray(ops.expand_pools(jnp.asarray(ids), jnp.asarray(seq), r, implementation="pallas"))
    want = np.asarray(ops.expand_pools(jnp.asarray(ids), jnp.asarray(seq), r, implementation="xla"))
    oracle = np_expand(ids, seq, r)
    np.testing.assert_array_equal(want, oracle)
    np.testing.assert_array_equal(got, oracle)
    assert (got[6, :3 * r] == -1).all(), "pool ids >= seq_len // kpool must be rejected"
    assert (got[6, k * r:] == [36, -1, -1]).all() and (got[9, k * r:] == -1).all()
    assert got.max() < seq.max()


@pytest.mark.parametrize("max_elements", [None, 39 * 64, 39 * 300])
def test_expand_pools_blocks_and_windows_cover_every_row(rng, max_elements):
    """The expansion's programs fill consecutive blocks of the row-major output, so rows
    cross block edges; outputs above one launch's reach go in windows of rows (forced
    here by a small ``max_elements``: 5 windows of 61 rows, the last one ending at row
    301, and 2 windows of 151 rows sharing one). Every element equals the numpy oracle."""
    from pallas_kernels.read import expand
    r, k, rows = 4, 9, 301                                          # width 39: 11,739 elements, 3 blocks
    assert rows * (k * r + r - 1) % expand.BLOCK != 0
    seq = rng.integers(-3, 4 * k + 40, size=rows).astype(np.int32)
    ids = rng.integers(-2, k + 12, size=(rows, k)).astype(np.int32)
    kw = {} if max_elements is None else dict(max_elements=max_elements)
    got = np.asarray(expand.expand_pools(jnp.asarray(ids), jnp.asarray(seq), r, **kw))
    np.testing.assert_array_equal(got, np_expand(ids, seq, r))


# ---------------------------------------------------------------------------------
# fused paged logits -> top-k
# ---------------------------------------------------------------------------------
FUSED_CASES = [
    pytest.param(dict(block_size=1152, heads=32, next_n=1, k=12, splits=None), id="P32-H32-n1"),
    pytest.param(dict(block_size=512, heads=64, next_n=4, k=20, splits=3), id="P64-H64-n4-split"),
    pytest.param(dict(block_size=1152, heads=16, next_n=4, k=8, splits=2), id="P32-H16-n4-split"),
]


@pytest.mark.parametrize("dot, pages, warps", [(None, None, None), ("fp8", 1, 4), ("f16", 2, 4), ("fp8", 2, 4),
                                               ("f16", 4, 8)],
                         ids=["default", "fp8", "f16-2pages", "fp8-2pages", "f16-4pages-8warps"])
@pytest.mark.parametrize("case", FUSED_CASES)
def test_paged_topk_matches_reference(rng, case, dot, pages, warps):
    from pallas_kernels.read.paged_topk import paged_topk
    layout = CacheLayout(IndexerConfig(block_size=case["block_size"]), num_layers=1, num_blocks=6)
    cache = random_cache(rng, layout)
    s = layout.strides(0)
    b, n, k, max_pages = 3, case["next_n"], case["k"], 5
    q8, wf = random_queries(rng, b, n, case["heads"])
    table = jnp.asarray(random_tables(rng, layout, 0, b, max_pages))
    # non-uniform decode: uneven lengths, a short request, padding rows
    lengths = [max_pages * s.page_rows * 4, int(rng.integers(3 * k, 9 * k)) * 4, 7 * 4]
    counts = [n, max(1, n // 2), n]
    pos = decode_positions(rng, lengths, n, counts)
    ctx = jnp.asarray(ref.seq_lens_from_positions(pos) // s.kpool)
    got = np.asarray(paged_topk(cache, s, q8, wf, table, ctx, k, splits=case["splits"], dot=dot, pages=pages,
                                num_warps=warps)).reshape(b * n, k)
    logits = ref_logits(cache, s, q8, wf, table, ctx).reshape(b * n, -1)
    want = np.asarray(ref_topk(logits, ctx.reshape(-1), k))
    assert_selection(got, want, logits, np.asarray(ctx).reshape(-1), k)


def test_paged_topk_default_shape():
    """Prefill-sized dots (>= 64 rows) take the f16 dot over 2 pages per step, decode-sized
    ones the fp8 dot over 1 page; the defaults resolve to those shapes."""
    from pallas_kernels.read import paged_topk as pt
    assert pt.default_shape(128) == pt.PREFILL_SHAPE == ("f16", 2, 4)
    assert pt.default_shape(64) == pt.PREFILL_SHAPE
    assert pt.default_shape(32) == pt.DECODE_SHAPE == ("fp8", 1, 4)
    with pytest.raises(ValueError, match="pages and num_warps"):
        layout = CacheLayout(IndexerConfig(), num_layers=1, num_blocks=2)
        pt.paged_topk(jnp.zeros((layout.total_words,), jnp.uint32), layout.strides(0),
                      jnp.zeros((1, 1, 32, 128), jnp.float8_e4m3fn), jnp.zeros((1, 1, 32)),
                      jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32), 4, pages=3)


@pytest.mark.parametrize("splits", [1, 2])
def test_paged_topk_exact_ties(rng, splits):
    """Integer-valued q8, K8, scales and weights: every logit is an exact integer in any
    summation order, with many equal pools; the fused kernel must break ties by the
    lower pool id exactly as the reference does."""
    from pallas_kernels.read.paged_topk import paged_topk
    layout = CacheLayout(IndexerConfig(block_size=1152), num_layers=1, num_blocks=4)
    s = layout.strides(0)
    one, two, m_one = 0x38, 0x40, 0xB8                               # e4m3: 1.0, 2.0, -1.0
    classes = np.array(rng.choice([0, one, two, m_one], size=(5, 128)), np.uint8)
    slots = np.arange(s.num_pool_slots)
    cls = rng.integers(0, 5, size=slots.size)
    cache = write_pool_records(layout, layout.allocate(SENTINEL), 0, slots, classes[cls],
                               np.where(cls % 2 == 0, 1.0, 0.5).astype(np.float32))
    b, n, k = 2, 2, 24
    q8 = jnp.asarray(rng.choice([0, one, m_one], size=(b, n, 32, 128)).astype(np.uint8).view(ml_dtypes.float8_e4m3fn))
    wf = jnp.asarray(rng.choice([0.0, 0.5, 1.0, 2.0], size=(b, n, 32)).astype(np.float32))
    table = jnp.asarray(random_tables(rng, layout, 0, b, 4))
    ctx = jnp.asarray(np.array([[128, 100], [57, 128]], np.int32))
    got = np.asarray(paged_topk(cache, s, q8, wf, table, ctx, k, splits=splits)).reshape(b * n, k)
    logits = ref_logits(cache, s, q8, wf, table, ctx).reshape(b * n, -1)
    lg = np.asarray(logits)
    fin = lg[np.isfinite(lg)] * 4                                    # multiples of 1/4, exact
    assert (fin == np.round(fin)).all()
    want = np_topk(np.where(np.isfinite(lg), lg, -np.inf), np.asarray(ctx).reshape(-1), k)
    np.testing.assert_array_equal(np.asarray(ref_topk(logits, ctx.reshape(-1), k)), want)
    np.testing.assert_array_equal(got, want)
    # the k-th best really is inside a tie group (so tie-breaking was exercised)
    row = lg[0]
    assert (row[: int(ctx[0, 0])] == row[want[0, -1]]).sum() > 1


@pytest.mark.parametrize("n, chunk", [(37, 5), (37, 36), (37, 1), (40, 8), (6, 6), (6, 9)])
def test_map_query_rows_gives_each_row_fns_result(rng, n, chunk):
    """map_query_rows: every row's result is fn's on that row, through windows of equal
    width, at most `chunk` rows (the last overlapping the one before where n is not a
    multiple of the width), or one call when chunk >= n; a fn returning another row
    count than it was given is refused."""
    b = 2
    x = jnp.asarray(rng.standard_normal((b, n, 3, 4)).astype(np.float32))
    pos = jnp.asarray(rng.integers(-1, 1000, (b, n)).astype(np.int32))
    widths = []

    def fn(xs, ps):                                         # [B, c, 3, 4], [B, c] -> [B, c, 5] i32
        widths.append(xs.shape[1])
        v = jnp.floor(xs.sum(axis=(2, 3)) * 1000).astype(jnp.int32) + ps
        return jnp.stack([v, ps, v - ps, ps * 2, v * 3], axis=-1)

    want = np.asarray(fn(x, pos))
    widths.clear()
    got = np.asarray(jax.jit(lambda a, p: ref.map_query_rows(fn, chunk, a, p))(x, pos))
    np.testing.assert_array_equal(got, want)
    windows = -(-n // chunk)                                # ceil: at most `chunk` rows each
    expect = -(-n // windows)                               # equal widths (n itself for one call)
    assert set(widths) == {expect} and (expect <= chunk or chunk >= n)
    if chunk < n:
        with pytest.raises(ValueError, match="must return one"):
            ref.map_query_rows(lambda xs, ps: jnp.concatenate([ps, ps], axis=1), chunk, x, pos)
    # window_start: fn reads the whole x at its window's rows itself
    starts = []

    def fn_at(first, ps):                                   # first: the window's first row
        starts.append(first)
        return fn(jax.lax.dynamic_slice_in_dim(x, first, ps.shape[1], axis=1), ps)

    widths.clear()
    got = np.asarray(jax.jit(lambda p: ref.map_query_rows(fn_at, chunk, p, window_start=True))(pos))
    np.testing.assert_array_equal(got, want)
    assert starts and set(widths) == {expect}


def test_map_query_rows_copies_no_whole_input(rng):
    """The window loop's compiled temporaries stay below one copy of its inputs: each
    window's rows are sliced on their own and its results written into the answer, so
    neither a padded copy of every row nor a sliced copy of the result is made."""
    n, cols, chunk = 4096 + int(rng.integers(1, 900)), 256, 1000
    x = jax.ShapeDtypeStruct((1, n, cols), jnp.float32)
    p = jax.ShapeDtypeStruct((1, n), jnp.int32)

    def fn(xs, ps):                                         # [1, c, cols], [1, c] -> [1, c, 4] f32
        return (xs.sum(axis=-1) + ps)[..., None] * jnp.arange(4, dtype=jnp.float32)

    compiled = jax.jit(lambda a, b: ref.map_query_rows(fn, chunk, a, b)).lower(x, p).compile()
    stats = compiled.memory_analysis()
    if stats is None:
        pytest.skip("this backend reports no memory analysis")
    input_bytes = n * cols * 4
    assert stats.temp_size_in_bytes < input_bytes // 2, (stats.temp_size_in_bytes, input_bytes)


def test_long_prefill_runs_in_row_chunks(rng, monkeypatch, request):
    """Long prefills walk the query rows in chunks (fused: MAX_ROWS_PER_CALL rows per
    call; XLA/unfused: a logits budget); chunking must not change the selection. Both
    limits are read when a function is traced and jax's trace cache does not see a
    patched module global, so the caches are cleared after each patch (and at the end)."""
    import pallas_kernels.read.paged_topk as pt
    request.addfinalizer(jax.clear_caches)
    layout = CacheLayout(IndexerConfig(block_size=1152, topk=32), num_layers=1, num_blocks=3)
    cache = random_cache(rng, layout)
    s = layout.strides(0)
    n, k = 37, 8
    q8, wf = random_queries(rng, 1, n, 32)
    table = jnp.asarray(random_tables(rng, layout, 0, 1, 3))
    pos = jnp.asarray((np.arange(n) * 5 + 40)[None, :].astype(np.int32))
    ctx = ref.seq_lens_from_positions(pos) // s.kpool

    def select_xla():                                                  # traced now: reads the budget
        return np.asarray(jax.jit(lambda c, q, w, t, p: ops.select_tokens(
            c, layout, 0, q, w, t, p, short_context=False, implementation="xla"))(cache, q8, wf, table, pos))

    whole = select_xla()
    monkeypatch.setattr(pt, "MAX_ROWS_PER_CALL", 16)                   # 3 calls of 16 rows
    jax.clear_caches()
    got = np.asarray(pt.paged_topk(cache, s, q8, wf, table, ctx, k)).reshape(n, k)
    logits = ref_logits(cache, s, q8, wf, table, ctx).reshape(n, -1)
    assert_selection(got, np.asarray(ref_topk(logits, ctx.reshape(-1), k)), logits,
                     np.asarray(ctx).reshape(-1), k)
    monkeypatch.setattr(ref, "LOGITS_BUDGET_BYTES", 5 * 32 * 96 * 4)   # 5 query rows per chunk
    jax.clear_caches()
    assert ref.query_row_chunk(n, 32, 96) == 5
    chunked = select_xla()
    if jax.default_backend() == "cpu":                     # XLA's CPU dot: the same bits for any row count
        np.testing.assert_array_equal(chunked, whole)
    else:            # a GPU dot may sum in another order per row count (gpu_numerics_diag.py)
        r = layout.config.kpool
        (ids_c, tail_c), (ids_w, tail_w) = split_tokens(chunked, k, r), split_tokens(whole, k, r)
        np.testing.assert_array_equal(tail_c, tail_w)
        assert_selection(ids_c, ids_w, logits, np.asarray(ctx).reshape(-1), k)


def test_paged_topk_never_materialises_logits(rng):
    """The fused path's compiled program holds no f32 [rows, pools] array."""
    layout = CacheLayout(IndexerConfig(block_size=512), num_layers=1, num_blocks=70)
    q8 = jnp.zeros((2, 4, 32, 128), FP8)
    wf = jnp.zeros((2, 4, 32), jnp.float32)
    table = jnp.zeros((2, 128), jnp.int32)
    pos = jnp.full((2, 4), 64 * 128 * 4 - 1, jnp.int32)
    f = jax.jit(lambda c, q, w, t, p: ops.select_tokens(c, layout, 0, q, w, t, p, topk_tokens=256,
                                                         short_context=False, implementation="pallas",
                                                         path="fused"))
    hlo = f.trace(layout.allocate(0), q8, wf, table, pos).lower(lowering_platforms=("cuda",)).as_text()
    pools = 128 * 64
    assert f"x{pools}xf32>" not in hlo and f"{pools}xf32>" not in hlo, "fused path materialises logits"


# ---------------------------------------------------------------------------------
# whole selection vs the paging-free golden model (docs/semantics.md appendix C)
# ---------------------------------------------------------------------------------
@jax.jit
def _compress_pools(k, g, ape):                    # [m, R, 128] bf16 x2, [R, 128] -> (q8, scale)
    from pallas_kernels.core import numerics as nm
    r = k.shape[1]
    return nm.compress_pool([k[:, j] for j in range(r)], [g[:, j] for j in range(r)],
                            [ape[j] for j in range(r)])


def golden_pools(sc):
    """The golden model's pools (docs/semantics.md appendix C) of every request, straight
    from its token stream (no pages, no ring); the same as Scenario.golden_pools, in one
    compiled call."""
    r = sc.layout.config.kpool
    m = [q.length_tokens // r for q in sc.requests]
    k = np.concatenate([q.key[:mi * r].reshape(mi, r, 128) for q, mi in zip(sc.requests, m)])
    g = np.concatenate([q.gate[:mi * r].reshape(mi, r, 128) for q, mi in zip(sc.requests, m)])
    q8, scale = _compress_pools(jnp.asarray(k), jnp.asarray(g), jnp.asarray(sc.ape))
    q8, scale = np.asarray(q8).view(np.uint8), np.asarray(scale)
    ends = np.cumsum([0] + m)
    return [(q8[a:b], scale[a:b]) for a, b in zip(ends[:-1], ends[1:])]


def golden_scores(sc, q8, wf, rows_req, rows_pos, kpool):
    """f64 scores [rows, max_pools] from the golden pools of each row's request."""
    q = np.asarray(q8.astype(jnp.float32), np.float64).reshape(len(rows_req), -1, 128)   # [rows, Hp, 128]
    w = np.asarray(wf, np.float64).reshape(len(rows_req), -1)
    pools = golden_pools(sc)
    width = max(p[0].shape[0] for p in pools)
    out = np.full((len(rows_req), width), -np.inf)
    for r, (i, p) in enumerate(zip(rows_req, rows_pos)):
        if p < 0:
            continue
        kb, ks = pools[i]
        k8 = kb.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        m = (p + 1) // kpool
        s_ = np.maximum(q[r] @ k8[:m].T * ks[:m].astype(np.float64), 0.0)      # [Hp, m]
        out[r, :m] = w[r] @ s_
    return out


def ascending_then_empty(ids):
    """numpy oracle of ``reference.pool_order``: each row of ids ascending, -1 entries after the others."""
    big = np.iinfo(np.int32).max
    srt = np.sort(np.where(ids < 0, big, ids), axis=-1)
    return np.where(srt == big, -1, srt)


def split_tokens(tokens, k, r):
    """[rows, k*r + r - 1] tokens -> (pool ids [rows, k], tail [rows, r-1]); checks the layout."""
    ids = np.where(tokens[:, :k * r:r] >= 0, tokens[:, :k * r:r] // r, -1)
    expect = np.where(ids[..., None] >= 0, ids[..., None] * r + np.arange(r), -1).reshape(len(ids), -1)
    np.testing.assert_array_equal(tokens[:, :k * r], expect)
    return ids, tokens[:, k * r:]


def select_case(rng):
    """Three random requests (200-400, 40-120 and 30 tokens) prefilled into a sentinel
    cache by the reference: (config, layout, scenario, cache, lengths, page table
    [3, pages]). Shared with tests/scripts/gpu_numerics_diag.py."""
    cfg = IndexerConfig(block_size=512, topk=32)                    # P = 64, 8 pools, 35 columns
    layout = CacheLayout(cfg, num_layers=1, num_blocks=10)
    lengths = [int(rng.integers(200, 400)), int(rng.integers(40, 120)), 30]
    sc = Scenario.random(rng, layout, lengths)
    pre = sc.prefill(lengths)
    cache = jax.jit(ref.compress_prefill_strides, static_argnums=1)(
        layout.allocate(SENTINEL), layout.strides(0), jnp.asarray(pre["key"]), jnp.asarray(pre["gate"]),
        jnp.asarray(sc.ape), jnp.asarray(pre["slot_mapping"]))
    width = max(len(q.index_blocks) for q in sc.requests)
    bt = np.zeros((len(lengths), width), np.int64)
    for i, q in enumerate(sc.requests):
        bt[i, :len(q.index_blocks)] = q.index_blocks
    return cfg, layout, sc, cache, lengths, md.page_table_pages(bt, cfg)


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_select_tokens_vs_golden(rng, mode):
    cfg, layout, sc, cache, lengths, table = select_case(rng)
    r, k = cfg.kpool, cfg.topk_pools
    np.testing.assert_array_equal(golden_pools(sc)[1][0], sc.golden_pools(1)[0])   # the fast golden
    if mode == "decode":                                            # next_n = 4, non-uniform
        pos = decode_positions(rng, lengths, 4, counts=[4, 1, 3])
    else:                                                           # one request's prompt rows
        req = 0
        pos = np.arange(lengths[req], dtype=np.int32)[None, :]
        table = table[req:req + 1]
    b, n = pos.shape
    heads = 32 if mode == "decode" else 16
    q8, wf = random_queries(rng, b, n, heads)
    rows_req = np.repeat(np.arange(b), n) if mode == "decode" else np.zeros(n, int)
    gold = golden_scores(sc, q8, wf, rows_req, pos.reshape(-1), r)
    seq = np.where(pos >= 0, pos + 1, 0).reshape(-1)
    want_ids = np_topk(gold, seq // r, k)
    want_tail = np_expand(np.full((b * n, 1), -1, np.int32), seq, r)[:, r:]
    args = (cache, q8, wf, jnp.asarray(table), jnp.asarray(pos))
    results = {}
    paths = [("xla", None), ("pallas", "fused"), ("pallas", "unfused")]
    for impl, path in paths:
        f = jax.jit(lambda c, q, w, t, p, impl=impl, path=path: ops.select_tokens(
            c, layout, 0, q, w, t, p, short_context=False, implementation=impl, path=path))
        results[path or impl] = f(*args)
    for name, toks in results.items():
        toks = np.asarray(toks)
        assert toks.shape == (b * n, cfg.index_width), name
        ids, tail = split_tokens(toks, k, r)
        np.testing.assert_array_equal(tail, want_tail, err_msg=name)
        assert_selection(ids, want_ids, gold, seq // r, k, rtol=max(LOGIT_RTOL, 1e-5))
        assert (toks[seq == 0] == -1).all(), f"{name}: a padding row selected tokens"


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_select_tokens_in_pool_order_selects_the_same_tokens(rng, mode):
    """order="pool": each implementation returns the pools it selects with order="score",
    by ascending pool id with the -1 columns after them, and the same tail columns; an
    unknown order is refused."""
    cfg, layout, sc, cache, lengths, table = select_case(rng)
    r, k = cfg.kpool, cfg.topk_pools
    if mode == "decode":
        pos = decode_positions(rng, lengths, 4, counts=[4, 1, 3])
    else:
        pos = np.arange(lengths[0], dtype=np.int32)[None, :]
        table = table[:1]
    b, n = pos.shape
    q8, wf = random_queries(rng, b, n, 32)
    args = (cache, layout, 0, q8, wf, jnp.asarray(table), jnp.asarray(pos))
    reordered = 0
    for impl, path in (("xla", None), ("pallas", "unfused" if mode == "decode" else "fused")):
        by_score = np.asarray(ops.select_tokens(*args, short_context=False, implementation=impl, path=path))
        by_pool = np.asarray(ops.select_tokens(*args, short_context=False, implementation=impl, path=path,
                                               order="pool"))
        ids_s, tail_s = split_tokens(by_score, k, r)
        ids_p, tail_p = split_tokens(by_pool, k, r)
        np.testing.assert_array_equal(tail_p, tail_s, err_msg=f"{impl} {path}")
        np.testing.assert_array_equal(ids_p, ascending_then_empty(ids_s), err_msg=f"{impl} {path}")
        reordered += int((ids_p != ids_s).any(axis=1).sum())
    assert reordered > 0                                            # the score order is not already the pool order
    with pytest.raises(ValueError, match="order must be one of"):
        ops.select_tokens(*args, order="id")


def test_select_tokens_default_path_by_rows(rng):
    """path=None takes the unfused path for decode-sized row counts and the fused
    kernel (logits never in memory) for prefill chunks of FUSED_MIN_ROWS rows or
    more: the traced program holds the kernels of the chosen path only."""
    cfg, layout, sc, cache, lengths, table = select_case(rng)
    assert ops.default_read_path(1) == ops.default_read_path(ops.FUSED_MIN_ROWS - 1) == "unfused"
    assert ops.default_read_path(ops.FUSED_MIN_ROWS) == "fused"
    for n, want in ((4, "unfused"), (ops.FUSED_MIN_ROWS, "fused")):
        pos = np.full((1, n), lengths[0] - 1, np.int32)
        q8, wf = random_queries(rng, 1, n, 32)
        text = str(jax.make_jaxpr(lambda c, q, w, t, p: ops.select_tokens(
            c, layout, 0, q, w, t, p, short_context=False, implementation="pallas"))(
            cache, q8, wf, jnp.asarray(table[:1]), jnp.asarray(pos)))
        assert ("kpool_paged_topk" in text) == (want == "fused"), n
        assert ("kpool_paged_logits" in text) == (want == "unfused"), n


def test_short_context_path(rng):
    cfg = IndexerConfig(block_size=512, topk=32)
    layout = CacheLayout(cfg, num_layers=1, num_blocks=4)
    cache = random_cache(rng, layout)
    pos = np.array([[0, 1, 2, 3], [27, 28, 29, 30], [31, -1, -1, -1]], np.int32)   # every context <= 32
    q8, wf = random_queries(rng, 3, 4, 32)
    table = jnp.asarray(random_tables(rng, layout, 0, 3, 1))
    args = (cache, layout, 0, q8, wf, table, jnp.asarray(pos))
    want = np.where(np.arange(cfg.index_width)[None, :] <= pos.reshape(-1, 1), np.arange(cfg.index_width), -1)
    for impl in ("xla", "pallas"):
        np.testing.assert_array_equal(np.asarray(ops.select_tokens(*args, implementation=impl)), want)
    # traced positions: the choice happens on the device (lax.cond)
    f = jax.jit(lambda p: ops.select_tokens(cache, layout, 0, q8, wf, table, p, implementation="pallas"))
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(pos))), want)
    # docs/semantics.md 8, invariant 6: the sparse path selects the same token sets
    sparse = np.asarray(ops.select_tokens(*args, implementation="pallas", short_context=False))
    for row_s, row_w in zip(sparse, want):
        assert sorted(row_s[row_s >= 0].tolist()) == sorted(row_w[row_w >= 0].tolist())


# ---------------------------------------------------------------------------------
# every read kernel lowers to Triton IR (checked on any machine: Pallas lowers for
# "cuda" without a GPU; the Triton -> PTX compile itself happens only on the GPU)
# ---------------------------------------------------------------------------------
def test_read_kernels_lower_for_triton():
    from pallas_kernels.read.expand import expand_pools
    from pallas_kernels.read.paged_logits import paged_logits
    from pallas_kernels.read.paged_topk import paged_topk
    from pallas_kernels.read.query_quant import fwht_quant
    from pallas_kernels.topk import topk_pools

    import pathlib
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import offline_sass as osass

    def lower(f, *a):
        with osass.cuda_lowering():                    # an abstract GPU where the process has none
            return jax.jit(f).trace(*a).lower(lowering_platforms=("cuda",)).as_text()

    layout = CacheLayout(IndexerConfig(block_size=512), num_layers=1, num_blocks=8)
    s = layout.strides(0)
    c = layout.allocate(0)
    q8, w = jnp.zeros((2, 4, 64, 128), FP8), jnp.zeros((2, 4, 64), jnp.float32)
    t, ctx = jnp.zeros((2, 16), jnp.int32), jnp.zeros((2, 4), jnp.int32)
    texts = [
        lower(lambda q: fwht_quant(q, interpret=False), jnp.zeros((70, 128), jnp.bfloat16)),
        lower(lambda *a: paged_logits(c, s, *a, interpret=False), q8, w, t, ctx),
        lower(lambda *a: paged_topk(c, s, *a, 512, splits=1, interpret=False), q8, w, t, ctx),
        lower(lambda *a: paged_topk(c, s, *a, 64, splits=4, interpret=False), q8, w, t, ctx),
        lower(lambda x, l: topk_pools(x, l, 512, interpret=False), jnp.zeros((64, 131072)),
              jnp.zeros((64,), jnp.int32)),
        lower(lambda i, q: expand_pools(i, q, 4, interpret=False), jnp.zeros((9, 512), jnp.int32),
              jnp.zeros((9,), jnp.int32)),
    ]
    for txt in texts:
        assert "__gpu$xla.gpu.triton" in txt
