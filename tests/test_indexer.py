"""The nnx Indexer layer: checkpoint names and shapes, safetensors loading, the
projections (float64 oracle, batch invariance), and a chunked prefill through the
layer checked byte for byte against the paging-free golden model (docs/semantics.md appendix C)."""
import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from glm5_jax import ops
from glm5_jax.config import IndexerConfig
from glm5_jax.layout import CacheLayout
from glm5_jax.model import invariant as inv
from glm5_jax.model.indexer import (PARAM_NAMES, Indexer, indexer_state_dict, load_indexer_safetensors,
                                    save_indexer_safetensors)
from glm5_jax.serving.step_metadata import BucketMins, RowSpec, build_step, choose_shape
from glm5_jax.testing import _golden_compress

HIDDEN, QL = 64, 32
CFG = IndexerConfig(n_heads=4, topk=64, block_size=64)


def make(rng, cfg=CFG):
    idx = Indexer(cfg, HIDDEN, QL, rngs=nnx.Rngs(params=int(rng.integers(2**31))))
    # non-trivial norm parameters (they start as ones / zeros)
    idx.k_norm.weight[...] = jnp.asarray(rng.uniform(0.5, 1.5, 128), jnp.float32)
    idx.k_norm.bias[...] = jnp.asarray(rng.normal(0, 0.1, 128), jnp.float32)
    return idx


def bf16(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(ml_dtypes.bfloat16)


def test_parameter_names_shapes_dtypes(rng):
    idx = make(rng, IndexerConfig(n_heads=32, topk=2048, block_size=1152))
    flat = {".".join(map(str, k)): v for k, v in nnx.state(idx, nnx.Param).flat_state()}
    assert set(flat) == set(PARAM_NAMES)
    want = {"wq_b": ((32 * 128, QL), jnp.bfloat16), "wk": ((128, HIDDEN), jnp.bfloat16),
            "k_norm.weight": ((128,), jnp.float32), "k_norm.bias": ((128,), jnp.float32),
            "weights_proj": ((32, HIDDEN), jnp.float32),
            "index_kpool_compress_gate": ((128, HIDDEN), jnp.bfloat16),
            "index_kpool_compress_ape": ((4, 128), jnp.float32)}
    for name, (shape, dtype) in want.items():
        v = flat[name][...]
        assert v.shape == shape and v.dtype == dtype, name
    assert idx.k_norm.eps == 1e-6


def _params(idx):
    return {k: np.asarray(v).view(np.uint8) for k, v in indexer_state_dict(idx).items()}


def test_safetensors_round_trip_with_prefix(rng, tmp_path):
    a, b = make(rng), make(rng)
    prefix = "model.layers.3.self_attn.indexer."
    path = tmp_path / "indexer.safetensors"
    save_indexer_safetensors(a, path, prefix)
    used = load_indexer_safetensors(b, path, prefix)
    assert sorted(used) == sorted(prefix + k for k in indexer_state_dict(a))
    pa, pb = _params(a), _params(b)
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)


