"""Pallas write kernels == the XLA reference, byte for byte, on sentinel-filled caches.

On CPU the kernels run in interpret mode; on a GPU backend they run compiled
(the same tests; ``python -m pytest tests -m "not slow"`` on the H200). The cases
and the run are shared with test_triton.py (tests/write_cases.py).
"""
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import ops
from write_cases import (CASES, SENTINEL, assert_same_snapshots, check_padded_stride, ops_writers,
                         random_workload, run_writes)


@pytest.mark.parametrize("cfg, lay", CASES)
def test_pallas_matches_reference_prefill_then_decode(rng, cfg, lay):
    layout, sc, pre, steps, upto = random_workload(rng, cfg, lay)
    ref_cache, ref_snaps = run_writes(ops_writers("xla"), layout, lay["layer"], sc, pre, steps)
    _, pal_snaps = run_writes(ops_writers("pallas"), layout, lay["layer"], sc, pre, steps)
    assert_same_snapshots(ref_snaps, pal_snaps)
    # and the reference itself holds the golden pools / tails, sentinel everywhere else
    sc.check_cache(ref_cache, upto, SENTINEL)


def test_vllm_seed_vector_pallas(rng):
    import vectors as V
    if not V.available():
        pytest.skip("conformance vectors not found")
    layout, sent, key, gate, tslot, want = V.seed_case()
    c = ops.seed_tail(layout.allocate(sent), layout, 0, jnp.asarray(key), jnp.asarray(gate),
                      jnp.asarray(tslot), implementation="pallas")
    np.testing.assert_array_equal(V.cache_bytes(c, want.size), want)


def test_vllm_compress_vector_pallas():
    import vectors as V
    if not V.available():
        pytest.skip("conformance vectors not found")
    layout, key, gate, ape, slot, want = V.compress_case()
    c = ops.compress_prefill(layout.allocate(0), layout, 0, jnp.asarray(key), jnp.asarray(gate),
                             jnp.asarray(ape), jnp.asarray(slot), implementation="pallas")
    np.testing.assert_array_equal(V.cache_bytes(c, want.size), want)


@pytest.mark.parametrize("fault", [None, "dense-tail-stride"])
def test_padded_stride_regression_kernel(rng, fault):
    """Spec B1 through the Pallas seed kernel (see write_cases.check_padded_stride)."""
    from pallas_kernels.tail_seed import seed_tail as kernel
    check_padded_stride(rng, kernel, fault)


def test_decode_update_moves_row_bits_exactly(rng):
    """-0.0, subnormal and large bf16 key / gate values reach the ring (and the pools they
    complete) bit for bit, as through the reference. (A kernel that moved rows as floats,
    e.g. picking a row out of a tile with a sum, would turn -0.0 into +0.0: session 11's
    prefetching variant did until it moved the bits as integers.)"""
    cfg, lay = CASES[1].values                                  # ring of 2 x kpool, 3 layers
    layout, sc, pre, steps, _ = random_workload(rng, cfg, lay)
    special = np.array([-0.0, 0.0, 1e-40, -1e-40, 65504.0, -448.0, 2.0**-133, 1.0], np.float32)
    for st in steps:
        for name in ("key", "gate"):
            a = np.asarray(st[name], np.float32)
            live = np.asarray(st["positions"]) >= 0
            pick = rng.integers(0, special.size, size=a.shape)
            a = np.where(live[..., None] & (rng.random(a.shape) < 0.3), special[pick], a)
            a[live, 0] = -0.0                                   # every live row holds one for sure
            if name == "gate":                                  # keep the softmax finite
                a = np.clip(a, -60.0, 60.0)
            st[name] = a.astype(st[name].dtype)
    ref_cache, ref_snaps = run_writes(ops_writers("xla"), layout, lay["layer"], sc, pre, steps)
    _, pal_snaps = run_writes(ops_writers("pallas"), layout, lay["layer"], sc, pre, steps)
    assert_same_snapshots(ref_snaps, pal_snaps)
    neg_zero = [(np.asarray(st["key"]).view(np.uint16) == 0x8000).any() for st in steps]
    assert any(neg_zero), "the case must hold -0.0 keys"
