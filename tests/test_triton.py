"""The Triton-language write kernels (implementation="triton", jax_triton).

GPU tests (marked gpu, skipped on CPU): byte-identical to the XLA reference on
the cases of test_write_kernels.py (tests/write_cases.py) and the vLLM vectors,
the padded-stride regression, no cache copy in the compiled HLO, caches past
2**31 bytes and past 2**31 words, out-of-range slots that write nothing.

CPU tests (CI): where jax_triton cannot run, implementation="triton" fails with
a clear error; implementation=None follows ops.DEFAULT_ORDER and never needs
jax_triton; nothing imports jax_triton unless asked to.
"""
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import ops
from glm5_jax.config import IndexerConfig
from glm5_jax.layout import CacheLayout
from glm5_jax.testing import Scenario
from pallas_kernels.core import addressing as addr
from pallas_kernels.core.strides import VIEW_COLS, WORD_BYTES
from pallas_kernels.triton_lang import _call
from write_cases import (CASES, SENTINEL, as_bytes, assert_pools_golden, assert_same_snapshots,
                         assert_updates_in_place, check_padded_stride, large_layout, last_blocks_scenario,
                         many_pools_case, ops_writers, random_workload, request_ends_case, run_writes, tile_case,
                         write_ops)

ON_GPU = jax.default_backend() == "gpu"
WRITE_OPS = ("seed_tail", "compress_prefill", "decode_update")


def _require_triton():
    reason = _call.unavailable_reason()
    if reason is not None:
        pytest.fail(f"the Triton kernels cannot run on this GPU machine: {reason}")


# =================================================================================
# GPU: bytes
# =================================================================================
@pytest.mark.gpu
@pytest.mark.parametrize("cfg, lay", CASES)
def test_triton_matches_reference_prefill_then_decode(rng, cfg, lay):
    _require_triton()
    layout, sc, pre, steps, upto = random_workload(rng, cfg, lay)
    ref_cache, ref_snaps = run_writes(ops_writers("xla"), layout, lay["layer"], sc, pre, steps)
    _, tri_snaps = run_writes(ops_writers("triton"), layout, lay["layer"], sc, pre, steps)
    assert_same_snapshots(ref_snaps, tri_snaps)
    sc.check_cache(ref_cache, upto, SENTINEL)


@pytest.mark.gpu
def test_vllm_seed_vector_triton():
    import vectors as V
    if not V.available():
        pytest.skip("conformance vectors not found")
    _require_triton()
    layout, sent, key, gate, tslot, want = V.seed_case()
    c = ops.seed_tail(layout.allocate(sent), layout, 0, jnp.asarray(key), jnp.asarray(gate),
                      jnp.asarray(tslot), implementation="triton")
    np.testing.assert_array_equal(V.cache_bytes(c, want.size), want)


@pytest.mark.gpu
def test_vllm_compress_vector_triton():
    import vectors as V
    if not V.available():
        pytest.skip("conformance vectors not found")
    _require_triton()
    layout, key, gate, ape, slot, want = V.compress_case()
    c = ops.compress_prefill(layout.allocate(0), layout, 0, jnp.asarray(key), jnp.asarray(gate),
                             jnp.asarray(ape), jnp.asarray(slot), implementation="triton")
    np.testing.assert_array_equal(V.cache_bytes(c, want.size), want)


@pytest.mark.gpu
@pytest.mark.parametrize("fault", [None, "dense-tail-stride"])
def test_padded_stride_regression_triton(rng, fault):
    _require_triton()
    from pallas_kernels.triton_lang.tail_seed import seed_tail as kernel
    check_padded_stride(rng, kernel, fault)


@pytest.mark.gpu
@pytest.mark.parametrize("kpool", [4, 16])
def test_triton_seed_with_request_ends(rng, kpool):
    """request_ends_tokens (only each request's last kpool rows visited) writes the reference's bytes."""
    _require_triton()
    layout, layer, args, ends = request_ends_case(rng, kpool)
    want = as_bytes(ops.seed_tail(layout.allocate(SENTINEL), layout, layer, *args, implementation="xla"))
    got = as_bytes(ops.seed_tail(layout.allocate(SENTINEL), layout, layer, *args, request_ends_tokens=ends,
                                 implementation="triton"))
    assert (want != SENTINEL).any()
    np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("tile, num_warps", [(1, 1), (16, 8)])