def test_loader_checkpoint_dtypes_raw_names_and_errors(rng, tmp_path):
    """A checkpoint as a model would ship it: bf16 weights_proj (loaded into the fp32
    copy exactly), the gate as a raw parameter name, the norm in bf16."""
    idx = make(rng)
    t = {"wq_b.weight": bf16(rng, (4 * 128, QL)), "wk.weight": bf16(rng, (128, HIDDEN)),
         "k_norm.weight": bf16(rng, (128,)), "k_norm.bias": bf16(rng, (128,)),
         "weights_proj.weight": bf16(rng, (4, HIDDEN)),
         "index_kpool_compress_gate": bf16(rng, (128, HIDDEN)),
         "index_kpool_compress_ape": rng.standard_normal((4, 128)).astype(np.float32)}
    path = tmp_path / "ckpt.safetensors"
    save_file(t, str(path))
    load_indexer_safetensors(idx, path)
    np.testing.assert_array_equal(np.asarray(idx.weights_proj[...]), t["weights_proj.weight"].astype(np.float32))
    np.testing.assert_array_equal(np.asarray(idx.wk[...]).view(np.uint16), t["wk.weight"].view(np.uint16))
    np.testing.assert_array_equal(np.asarray(idx.index_kpool_compress_gate[...]).view(np.uint16),
                                  t["index_kpool_compress_gate"].view(np.uint16))
    np.testing.assert_array_equal(np.asarray(idx.k_norm.bias[...]), t["k_norm.bias"].astype(np.float32))
    bad = dict(t)
    del bad["wk.weight"]
    save_file(bad, str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match="no tensor wk"):
        load_indexer_safetensors(idx, tmp_path / "missing.safetensors")
    bad = dict(t, **{"index_kpool_compress_ape": np.zeros((16, 128), np.float32)})
    save_file(bad, str(tmp_path / "shape.safetensors"))
    with pytest.raises(ValueError, match=r"index_kpool_compress_ape has shape \(16, 128\), expected \(4, 128\)"):
        load_indexer_safetensors(idx, tmp_path / "shape.safetensors")


@functools.lru_cache(maxsize=None)
def _project_fn(graphdef):
    return jax.jit(lambda st, x, qr: nnx.merge(graphdef, st).project(x, qr))


def _project(idx, x, qr):
    g, st = nnx.split(idx)
    return [np.asarray(v) for v in _project_fn(g)(st, jnp.asarray(x), jnp.asarray(qr))]


def test_projection_against_float64(rng):
    idx = make(rng)
    t = int(rng.integers(5, 40))
    x, qr = bf16(rng, (t, HIDDEN)), bf16(rng, (t, QL))
    k, gate, q, w = _project(idx, x, qr)
    f64 = lambda a: np.asarray(a).astype(np.float64)                      # noqa: E731
    xd, qd = f64(x), f64(qr)
    kr = (xd @ f64(idx.wk[...]).T).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    mu, var = kr.mean(-1, keepdims=True), kr.var(-1, keepdims=True)
    k_ref = (kr - mu) / np.sqrt(var + 1e-6) * f64(idx.k_norm.weight[...]) + f64(idx.k_norm.bias[...])
    np.testing.assert_allclose(f64(k), k_ref, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(f64(gate), xd @ f64(idx.index_kpool_compress_gate[...]).T, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(f64(q).reshape(t, -1), qd @ f64(idx.wq_b[...]).T, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(f64(w), xd @ f64(idx.weights_proj[...]).T, rtol=1e-5, atol=1e-5)
    assert k.dtype == gate.dtype == q.dtype == jnp.bfloat16 and w.dtype == np.float32
    assert q.shape == (t, 4, 128)


def test_projection_is_batch_invariant(rng):
    """A token's projections do not depend on how many other tokens are in the batch."""
    idx = make(rng)
    x, qr = bf16(rng, (48, HIDDEN)), bf16(rng, (48, QL))
    full = _project(idx, x, qr)
    for m in (1, 2, 3, 7, 17):
        part = _project(idx, x[-m:], qr[-m:])
        for a, b in zip(part, full):
            np.testing.assert_array_equal(a.view(np.uint8), b[-m:].view(np.uint8))


def test_invariant_linear_is_batch_invariant_and_accurate(rng):
    x, w = bf16(rng, (40, 96)), bf16(rng, (96, 24), 0.1)
    f = jax.jit(inv.linear)
    full = np.asarray(f(jnp.asarray(x), jnp.asarray(w)))
    for m in (1, 2, 5, 9):
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x[:m]), jnp.asarray(w))), full[:m])
    np.testing.assert_allclose(full, x.astype(np.float64) @ w.astype(np.float64), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="bf16"):
        inv.linear(jnp.zeros((2, 96), jnp.float32), jnp.asarray(w))


@pytest.mark.parametrize("op", ["linear", "linear_f32", "sum_sq_last"])
def test_ordered_chain_unroll_changes_no_bit(rng, monkeypatch, request, op):
    """The unroll of the ordered contractions is a launch-cost knob only: every
    unroll, including none and all, gives the same bits. UNROLL is read when the
    function is traced, and jax's trace cache does not see a patched module global:
    the caches are cleared for each unroll (else all five runs would reuse the first
    one's program), and the programs must differ."""
    monkeypatch.setattr(inv, "CONTRACTIONS", "xla")        # the XLA chain ("auto" is the kernel on a GPU)
    request.addfinalizer(jax.clear_caches)                 # (runs before monkeypatch restores UNROLL)
    x, w = bf16(rng, (9, 70)), bf16(rng, (70, 12), 0.1)
    args = {"linear": (x, w), "linear_f32": (x.astype(np.float32) * 1.37, w.astype(np.float32)),
            "sum_sq_last": (x.astype(np.float32) * 1.37,)}[op]
    args = tuple(map(jnp.asarray, args))
    outs, programs = [], set()
    for unroll in (1, 3, 8, 64, 70):
        monkeypatch.setattr(inv, "UNROLL", unroll)
        jax.clear_caches()
        f = jax.jit(getattr(inv, op))
        programs.add(f.lower(*args).as_text())
        outs.append(np.asarray(f(*args)))
    assert len(programs) == 5, "the unroll did not reach the traced program"
    for o in outs[1:]:
        np.testing.assert_array_equal(o.view(np.uint32), outs[0].view(np.uint32))


@pytest.mark.parametrize("mode", ["bf16", "f32"])
def test_ordered_linear_kernel_equals_the_chain(rng, monkeypatch, mode):
    """The one-launch projection kernel (pallas_kernels/contractions/ordered_linear.py) gives the
    XLA chain's bits, for any tile shape, and stays batch invariant; through
    ``invariant.CONTRACTIONS = "pallas"`` linear / linear_f32 use it."""
    from pallas_kernels.contractions.ordered_linear import ordered_linear
    monkeypatch.setattr(inv, "CONTRACTIONS", "xla")        # the chain ("auto" is the kernel on a GPU)
    x, w = bf16(rng, (37, 96)), bf16(rng, (96, 70), 0.1)
    chain = inv.linear if mode == "bf16" else inv.linear_f32
    if mode == "f32":                                      # operands with full f32 mantissas
        x = (x.astype(np.float32) * np.float32(1.37)).astype(np.float32)
        w = (w.astype(np.float32) * np.float32(0.77)).astype(np.float32)
    xj, wj = jnp.asarray(x), jnp.asarray(w)
    want = np.asarray(chain(xj, wj)).view(np.uint32)
    for tile in ((32, 64), (16, 32), (64, 128)):
        got = np.asarray(ordered_linear(xj, wj, mode=mode, tile=tile)).view(np.uint32)
        np.testing.assert_array_equal(got, want, err_msg=f"tile {tile}")
    for m in (1, 5):                                       # a row's bits do not depend on the others
        np.testing.assert_array_equal(np.asarray(ordered_linear(xj[:m], wj, mode=mode)).view(np.uint32), want[:m])
    monkeypatch.setattr(inv, "CONTRACTIONS", "pallas")
    np.testing.assert_array_equal(np.asarray(chain(xj.reshape(37, 1, 96), wj)).view(np.uint32).reshape(37, 70),
                                  want)