def test_triton_launch_shapes(rng, tile, num_warps):
    """Other tiles / warp counts than the defaults write the same bytes."""
    _require_triton()
    from pallas_kernels.triton_lang import decode_update as du, pool_compress as pc, tail_seed as ts
    layout, key, gate, ape, slot = tile_case(rng)
    s = layout.strides(0)
    want = as_bytes(ops.compress_prefill(layout.allocate(SENTINEL), layout, 0, key, gate, ape, slot,
                                         implementation="xla"))
    got = as_bytes(pc.compress_prefill(layout.allocate(SENTINEL), s, key, gate, ape, slot, tile_pools=tile,
                                       num_warps=num_warps))
    assert (want != SENTINEL).any()
    np.testing.assert_array_equal(got, want)
    # one request in tail block 2: only its last kpool rows are seeded, each to its own ring
    # row (the first version of this test gave several rows one ring row: a write race)
    ring = layout.config.ring
    tslot = jnp.asarray(np.arange(key.shape[0], dtype=np.int32) % ring + 2 * ring)
    want = as_bytes(ops.seed_tail(layout.allocate(SENTINEL), layout, 0, key, gate, tslot, implementation="xla"))
    got = as_bytes(ts.seed_tail(layout.allocate(SENTINEL), s, key, gate, tslot, tile_tokens=tile,
                                num_warps=num_warps))
    np.testing.assert_array_equal(got, want)
    n = key.shape[0] // 4 * 4
    pos = jnp.arange(n, dtype=jnp.int32).reshape(1, n)
    pk, pg = key[:n].reshape(1, n, 128), gate[:n].reshape(1, n, 128)
    first = addr.pool_slot(s, addr.block_page(s, 1, 0), 0)          # block 1: never the null block 0
    st = jnp.full((1, n), -1, jnp.int32).at[0, 3::4].set(first + jnp.arange(n // 4, dtype=jnp.int32))
    tsl = (jnp.arange(n, dtype=jnp.int32) % layout.config.ring + 3 * layout.config.ring).reshape(1, n)
    want = as_bytes(ops.decode_update(layout.allocate(SENTINEL), layout, 0, pk, pg, ape, st, tsl, pos,
                                      implementation="xla"))
    got = as_bytes(du.decode_update(layout.allocate(SENTINEL), s, pk, pg, ape, st, tsl, pos,
                                    num_warps=num_warps))
    np.testing.assert_array_equal(got, want)


# =================================================================================
# GPU: in place, large caches, out-of-range slots
# =================================================================================
@pytest.mark.gpu
@pytest.mark.parametrize("op", WRITE_OPS)
def test_triton_in_place_no_copy(rng, op):
    _require_triton()
    layout = CacheLayout(IndexerConfig(), num_layers=2, num_blocks=64)
    hlo = assert_updates_in_place(write_ops(rng, layout, "triton")[op], layout,
                                  f'custom_call_target="{_call.FFI_TARGET}"')
    assert f'custom_call_target="{_call.LEGACY_TARGET}"' not in hlo     # the typed-FFI launch only


def _changed_words_from(cache, first_row: int, fill_word: int) -> int:
    """Words != fill_word in rows >= first_row of the [rows, 1024] view (no host-side
    index past 2**31: jax with x64 off cannot slice there eagerly)."""
    def count(c):                 # a full-array compare, like the reference check that ran at 9 GiB
        v = c.reshape(-1, 1024)   # (the sliced form failed there with an XLA illegal instruction)
        rows = jax.lax.broadcasted_iota(jnp.int32, v.shape, 0)
        return jnp.sum((v != jnp.uint32(fill_word)) & (rows >= first_row))
    f = jax.jit(count)
    return int(f(cache))


@pytest.mark.gpu
@pytest.mark.parametrize("gib", [3, 9])
def test_triton_large_cache(rng, gib):
    """A cache of `gib` GiB whose last layer starts past byte 2**31 (3 GiB) or past
    word 2**31 (9 GiB: the int64 word index): triton == reference, and the writes
    land in the request's last blocks."""
    _require_triton()
    blocks = 4096
    layout, layer = large_layout(gib, blocks)
    base_bytes = layout.index_base_bytes(layer)
    assert base_bytes >= 2**31 and (gib < 9 or base_bytes // 4 >= 2**31)
    sc = last_blocks_scenario(rng, layout, layer, [2000, 999, 5])          # request 0 in the very last blocks
    pre = sc.prefill([1990, 999, 5])
    st = sc.decode([1990, 999, 5], [4, 0, 0], 4)
    out = {}
    for impl in ("xla", "triton"):
        a = {k: jnp.asarray(v) for k, v in pre.items()}
        d = {k: jnp.asarray(v) for k, v in st.items()}
        c = layout.allocate(0x5A)
        c = ops.compress_prefill(c, layout, layer, a["key"], a["gate"], jnp.asarray(sc.ape), a["slot_mapping"],
                                 implementation=impl)
        c = ops.seed_tail(c, layout, layer, a["key"], a["gate"], a["tslot"], implementation=impl)
        c = ops.decode_update(c, layout, layer, d["key"], d["gate"], jnp.asarray(sc.ape), d["slot_mapping"],
                              d["tslot"], d["positions"], implementation=impl)
        out[impl] = c
    ndiff = int(jax.jit(lambda x, y: jnp.sum(x != y))(out["xla"], out["triton"]))
    assert ndiff == 0, f"{ndiff} words differ between the Triton kernels and the reference"
    lo_bytes = layout.block_byte_range(layer, blocks - 3)[0]
    assert lo_bytes >= 2**31
    row_bytes = VIEW_COLS * WORD_BYTES                                             # one view row
    assert _changed_words_from(out["triton"], lo_bytes // row_bytes, 0x5A5A5A5A) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("fp_fusion", [False, True], ids=["fma-off", "fma-on"])
def test_triton_compress_many_pools_matches_golden(rng, fp_fusion):
    """65,536 fresh random pools through the Triton compress == the golden model, with
    Triton's FMA contraction off (the launches' setting) and on (its default: the
    numerics must not depend on it; before numerics._split12 used only bits, 21 of
    65,536 pools differed with it on)."""
    import dataclasses
    _require_triton()
    from pallas_kernels.triton_lang import pool_compress as tpc
    layout, sc, pre = many_pools_case(rng)
    launch = tpc.plan(layout.allocate(0x5A), layout.strides(0), pre["key"], pre["gate"], jnp.asarray(sc.ape),
                      pre["slot_mapping"])
    assert launch.fp_fusion is False
    c = _call.run(dataclasses.replace(launch, fp_fusion=fp_fusion))
    assert_pools_golden(c, layout, sc, f"triton compress, fp_fusion={fp_fusion}")


@pytest.mark.gpu
def test_triton_out_of_range_slots_never_write(rng):
    """Slots past the last block (docs/semantics.md B8) and padding write nothing, compiled."""
    _require_triton()
    layout = CacheLayout(IndexerConfig(), num_layers=1, num_blocks=8)
    t = 64
    key = jnp.asarray(rng.standard_normal((t, 128)), jnp.bfloat16)
    slot = jnp.asarray(np.resize(np.array([8 * 288, 10**6, 2**31 - 1, -1, -5], np.int32), t))
    tslot = jnp.asarray(np.resize(np.array([8 * 4, 8 * 4 + 3, 10**7, -1], np.int32), t))
    pos = jnp.asarray(np.resize(np.array([3, 7, 11, -1], np.int32), (16, 4)))
    ape = jnp.zeros((4, 128), jnp.float32)
    c = ops.compress_prefill(layout.allocate(0x33), layout, 0, key, key, ape, slot, implementation="triton")
    c = ops.seed_tail(c, layout, 0, key, key, tslot, implementation="triton")
    c = ops.decode_update(c, layout, 0, key.reshape(16, 4, 128), key.reshape(16, 4, 128), ape,
                          slot.reshape(16, 4), tslot.reshape(16, 4), pos, implementation="triton")
    assert int(jnp.sum(c != jnp.uint32(0x33333333))) == 0


@pytest.mark.gpu
def test_triton_chosen_by_default_order(rng, monkeypatch):
    """With triton first in DEFAULT_ORDER, implementation=None runs it (a jax_triton call
    in the HLO) and writes the reference's bytes."""
    _require_triton()
    monkeypatch.setitem(ops.DEFAULT_ORDER["gpu"], "seed_tail", ("triton", "pallas", "xla"))
    assert ops.default_implementation("seed_tail") == "triton"
    layout = CacheLayout(IndexerConfig(), num_layers=1, num_blocks=16)
    sc = Scenario.random(rng, layout, [40, 9])
    a = {k: jnp.asarray(v) for k, v in sc.prefill([40, 9]).items()}
    f = lambda impl: (lambda c: ops.seed_tail(c, layout, 0, a["key"], a["gate"], a["tslot"], implementation=impl))
    assert f'custom_call_target="{_call.FFI_TARGET}"' in jax.jit(f(None)).lower(layout.allocate(0)).compile().as_text()
    got = np.asarray(f(None)(layout.allocate(SENTINEL)))
    want = np.asarray(f("xla")(layout.allocate(SENTINEL)))
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


# =================================================================================
# CPU (CI): clear errors, dispatch, lazy import
# =================================================================================
def _small_call(op, impl, **kw):
    """A tiny call of write op `op` (checks run before any kernel)."""
    layout = CacheLayout(IndexerConfig(kpool=4, num_spec_tokens=3, block_size=128), num_layers=1, num_blocks=4)
    cache = layout.allocate(0)
    key = jnp.zeros((8, 128), jnp.bfloat16)
    ape = jnp.zeros((4, 128), jnp.float32)
    i8 = jnp.full((8,), -1, jnp.int32)
    if op == "seed_tail":
        return ops.seed_tail(cache, layout, 0, key, key, i8, implementation=impl, **kw)
    if op == "compress_prefill":
        return ops.compress_prefill(cache, layout, 0, key, key, ape, i8, implementation=impl, **kw)
    i2 = i8.reshape(2, 4)
    return ops.decode_update(cache, layout, 0, key.reshape(2, 4, 128), key.reshape(2, 4, 128), ape,
                             i2, i2, i2, implementation=impl, **kw)


@pytest.mark.skipif(ON_GPU, reason="checks the CPU error")
@pytest.mark.parametrize("op", WRITE_OPS)
def test_triton_on_cpu_raises_clear_error(op):
    with pytest.raises(ops.TritonUnavailableError,
                       match=rf"{op}: implementation='triton' is unavailable: no GPU backend "
                             r"\(jax.default_backend\(\) is 'cpu'\)"):
        _small_call(op, "triton")


@pytest.mark.parametrize("op", WRITE_OPS)
def test_triton_without_jax_triton_raises_clear_error(monkeypatch, op):
    """A GPU backend but no importable jax_triton: the error names the import failure and the extra."""
    monkeypatch.setattr(_call, "_backend", lambda: "gpu")
    monkeypatch.setattr(_call, "_import_error", lambda: "ModuleNotFoundError: No module named 'jax_triton'")
    with pytest.raises(ops.TritonUnavailableError,
                       match=rf"{op}: implementation='triton' is unavailable: jax_triton is not importable "
                             r"\(ModuleNotFoundError: No module named 'jax_triton'\); install the extra "
                             r"`pip install 'glm5-jax\[triton\]'` \(jax-triton==0.3.1"):
        _small_call(op, "triton")
    assert not _call.available()


def test_triton_rejects_interpret_and_ops_it_lacks():
    with pytest.raises(ValueError, match=r"seed_tail: implementation='triton' has no interpret mode"):
        _small_call("seed_tail", "triton", interpret=True)
    with pytest.raises(ValueError, match=r"expand_pools: implementation='triton' exists only for the ops"):
        ops.expand_pools(jnp.zeros((2, 8), jnp.int32), jnp.full((2,), 8, jnp.int32), 4, implementation="triton")
    with pytest.raises(ValueError, match=r"fwht_quant: implementation='triton' exists only for the ops"):
        ops.fwht_quant(jnp.zeros((2, 128), jnp.bfloat16), implementation="triton")
    with pytest.raises(ValueError, match=r"implementation must be one of \('xla', 'pallas', 'triton'\) or None"):
        _small_call("decode_update", "cuda")


def test_launch_lowering_reemits_the_serialized_launch_as_the_ffi_call():
    """_call._lower on a stand-in for jax_triton's rule (a legacy call whose backend config
    is the serialized launch): a call naming FFI_TARGET leaves as the typed-FFI call with
    that launch as its "opaque" attribute and the cache alias kept; without ``ffi`` (ROCm)
    it stays the legacy call; a call naming any other target is the rule's own."""
    import functools

    from jax.extend import core as jex_core
    from jax.interpreters import mlir

    prim = jex_core.Primitive("kpool_stub_launch")
    prim.def_abstract_eval(lambda x, **_: jax.core.ShapedArray(x.shape, x.dtype))
    launch = b"serialized\x00launch"

    def rule(ctx, *args, custom_call_target_name, input_output_aliases, **_):
        return jax.ffi.ffi_lowering(custom_call_target_name, api_version=2, backend_config=launch,
                                    operand_output_aliases=dict(input_output_aliases))(ctx, *args)

    def calls(ffi, target):
        for platform in ("cpu", "cuda", "rocm"):           # the lowering runs for the default backend
            mlir.register_lowering(prim, functools.partial(_call._lower, rule, ffi), platform=platform)
        f = jax.jit(lambda x: prim.bind(x, custom_call_target_name=target, input_output_aliases=((0, 0),)))
        return [ln for ln in f.lower(jnp.zeros(8, jnp.uint32)).as_text().splitlines() if "custom_call" in ln]

    (ffi_call,) = calls(True, _call.FFI_TARGET)
    assert f"@{_call.FFI_TARGET}(" in ffi_call and 'opaque = "serialized\\00launch"' in ffi_call
    assert "operand_index = 0" in ffi_call
    (legacy,) = calls(False, _call.FFI_TARGET)
    assert f"@{_call.LEGACY_TARGET}(" in legacy and 'backend_config = "serialized\\00launch"' in legacy
    for ffi in (True, False):
        (other,) = calls(ffi, "another_target")
        assert "@another_target(" in other and "opaque" not in other


def test_default_order_table_is_well_formed():
    for backend, table in ops.DEFAULT_ORDER.items():
        assert "*" in table, f"DEFAULT_ORDER[{backend!r}] needs a '*' row"
        for op, order in table.items():
            assert order and set(order) <= set(ops.IMPLEMENTATIONS), (backend, op, order)
            assert order[-1] == "xla", f"DEFAULT_ORDER[{backend!r}][{op!r}] must end with the always-available xla"
            assert "triton" not in order or op in ops.TRITON_OPS, (backend, op, order)


@pytest.mark.skipif(ON_GPU, reason="checks the CPU default")
def test_none_dispatch_on_cpu_is_xla_for_every_op():
    for op in WRITE_OPS + ("fwht_quant", "paged_logits", "topk_pools", "expand_pools", "select_tokens", None):
        assert ops.default_implementation(op) == "xla", op


def test_none_dispatch_falls_back_in_table_order(monkeypatch):
    """Pretend a GPU backend: the first available entry wins, triton only when jax_triton
    imports and only for the write ops; op=None gives the "*" row (pallas)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setitem(ops.DEFAULT_ORDER["gpu"], "decode_update", ("triton", "pallas", "xla"))
    monkeypatch.setitem(ops.DEFAULT_ORDER["gpu"], "seed_tail", ("triton", "xla"))
    for importable, want_decode, want_seed in ((True, "triton", "triton"), (False, "pallas", "xla")):
        monkeypatch.setattr(ops._triton, "available", lambda ok=importable: ok)
        assert ops.default_implementation("decode_update") == want_decode
        assert ops.default_implementation("seed_tail") == want_seed
        assert ops.default_implementation("compress_prefill") == "pallas"
        assert ops.default_implementation("topk_pools") == "pallas"
        assert ops.default_implementation() == "pallas"


def test_jax_triton_is_imported_only_on_request():
    """Importing the library and running a default op imports neither jax_triton nor
    the Triton kernel modules (which import triton)."""
    code = (
        "import sys, jax.numpy as jnp\n"
        "from glm5_jax import ops, reference\n"
        "from glm5_jax.config import IndexerConfig\n"
        "from glm5_jax.layout import CacheLayout\n"
        "import pallas_kernels.triton_lang, pallas_kernels.triton_lang._call\n"
        "cfg = IndexerConfig(kpool=4, num_spec_tokens=3, block_size=128)\n"
        "lay = CacheLayout(cfg, num_layers=1, num_blocks=4)\n"
        "k = jnp.zeros((8, 128), jnp.bfloat16)\n"
        "ops.seed_tail(lay.allocate(0), lay, 0, k, k, jnp.full((8,), -1, jnp.int32)).block_until_ready()\n"
        "kernels = ['pallas_kernels.triton_lang.' + m for m in ('tail_seed', 'pool_compress', 'decode_update',\n"
        "                                                         'numerics_tl', 'addressing_tl')]\n"
        "bad = [m for m in ['jax_triton'] + kernels if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    root = pathlib.Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