def test_attention_and_norm_kernels_equal_the_chains(rng, monkeypatch):
    """The batched (per-token) form of the projection kernel, with and without a
    transposed right operand, and the sum-of-squares kernel give the XLA chains'
    bits, for any tile / unroll; through ``invariant.CONTRACTIONS = "pallas"`` the
    attention and the norms use them."""
    from pallas_kernels.contractions.ordered_linear import ordered_linear
    from pallas_kernels.contractions.ordered_sumsq import ordered_sumsq
    monkeypatch.setattr(inv, "CONTRACTIONS", "xla")        # the chains ("auto" is the kernels on a GPU)
    g, m, k, n = 5, 3, 37, 21
    a, b = jnp.asarray(bf16(rng, (g, m, k))), jnp.asarray(bf16(rng, (g, k, n), 0.1))
    bt = jnp.swapaxes(b, 1, 2)                                            # [G, N, K], same values
    want = np.asarray(inv.batched_linear(a, b)).view(np.uint32)
    np.testing.assert_array_equal(np.asarray(inv.batched_linear(a, bt, b_transposed=True)).view(np.uint32), want)
    for tile, unroll in (((16, 16), 1), ((32, 64), 4), ((16, 32), 5)):
        for w_, tr in ((b, False), (bt, True)):
            got = ordered_linear(a, w_, mode="bf16", tile=tile, unroll=unroll, w_transposed=tr)
            np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want, err_msg=f"{tile} {unroll} {tr}")
    x = jnp.asarray(rng.standard_normal((19, 45)) * np.exp2(rng.integers(-20, 20, (19, 1))), jnp.float32)
    want_sq = np.asarray(inv.sum_sq_last(x)).view(np.uint32)
    for tile_rows, unroll in ((16, 1), (64, 4), (32, 7)):
        got = ordered_sumsq(x, tile_rows=tile_rows, unroll=unroll)
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want_sq, err_msg=f"{tile_rows} {unroll}")
    np.testing.assert_array_equal(np.asarray(ordered_sumsq(x[:2])).view(np.uint32), want_sq[:2])   # batch invariant
    monkeypatch.setattr(inv, "CONTRACTIONS", "pallas")
    np.testing.assert_array_equal(np.asarray(inv.batched_linear(a, bt, b_transposed=True)).view(np.uint32), want)
    np.testing.assert_array_equal(np.asarray(inv.sum_sq_last(x.reshape(19, 1, 45))).view(np.uint32).reshape(19),
                                  want_sq)
    with pytest.raises(ValueError, match="does not match"):
        inv.batched_linear(a, b, b_transposed=True)
    with pytest.raises(ValueError, match="must be bf16"):
        inv.batched_linear(a.astype(jnp.float32), b)
    with pytest.raises(ValueError, match="2-D float32"):
        ordered_sumsq(x.astype(jnp.bfloat16))


def _rows_operand(table_bits, rows):
    """The dense w that ``ordered_linear_rows`` reads: table row rows[g, j] as bf16
    (element 2c in the low half of word c), zeros where rows is outside the table."""
    n_rows, words = table_bits.shape
    live = (rows >= 0) & (rows < n_rows)
    w = table_bits[np.where(live, rows, 0)]                                      # [G, J, words] u32
    halves = np.stack([w & 0xFFFF, w >> 16], axis=-1).reshape(rows.shape + (2 * words,)).astype(np.uint16)
    return np.where(live[..., None], halves, 0).astype(np.uint16).view(ml_dtypes.bfloat16)


def test_ordered_linear_rows_equals_the_kernel_on_gathered_rows(rng):
    """The attention's contractions reading w's rows from a packed table by index
    (``ordered_linear_rows``: the scores with the rows as w's transposed rows, the
    weighted sum with one row per step) give the bits of ``ordered_linear`` on the rows
    gathered and unpacked beforehand, for any tile and unroll (odd ones put a step's
    half of a word at a traced parity); row ids -1 and past the table read zeros, also for
    a g without live rows and for a dead tail."""
    from pallas_kernels.contractions.ordered_linear import ordered_linear, ordered_linear_rows
    g, m, words, n_rows, w_tokens = 4, 3, 8, 29, 21                        # head_dim 16
    bits = rng.integers(0, 2**32, (n_rows, words), dtype=np.uint64).astype(np.uint32)
    bits &= ~np.uint32(0x7F807F80) | np.uint32(0x3C003C00)                 # bf16 halves of modest exponent
    rows = rng.integers(-1, n_rows + 3, (g, w_tokens)).astype(np.int32)     # -1 and past the table
    rows.flat[rng.choice(rows.size, 4, replace=False)] = [-1, -1, n_rows, n_rows + 2]
    rows[0] = -1                                        # no live row (a padding token)
    rows[1, 10:] = rng.choice([-1, n_rows], 11)         # a dead tail (sorted selections end in -1)
    dense = _rows_operand(bits, rows)                                        # [G, W, 16] bf16
    assert np.isfinite(dense.astype(np.float32)).all()
    table = jnp.asarray(bits)
    q = jnp.asarray(bf16(rng, (g, m, 2 * words)))
    p = jnp.asarray(bf16(rng, (g, m, w_tokens), 0.1))
    want_s = np.asarray(ordered_linear(q, jnp.asarray(dense), mode="bf16", w_transposed=True)).view(np.uint32)
    want_o = np.asarray(ordered_linear(p, jnp.asarray(dense), mode="bf16")).view(np.uint32)
    assert want_s.shape == (g, m, w_tokens) and want_o.shape == (g, m, 2 * words)
    for tile, unroll in ((None, None), ((16, 16), 3)):
        got_s = ordered_linear_rows(q, table, jnp.asarray(rows), w_transposed=True, tile=tile, unroll=unroll)
        got_o = ordered_linear_rows(p, table, jnp.asarray(rows), w_transposed=False, tile=tile, unroll=unroll)
        np.testing.assert_array_equal(np.asarray(got_s).view(np.uint32), want_s, err_msg=f"scores {tile} {unroll}")
        np.testing.assert_array_equal(np.asarray(got_o).view(np.uint32), want_o, err_msg=f"sum {tile} {unroll}")
    # lowered for CUDA (here on the CPU, as benchmarks/offline_sass.py does) and verified by
    # MLIR: the Triton lowering takes both forms (interpret mode accepts ops that it rejects)
    import pathlib
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import offline_sass as osass
    for a, tr in ((q, True), (p, False)):
        [(name, *_)] = osass.capture(lambda a_, t_, r_: ordered_linear_rows(a_, t_, r_, w_transposed=tr,
                                                                           interpret=False), a, table, jnp.asarray(rows))
        assert name == "ordered_linear_rows"
    with pytest.raises(ValueError, match="must be the table rows"):
        ordered_linear_rows(q[..., :8], table, jnp.asarray(rows), w_transposed=True)
    with pytest.raises(ValueError, match="does not match"):
        ordered_linear_rows(p[..., :5], table, jnp.asarray(rows), w_transposed=False)
    with pytest.raises(ValueError, match="uint32"):
        ordered_linear_rows(q, table.astype(jnp.int32), jnp.asarray(rows), w_transposed=True)


def test_ordered_linear_kernel_rejects_bad_input():
    from pallas_kernels.contractions.ordered_linear import ordered_linear
    x = jnp.zeros((4, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="needs bfloat16 operands"):
        ordered_linear(x.astype(jnp.float32), jnp.zeros((8, 3), jnp.float32), mode="bf16")
    with pytest.raises(ValueError, match="does not match"):
        ordered_linear(x, jnp.zeros((7, 3), jnp.bfloat16), mode="bf16")
    with pytest.raises(ValueError, match="mode must be"):
        ordered_linear(x, jnp.zeros((8, 3), jnp.bfloat16), mode="f16")
    with pytest.raises(ValueError, match="both be 2-D or both 3-D"):
        ordered_linear(x[None], jnp.zeros((8, 3), jnp.bfloat16), mode="bf16")
    with pytest.raises(ValueError, match="does not match"):
        ordered_linear(x[None], jnp.zeros((2, 8, 3), jnp.bfloat16), mode="bf16")
    assert ordered_linear(x[:0], jnp.zeros((8, 3), jnp.bfloat16), mode="bf16").shape == (0, 3)


def test_contractions_choice(monkeypatch):
    """"auto" runs the projection kernel on a GPU only; a bad value is refused."""
    monkeypatch.setattr(inv, "CONTRACTIONS", "auto")
    assert inv.contractions() == ("pallas" if jax.default_backend() == "gpu" else "xla")
    for mode in ("xla", "pallas"):
        monkeypatch.setattr(inv, "CONTRACTIONS", mode)
        assert inv.contractions() == mode
    monkeypatch.setattr(inv, "CONTRACTIONS", "triton")
    with pytest.raises(ValueError, match="CONTRACTIONS must be one of"):
        inv.linear(jnp.zeros((2, 8), jnp.bfloat16), jnp.zeros((8, 3), jnp.bfloat16))


def test_bf16_rounding_survives_f32_consumers(rng):
    """inv.bf16 followed by f32 arithmetic in one jitted function sees the ROUNDED
    value, ties to even, as numpy's bf16 cast. On the H200 a plain astype round trip
    is dropped by XLA (excess precision) and this compared the unrounded inputs."""
    u = rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)
    u = np.where((u >> 23 & 0xFF) == 0xFF, u & 0xBFFFFFFF, u)                   # no inf / NaN inputs
    u = np.where((u >> 23 & 0xFF) == 0, u | 0x00800000, u)                        # no subnormals (XLA's FTZ)
    u[:64] = (u[:64] & 0xFFFF0000) | 0x8000                                       # exact ties
    u[64:66] = [0x7F7FFFFF, 0xFF7FFFFF]                                           # round to +-inf
    x = u.view(np.float32)
    with np.errstate(over="ignore"):                                             # the largest values go to +-inf
        want = x.astype(ml_dtypes.bfloat16).astype(np.float32) * np.float32(3)    # exact: 8 bits x 2 bits
    got = np.asarray(jax.jit(lambda v: inv.bf16(v).astype(jnp.float32) * 3.0)(x))
    bad = (got.view(np.uint32) != want.view(np.uint32)) & ~(np.isnan(got) & np.isnan(want))
    assert not bad.any(), f"{bad.sum()} values differ from numpy's bf16 rounding, e.g. {x[bad][:3]}"
    b = jnp.asarray(x, jnp.bfloat16)
    assert inv.bf16(b) is b                                                       # already bf16: unchanged


def test_layer_prefill_in_non_aligned_chunks_matches_golden_pools(rng):
    """The layer's own projections, written in two chunks split mid-pool, give the
    paging-free golden pools (docs/semantics.md appendix C) and tail ring, byte for byte."""
    idx = make(rng)
    lay = CacheLayout(CFG, num_layers=1, num_blocks=8)
    n = int(rng.integers(70, 120))
    cut = int(rng.integers(5, n - 5))
    cut += 1 if cut % CFG.kpool == 0 else 0
    x, qr = bf16(rng, (n, HIDDEN)), bf16(rng, (n, QL))
    blocks, tail = [3, 6], 5
    g, st = nnx.split(idx)
    mins = BucketMins(prefill_width_tokens=128, table_blocks=2)

    @functools.partial(jax.jit, donate_argnums=1)
    def layer(st, cache, xs, qs, batch):
        return nnx.merge(g, st)(cache, xs, qs, batch, layout=lay, layer=0)

    cache = lay.allocate(0x5A)
    for s0, s1 in ((0, cut), (cut, n)):
        rows = [RowSpec(list(range(s1 - s0)), s0, blocks, tail)]
        shape = choose_shape(CFG, [], rows, next_n=1, mins=mins)
        arr = build_step(CFG, shape, [], rows)
        t_pad = shape.num_tokens
        xs = np.zeros((t_pad, HIDDEN), ml_dtypes.bfloat16)
        qs = np.zeros((t_pad, QL), ml_dtypes.bfloat16)
        off = shape.decode_rows * shape.decode_width_tokens
        xs[off:off + s1 - s0], qs[off:off + s1 - s0] = x[s0:s1], qr[s0:s1]
        cache, sel = layer(st, cache, jnp.asarray(xs), jnp.asarray(qs),
                           {k: jnp.asarray(v) for k, v in arr.as_dict().items()})
    k, gate, _, _ = _project(idx, x, qr)
    m = n // CFG.kpool
    q8, scale = _golden_compress(jnp.asarray(k[:m * 4]).reshape(m, 4, 128),
                                 jnp.asarray(gate[:m * 4]).reshape(m, 4, 128),
                                 idx.index_kpool_compress_ape[...])
    keys, scales = lay.pool_keys(cache, 0)
    slots = [blocks[(p * 4) // 64] * 16 + p % 16 for p in range(m)]      # 16 pools per 64-token block
    np.testing.assert_array_equal(keys.view(np.uint8)[slots], np.asarray(q8).view(np.uint8))
    np.testing.assert_array_equal(scales[slots].view(np.uint32), np.asarray(scale).view(np.uint32))
    tk, tg = lay.tail_ring(cache, 0)
    for p in range(m * 4, n):
        np.testing.assert_array_equal(tk[tail, p % CFG.ring].view(np.uint16), k[p].view(np.uint16))
        np.testing.assert_array_equal(tg[tail, p % CFG.ring].view(np.uint16), gate[p].view(np.uint16))
    sel = np.asarray(sel)
    assert sel.shape[1] == CFG.index_width


@pytest.mark.parametrize("impl", [pytest.param(None, marks=pytest.mark.gpu), "pallas"])
@pytest.mark.parametrize("width", [8, 128])
def test_layer_prefill_grid_takes_the_prefill_default_at_any_width(rng, width, impl):
    """The prefill grid's selection runs the kernels of prefill chunks also in a grid
    narrower than TC_MIN_ROWS, so a prompt's rows never change kernels with the step's
    bucket: with implementation=None the default of prefill chunks
    (``ops.default_select_implementation`` at TC_MIN_ROWS rows: the tensor-core path on a
    GPU with jax_triton), with "pallas" the fused kernel (interpret mode off the GPU).
    The decode grid keeps the Pallas kernels' decode path."""
    idx = make(rng)
    lay = CacheLayout(CFG, num_layers=1, num_blocks=8)
    if impl is None:
        assert ops.default_select_implementation(lay, 0, CFG.n_heads, ops.TC_MIN_ROWS) == "triton", \
            "jax_triton must be installed on the GPU machine"
    g, st = nnx.split(idx)
    mins = BucketMins(prefill_width_tokens=width, table_blocks=2)
    pre = [RowSpec(list(range(5)), 0, [3, 6], 5)]
    dec = [RowSpec([7], 70, [1, 2], 4)]
    shape = choose_shape(CFG, dec, pre, next_n=1, mins=mins)
    assert shape.prefill_width_tokens == width
    arr = {k: jnp.asarray(v) for k, v in build_step(CFG, shape, dec, pre).as_dict().items()}
    t_pad = shape.num_tokens
    xs, qs = jnp.asarray(bf16(rng, (t_pad, HIDDEN))), jnp.asarray(bf16(rng, (t_pad, QL)))
    text = str(jax.make_jaxpr(lambda s_, c, x, q, b: nnx.merge(g, s_)(c, x, q, b, layout=lay, layer=0,
                                                                     implementation=impl))(
        st, lay.allocate(0), xs, qs, arr))
    prefill_kernel = "kpool_paged_logits_tc" if impl is None else "kpool_paged_topk"
    assert prefill_kernel in text, f"the prefill grid's {prefill_kernel}"
    assert re.search(r"kpool_paged_logits(?!_tc)", text), "the decode grid's Pallas logits (unfused path)"
